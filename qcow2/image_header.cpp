// SPDX-License-Identifier: GPL-2.0-or-later
// The image's header as qcow2 stores it: read and validated in steps (fixed fields, version 3
// fields, compression type, extensions, backing file name, table locations), the extensions'
// contents (the bitmaps' tables), and encoded again for the writer. The tables and the lookup
// through them are image.cpp's.
#include <algorithm>
#include <cstring>

#include "qcow2/error.h"
#include "qcow2/image.h"

namespace qcommit::qcow2 {

using boost::endian::load_big_u64;

namespace {

inline constexpr uint32_t kMaxSnapshots = 65536;
// Bitmap tables are read in pieces of at most this many bytes.
inline constexpr uint64_t kBitmapTableChunkBytes = 1ull << 20;

std::string bits_list(uint64_t mask, const std::vector<FeatureName>& names, uint8_t type) {
  std::string out;
  for (uint8_t bit = 0; bit < 64; ++bit) {
    if (!(mask & (1ull << bit))) continue;
    if (!out.empty()) out += ", ";
    out += "bit " + std::to_string(bit);
    for (const auto& f : names)
      if (f.type == type && f.bit == bit && !f.name.empty()) out += " (" + f.name + ")";
  }
  return out;
}

// The one list of the header's fixed fields, pairing each Header member with its RawHeader
// field: f(header field, raw field) for every field version 2 has (all but the magic) and, when
// `version3`, for those version 3 adds. Reading and writing the header both go through it.
template <typename H, typename R, typename F>
void for_each_fixed_field(H& h, R& raw, bool version3, F&& f) {
  f(h.version, raw.version);
  f(h.backing_file_offset, raw.backing_file_offset);
  f(h.backing_file_size, raw.backing_file_size);
  f(h.cluster_bits, raw.cluster_bits);
  f(h.size, raw.size);
  f(h.crypt_method, raw.crypt_method);
  f(h.l1_size, raw.l1_size);
  f(h.l1_table_offset, raw.l1_table_offset);
  f(h.refcount_table_offset, raw.refcount_table_offset);
  f(h.refcount_table_clusters, raw.refcount_table_clusters);
  f(h.nb_snapshots, raw.nb_snapshots);
  f(h.snapshots_offset, raw.snapshots_offset);
  if (!version3) return;
  f(h.incompatible_features, raw.incompatible_features);
  f(h.compatible_features, raw.compatible_features);
  f(h.autoclear_features, raw.autoclear_features);
  f(h.refcount_order, raw.refcount_order);
  f(h.header_length, raw.header_length);
}

// The fixed fields of a header as read. A version 2 header has none of version 3's: no feature
// bits, 16-bit refcounts, kHeaderV2Bytes long. No validation; the compression type, past the
// fixed fields, is read on its own.
[[nodiscard]] Header header_from_raw(const RawHeader& raw) {
  Header h;
  h.incompatible_features = h.compatible_features = h.autoclear_features = 0;
  h.refcount_order = kVersion2RefcountOrder;
  h.header_length = kHeaderV2Bytes;
  for_each_fixed_field(h, raw, raw.version.value() >= kVersion3,
                       [](auto& field, const auto& stored) { field = stored.value(); });
  return h;
}

// The fixed fields of `h` as stored: the inverse of header_from_raw. Only the first
// fixed_header_bytes(h) of it are written (a version 2 header ends before the feature bits).
[[nodiscard]] RawHeader raw_from_header(const Header& h) {
  RawHeader raw{};
  raw.magic = kMagic;
  for_each_fixed_field(h, raw, true, [](const auto& field, auto& stored) { stored = field; });
  return raw;
}

// Bytes of RawHeader a header of h's version has on disk.
[[nodiscard]] size_t fixed_header_bytes(const Header& h) {
  return h.version >= kVersion3 ? sizeof(RawHeader) : kHeaderV2Bytes;
}

}  // namespace

// Reads and validates the header in steps, each relying on the ones before it. Errors name the
// file: Error for what is not a qcow2 image, UnsupportedError for what is valid but not
// implemented, CorruptionError for inconsistent fields.
void Image::parse_header() {
  const uint64_t file_size = file_->size();
  read_fixed_fields(file_size);
  if (header_.version >= kVersion3) {
    check_version3_fields(file_size);
    read_compression_type();
  }
  const Header& h = header_;
  geo_ = Geometry{h.cluster_bits, (h.incompatible_features & kIncompatExtendedL2) != 0,
                  h.refcount_order};
  // Extensions before the feature checks: the feature name table helps name unknown bits.
  read_extension_area(file_size);
  check_features();
  read_backing_name(file_size);
  check_table_locations(file_size);
}

// Step 1: header_ from the fixed fields. Requires a file of at least a version 2 header; ensures
// the magic, a version this library reads (2 or 3) and a cluster size within the spec's range.
void Image::read_fixed_fields(uint64_t file_size) {
  const std::string& nm = name();
  if (file_size < kHeaderV2Bytes)
    throw Error(nm, "file too small to be a qcow2 image (" + std::to_string(file_size) + " bytes)");
  RawHeader raw{};
  std::vector<uint8_t> buf(sizeof raw);
  file_->read(0, buf);
  std::memcpy(&raw, buf.data(), sizeof raw);
  if (raw.magic.value() != kMagic) throw Error(nm, "not a qcow2 image (bad magic)");
  Header& h = header_;
  h = header_from_raw(raw);
  if (h.version != kVersion2 && h.version != kVersion3)
    throw UnsupportedError(nm, "unsupported qcow2 version " + std::to_string(h.version));
  if (h.cluster_bits < kMinClusterBits || h.cluster_bits > kMaxClusterBits)
    throw Error(nm, "unsupported cluster size 2^" + std::to_string(h.cluster_bits) +
                        " (must be 512 B to 2 MiB)");
}

// Step 2, version 3 only: the file holds the whole version 3 header, and header_length and
// refcount_order are within the spec's limits (header_length at most one cluster).
void Image::check_version3_fields(uint64_t file_size) const {
  const std::string& nm = name();
  const Header& h = header_;
  if (file_size < kHeaderV3MinBytes) throw Error(nm, "file too small for a qcow2 v3 header");
  if (h.header_length < kHeaderV3MinBytes)
    throw CorruptionError(
        nm, "header_length " + std::to_string(h.header_length) + " is smaller than 104 bytes");
  if (h.header_length > (1ull << h.cluster_bits))
    throw CorruptionError(
        nm, "header_length " + std::to_string(h.header_length) + " exceeds the cluster size");
  if (h.header_length % 8 != 0)
    throw CorruptionError(
        nm, "header_length " + std::to_string(h.header_length) + " is not a multiple of 8");
  if (h.refcount_order > kMaxRefcountOrder)
    throw CorruptionError(
        nm, "refcount_order " + std::to_string(h.refcount_order) + " is larger than 6");
}

// Step 3, version 3 only: the compression type byte, present when header_length goes past it
// (zlib otherwise); a type other than zlib needs the compression-type feature bit, and the bit
// needs the byte.
void Image::read_compression_type() {
  const std::string& nm = name();
  Header& h = header_;
  if (h.header_length > kCompressionTypeOffset) {
    uint8_t ct = 0;
    file_->read(kCompressionTypeOffset, std::span<uint8_t>(&ct, 1));
    if (ct > uint8_t(CompressionType::kZstd))
      throw UnsupportedError(nm, "unknown compression type " + std::to_string(ct));
    h.compression_type = CompressionType(ct);
  }
  if (h.compression_type != CompressionType::kZlib &&
      !(h.incompatible_features & kIncompatCompression))
    throw CorruptionError(nm, "compression type set without the compression-type feature bit");
  if ((h.incompatible_features & kIncompatCompression) && h.header_length <= kCompressionTypeOffset)
    throw CorruptionError(nm,
                          "compression-type feature bit set but the header has no field for it");
}

// Step 4: the header extensions, between header_length and the first of the end of the first
// cluster, the backing file name and the end of the file (parse_extensions).
void Image::read_extension_area(uint64_t file_size) {
  const Header& h = header_;
  const uint64_t ext_start = h.header_length;
  uint64_t ext_end = cluster_size();
  if (h.backing_file_offset != 0 && h.backing_file_offset < ext_end)
    ext_end = h.backing_file_offset;
  // The end is clamped to the file first: a header_length beyond the end of a short file left
  // start > end, and the extension area's size wrapped (std::length_error, no file named).
  ext_end = std::min(ext_end, file_size);
  if (ext_start < ext_end) parse_extensions(ext_start, ext_end);
}

// Step 5: nothing the header asks for is beyond this library (encryption, unknown incompatible
// features, named from the feature name table) and the features agree with the geometry and
// the extensions.
void Image::check_features() const {
  const std::string& nm = name();
  const Header& h = header_;
  if (h.crypt_method != 0)
    throw UnsupportedError(nm, std::string("encrypted images are not supported (") +
                                   (h.crypt_method == 1   ? "AES"
                                    : h.crypt_method == 2 ? "LUKS"
                                                          : "unknown") +
                                   " encryption)");
  if (uint64_t unknown = h.incompatible_features & ~kIncompatKnown)
    throw UnsupportedError(
        nm, "unsupported incompatible feature " + bits_list(unknown, feature_names_, 0));
  if (geo_.extended_l2 && h.cluster_bits < 14)
    throw CorruptionError(nm, "extended L2 entries need a cluster size of at least 16 KiB");
  if (!(h.incompatible_features & kIncompatDataFile) && data_file_name_)
    throw CorruptionError(nm, "data file name extension present without the data-file feature bit");
}

// Step 6: backing_name_, when the header names one (inside the first cluster and the file, at
// most kMaxBackingNameBytes, no NUL byte); a backing format without a backing file is dropped.
void Image::read_backing_name(uint64_t file_size) {
  const std::string& nm = name();
  const Header& h = header_;
  const uint64_t cs = cluster_size();
  // With an offset of 0 there is no backing file, whatever the size says (as in QEMU).
  if (h.backing_file_offset != 0) {
    if (h.backing_file_size > kMaxBackingNameBytes || h.backing_file_offset >= cs ||
        h.backing_file_size > cs - h.backing_file_offset)
      throw CorruptionError(nm, "backing file name too long (" +
                                    std::to_string(h.backing_file_size) +
                                    " bytes, at most 1023 within the first cluster)");
    if (h.backing_file_offset + h.backing_file_size > file_size)
      throw CorruptionError(nm, "backing file name lies beyond end of file");
    std::string s(h.backing_file_size, '\0');
    file_->read(h.backing_file_offset,
                std::span<uint8_t>(reinterpret_cast<uint8_t*>(s.data()), s.size()));
    if (s.find('\0') != std::string::npos)
      throw CorruptionError(nm, "backing file name contains a NUL byte");
    if (!s.empty()) backing_name_ = s;
  }
  if (backing_format_ && !backing_name_)
    backing_format_.reset();  // a format without a file means nothing
}

// Step 7: the L1 table, refcount table and snapshot table lie where they may (cluster aligned,
// past the header, inside the file) and are no larger than QEMU allows, before anything reads
// them or allocates memory in proportion to a header field.
void Image::check_table_locations(uint64_t file_size) const {
  const std::string& nm = name();
  const Header& h = header_;
  const uint64_t cs = cluster_size();
  const uint64_t needed_l1 = geo_.l1_entries_for(h.size);
  if (uint64_t(h.l1_size) * 8 > kMaxL1TableBytes)
    throw CorruptionError(
        nm, "L1 table of " + std::to_string(h.l1_size) + " entries is larger than 32 MiB");
  if (h.l1_size < needed_l1)
    throw CorruptionError(nm, "L1 table has " + std::to_string(h.l1_size) + " entries; " +
                                  std::to_string(needed_l1) + " needed for the virtual size");
  if (h.l1_size > 0) {
    if (h.l1_table_offset % cs != 0)
      throw CorruptionError(
          nm, "L1 table offset " + hex(h.l1_table_offset) + " is not cluster aligned");
    if (h.l1_table_offset == 0)
      throw CorruptionError(nm, "L1 table at offset 0 overlaps the header");
    if (h.l1_table_offset > file_size || uint64_t(h.l1_size) * 8 > file_size - h.l1_table_offset)
      throw CorruptionError(nm,
                            "L1 table at " + hex(h.l1_table_offset) + " lies beyond end of file");
  }
  const uint64_t reftable_bytes = uint64_t(h.refcount_table_clusters) << h.cluster_bits;
  if (reftable_bytes > kMaxRefcountTableBytes)
    throw CorruptionError(nm, "refcount table of " + std::to_string(h.refcount_table_clusters) +
                                  " clusters is larger than 8 MiB");
  if (h.refcount_table_clusters == 0) throw CorruptionError(nm, "image has no refcount table");
  if (h.refcount_table_offset % cs != 0 || h.refcount_table_offset == 0)
    throw CorruptionError(nm,
                          "refcount table offset " + hex(h.refcount_table_offset) + " is invalid");
  if (h.refcount_table_offset > file_size || reftable_bytes > file_size - h.refcount_table_offset)
    throw CorruptionError(
        nm, "refcount table at " + hex(h.refcount_table_offset) + " lies beyond end of file");
  if (h.nb_snapshots > kMaxSnapshots)
    throw CorruptionError(nm,
                          "too many internal snapshots (" + std::to_string(h.nb_snapshots) + ")");
  if (h.nb_snapshots > 0 && (h.snapshots_offset % cs != 0 || h.snapshots_offset >= file_size))
    throw CorruptionError(nm, "snapshot table offset " + hex(h.snapshots_offset) + " is invalid");
}

void Image::parse_extensions(uint64_t start, uint64_t end) {
  const std::string& nm = name();
  std::vector<uint8_t> area(end - start);
  file_->read(start, area);
  size_t pos = 0;
  while (true) {
    if (area.size() - pos < sizeof(RawExtensionHeader)) {
      // QEMU treats a header area without room for an end marker as the end.
      return;
    }
    RawExtensionHeader eh{};
    std::memcpy(&eh, area.data() + pos, sizeof eh);
    const uint32_t type = eh.type.value(), len = eh.length.value();
    pos += sizeof eh;
    if (type == kExtEnd) return;
    if (len > area.size() - pos)
      throw CorruptionError(nm, "header extension " + hex(type) + " of " + std::to_string(len) +
                                    " bytes overruns the header area");
    Extension ext{type,
                  std::vector<uint8_t>(area.begin() + long(pos), area.begin() + long(pos + len))};
    const auto& d = ext.data;
    bool keep = true;  // kept in extensions_, written back by a header rewrite
    switch (type) {
      case kExtBackingFormat:
        if (len > 1023) throw CorruptionError(nm, "backing format name too long");
        backing_format_ = std::string(d.begin(), d.end());
        if (auto z = backing_format_->find('\0'); z != std::string::npos)
          backing_format_->resize(z);
        break;
      case kExtFeatureNameTable:
        for (size_t i = 0; i + sizeof(RawFeatureName) <= d.size(); i += sizeof(RawFeatureName)) {
          FeatureName f;
          f.type = d[i];
          f.bit = d[i + 1];
          const char* n = reinterpret_cast<const char*>(d.data() + i + 2);
          f.name.assign(n, strnlen(n, 46));
          feature_names_.push_back(std::move(f));
        }
        break;
      case kExtBitmaps: {
        if (len < sizeof(RawBitmapsExtension))
          throw CorruptionError(nm, "bitmaps extension too short");
        RawBitmapsExtension b{};
        std::memcpy(&b, d.data(), sizeof b);
        const BitmapsInfo info{b.nb_bitmaps.value(), b.bitmap_directory_size.value(),
                               b.bitmap_directory_offset.value()};
        // The autoclear bit was parsed with the header (always clear in a v2 image).
        if (header_.autoclear_features & kAutoclearBitmaps) {
          bitmaps_ = info;
        } else {
          stale_bitmaps_ = info;
          keep = false;
        }
        break;
      }
      case kExtDataFile: {
        std::string s(d.begin(), d.end());
        if (auto z = s.find('\0'); z != std::string::npos) s.resize(z);
        data_file_name_ = s;
        break;
      }
      case kExtFullDiskEncryption:
      default:
        break;  // kept as-is in extensions_
    }
    if (keep) extensions_.push_back(std::move(ext));
    pos += size_t(padded_extension_bytes(len));
    if (pos > area.size()) return;
  }
}

std::optional<std::string> Image::visit_bitmap_extents(const BitmapExtentVisitor& visit) {
  if (!bitmaps_) return std::nullopt;
  const BitmapsInfo bi = *bitmaps_;
  const uint64_t cs = cluster_size();
  const uint64_t file_size = file_->size();
  const std::string dir_at = "bitmap directory at " + hex(bi.directory_offset);
  if (bi.nb_bitmaps == 0 || bi.nb_bitmaps > kMaxBitmaps)
    return "bitmaps extension lists " + std::to_string(bi.nb_bitmaps) + " bitmaps (1 to " +
           std::to_string(kMaxBitmaps) + " allowed)";
  if (bi.directory_offset % cs != 0 || bi.directory_offset == 0)
    return dir_at + " is not a cluster-aligned offset past the header";
  if (bi.directory_size > kMaxBitmapDirectoryBytes)
    return dir_at + " of " + std::to_string(bi.directory_size) + " bytes is larger than " +
           std::to_string(kMaxBitmapDirectoryBytes);
  visit({bi.directory_offset, bi.directory_size, "bitmap directory"});
  if (bi.directory_offset > file_size || bi.directory_size > file_size - bi.directory_offset)
    return dir_at + " lies beyond end of file";
  std::vector<uint8_t> dir(bi.directory_size);
  file_->read(bi.directory_offset, dir);
  // Distinct tables lie inside the file: more table bytes than the file holds are overlapping or
  // out of range, and reading them would cost time in proportion to a hostile header's numbers.
  uint64_t table_bytes = 0;
  std::vector<uint8_t> chunk;
  size_t pos = 0;
  for (uint32_t k = 0; k < bi.nb_bitmaps; ++k) {
    const std::string entry_at =
        "bitmap directory entry " + std::to_string(k) + " (" + dir_at + ")";
    if (dir.size() - pos < sizeof(RawBitmapDirectoryEntry))
      return dir_at + " holds fewer than the " + std::to_string(bi.nb_bitmaps) + " bitmaps listed";
    RawBitmapDirectoryEntry e{};
    std::memcpy(&e, dir.data() + pos, sizeof e);
    const uint64_t entry_bytes =
        sizeof e + uint64_t(e.extra_data_size.value()) + e.name_size.value();
    if (entry_bytes > dir.size() - pos) return entry_at + " overruns the directory";
    pos += size_t((entry_bytes + 7) & ~uint64_t(7));
    pos = std::min(pos, dir.size());
    const uint64_t table = e.bitmap_table_offset.value();
    const uint64_t table_size = uint64_t(e.bitmap_table_size.value()) * 8;
    if (table_size == 0) continue;
    const std::string table_at = "bitmap table at " + hex(table) + " (" + entry_at + ")";
    if (table % cs != 0 || table == 0)
      return table_at + " is not a cluster-aligned offset past the header";
    visit({table, table_size, "bitmap table"});
    if (table > file_size || table_size > file_size - table)
      return table_at + " lies beyond end of file";
    table_bytes += table_size;
    if (table_bytes > file_size) return "bitmap tables (" + dir_at + ") are larger than the file";
    for (uint64_t done = 0; done < table_size; done += chunk.size()) {
      chunk.resize(size_t(std::min(table_size - done, kBitmapTableChunkBytes)));
      file_->read(table + done, chunk);
      for (size_t i = 0; i < chunk.size(); i += 8) {
        const uint64_t data = load_big_u64(chunk.data() + i) & kBitmapTableOffsetMask;
        if (!data) continue;
        if (data % cs != 0)
          return "bitmap data cluster at " + hex(data) + " (" + table_at +
                 ") is not cluster aligned";
        visit({data, cs, "bitmap data"});
      }
    }
  }
  return std::nullopt;
}

std::vector<uint8_t> Image::encode_header(const Header& h) {
  const uint64_t cs = cluster_size();
  std::vector<uint8_t> buf(cs, 0);
  // Bytes past the fields written below (the compression type, fields of later versions) are kept
  // as they are on disk.
  file_->read(0, std::span<uint8_t>(buf.data(), size_t(std::min<uint64_t>(h.header_length, cs))));
  uint8_t* p = buf.data();
  RawHeader raw = raw_from_header(h);
  // Extensions start after the header: at header_length in version 3 (the bytes from
  // sizeof(RawHeader) to there are the ones kept as on disk).
  size_t pos = h.version >= kVersion3 ? h.header_length : kHeaderV2Bytes;
  auto room = [&](size_t n) {
    if (pos + n > cs)
      throw Error(name(), "header, extensions and backing file name do not fit in one cluster");
  };
  for (const auto& e : extensions_) {
    const size_t padded = size_t(padded_extension_bytes(e.data.size()));
    room(sizeof(RawExtensionHeader) + padded);
    RawExtensionHeader eh{};
    eh.type = e.type;
    eh.length = uint32_t(e.data.size());
    std::memcpy(p + pos, &eh, sizeof eh);
    pos += sizeof eh;
    if (!e.data.empty()) std::memcpy(p + pos, e.data.data(), e.data.size());
    pos += padded;
  }
  room(sizeof(RawExtensionHeader));
  pos += sizeof(RawExtensionHeader);  // end-of-extensions marker (kExtEnd, length 0: zeros)
  raw.backing_file_offset = 0;
  raw.backing_file_size = 0;
  if (backing_name_) {
    const auto& b = *backing_name_;
    room(b.size());
    std::memcpy(p + pos, b.data(), b.size());
    raw.backing_file_offset = pos;
    raw.backing_file_size = uint32_t(b.size());
  }
  std::memcpy(p, &raw, fixed_header_bytes(h));
  return buf;
}

}  // namespace qcommit::qcow2
