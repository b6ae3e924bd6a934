// SPDX-License-Identifier: GPL-2.0-or-later
// The qcow2 on-disk format, in one place: constants, size-asserted structs and constexpr
// geometry. Written from the specification (QEMU docs/interop/qcow2.txt). All multi-byte
// fields on disk are big-endian; the structs below use Boost.Endian buffers so they can be
// memcpy'd from disk with no alignment or byte-order surprises.
#pragma once

#include <boost/endian/buffers.hpp>
#include <boost/endian/conversion.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace qcommit::qcow2 {

using boost::endian::big_uint16_buf_t;
using boost::endian::big_uint32_buf_t;
using boost::endian::big_uint64_buf_t;
using boost::endian::big_uint8_buf_t;

// ---------------------------------------------------------------------------------------------
// Header
inline constexpr uint32_t kMagic = 0x514649fb;  // "QFI\xfb"
inline constexpr uint32_t kVersion2 = 2;
inline constexpr uint32_t kVersion3 = 3;
inline constexpr uint32_t kHeaderV2Bytes = 72;
inline constexpr uint32_t kHeaderV3MinBytes = 104;
inline constexpr uint32_t kHeaderV3WithCompressionBytes = 112;  // 105 rounded up to 8
inline constexpr uint32_t kMinClusterBits = 9;                  // 512 B
inline constexpr uint32_t kMaxClusterBits = 21;                 // 2 MiB
inline constexpr uint32_t kMaxBackingNameBytes = 1023;
inline constexpr uint64_t kMaxL1TableBytes = 32ull << 20;       // as QEMU: 32 MiB
inline constexpr uint64_t kMaxRefcountTableBytes = 8ull << 20;  // as QEMU: 8 MiB
inline constexpr uint32_t kMaxRefcountOrder = 6;                // 64-bit refcounts

struct RawHeader {
  big_uint32_buf_t magic;
  big_uint32_buf_t version;
  big_uint64_buf_t backing_file_offset;
  big_uint32_buf_t backing_file_size;
  big_uint32_buf_t cluster_bits;
  big_uint64_buf_t size;
  big_uint32_buf_t crypt_method;
  big_uint32_buf_t l1_size;
  big_uint64_buf_t l1_table_offset;
  big_uint64_buf_t refcount_table_offset;
  big_uint32_buf_t refcount_table_clusters;
  big_uint32_buf_t nb_snapshots;
  big_uint64_buf_t snapshots_offset;
  // version 3 and later
  big_uint64_buf_t incompatible_features;
  big_uint64_buf_t compatible_features;
  big_uint64_buf_t autoclear_features;
  big_uint32_buf_t refcount_order;
  big_uint32_buf_t header_length;
};
static_assert(sizeof(RawHeader) == kHeaderV3MinBytes);
static_assert(offsetof(RawHeader, incompatible_features) == kHeaderV2Bytes);
inline constexpr uint32_t kCompressionTypeOffset = 104;  // one byte, if header_length > 104
static_assert(kCompressionTypeOffset == sizeof(RawHeader));
// A version 2 header has no refcount_order field: its refcounts are 16 bits wide.
inline constexpr uint32_t kVersion2RefcountOrder = 4;

// Incompatible feature bits.
inline constexpr uint64_t kIncompatDirty = 1ull << 0;
inline constexpr uint64_t kIncompatCorrupt = 1ull << 1;
inline constexpr uint64_t kIncompatDataFile = 1ull << 2;
inline constexpr uint64_t kIncompatCompression = 1ull << 3;
inline constexpr uint64_t kIncompatExtendedL2 = 1ull << 4;
inline constexpr uint64_t kIncompatKnown = kIncompatDirty | kIncompatCorrupt | kIncompatDataFile |
                                           kIncompatCompression | kIncompatExtendedL2;
// Compatible feature bits.
inline constexpr uint64_t kCompatLazyRefcounts = 1ull << 0;
// Autoclear feature bits.
inline constexpr uint64_t kAutoclearBitmaps = 1ull << 0;
inline constexpr uint64_t kAutoclearDataFileRaw = 1ull << 1;
inline constexpr uint64_t kAutoclearKnown = kAutoclearBitmaps | kAutoclearDataFileRaw;

enum class CompressionType : uint8_t { kZlib = 0, kZstd = 1 };
enum class CryptMethod : uint32_t { kNone = 0, kAes = 1, kLuks = 2 };

// ---------------------------------------------------------------------------------------------
// Header extensions
inline constexpr uint32_t kExtEnd = 0x00000000;
inline constexpr uint32_t kExtBackingFormat = 0xe2792aca;
inline constexpr uint32_t kExtFeatureNameTable = 0x6803f857;
inline constexpr uint32_t kExtBitmaps = 0x23852875;
inline constexpr uint32_t kExtFullDiskEncryption = 0x0537be77;
inline constexpr uint32_t kExtDataFile = 0x44415441;

struct RawExtensionHeader {
  big_uint32_buf_t type;
  big_uint32_buf_t length;  // bytes of data, not counting the padding
};
static_assert(sizeof(RawExtensionHeader) == 8);
// Each extension's data is padded with zeros to a multiple of this many bytes.
inline constexpr uint32_t kExtensionAlignBytes = 8;
// Bytes that `data_bytes` of an extension's data take on disk, padding included.
[[nodiscard]] constexpr uint64_t padded_extension_bytes(uint64_t data_bytes) {
  return (data_bytes + kExtensionAlignBytes - 1) & ~uint64_t(kExtensionAlignBytes - 1);
}

struct RawFeatureName {
  big_uint8_buf_t type;  // 0 incompatible, 1 compatible, 2 autoclear
  big_uint8_buf_t bit;
  char name[46];
};
static_assert(sizeof(RawFeatureName) == 48);

struct RawBitmapsExtension {
  big_uint32_buf_t nb_bitmaps;
  big_uint32_buf_t reserved;
  big_uint64_buf_t bitmap_directory_size;
  big_uint64_buf_t bitmap_directory_offset;
};
static_assert(sizeof(RawBitmapsExtension) == 24);

struct RawBitmapDirectoryEntry {
  big_uint64_buf_t bitmap_table_offset;
  big_uint32_buf_t bitmap_table_size;
  big_uint32_buf_t flags;
  big_uint8_buf_t type;
  big_uint8_buf_t granularity_bits;
  big_uint16_buf_t name_size;
  big_uint32_buf_t extra_data_size;
  // followed by extra data, name, padding to 8 bytes
};
static_assert(sizeof(RawBitmapDirectoryEntry) == 24);
inline constexpr uint64_t kBitmapTableOffsetMask = 0x00fffffffffffe00ull;
inline constexpr uint32_t kMaxBitmaps = 65535;                               // as QEMU
inline constexpr uint64_t kMaxBitmapDirectoryBytes = 1024ull * kMaxBitmaps;  // as QEMU: ~64 MiB
inline constexpr uint64_t kBitmapTableAllOnes = 1ull;  // bit 0: cluster reads as all ones

struct RawFullDiskEncryption {
  big_uint64_buf_t offset;
  big_uint64_buf_t length;
};
static_assert(sizeof(RawFullDiskEncryption) == 16);

// ---------------------------------------------------------------------------------------------
// Snapshot table entries (only what is needed to account for their clusters).
struct RawSnapshotHeader {
  big_uint64_buf_t l1_table_offset;
  big_uint32_buf_t l1_size;
  big_uint16_buf_t id_str_size;
  big_uint16_buf_t name_size;
  big_uint32_buf_t date_sec;
  big_uint32_buf_t date_nsec;
  big_uint64_buf_t vm_clock_nsec;
  big_uint32_buf_t vm_state_size;
  big_uint32_buf_t extra_data_size;
  // extra data, id string, name, padding to 8
};
static_assert(sizeof(RawSnapshotHeader) == 40);

// ---------------------------------------------------------------------------------------------
// L1 / L2 / refcount table entries
inline constexpr uint64_t kOflagCopied = 1ull << 63;
inline constexpr uint64_t kOflagCompressed = 1ull << 62;
inline constexpr uint64_t kOflagZero = 1ull << 0;
inline constexpr uint64_t kL1OffsetMask = 0x00fffffffffffe00ull;  // bits 9-55
inline constexpr uint64_t kL1ReservedMask = 0x7f000000000001ffull;
inline constexpr uint64_t kL2OffsetMask = 0x00fffffffffffe00ull;  // bits 9-55
inline constexpr uint64_t kL2StdReservedMask = 0x3f000000000001feull;
inline constexpr uint64_t kRefTableOffsetMask = 0xfffffffffffffe00ull;  // bits 9-63
inline constexpr uint64_t kRefTableReservedMask = 0x1ffull;
inline constexpr uint32_t kSubclustersPerCluster = 32;
inline constexpr uint32_t kCompressedSectorBytes = 512;

// An unused L2 entry is all zero bytes (no flags, no offset, bitmap 0).  Readers skip runs of
// them kL2ZeroScanBytes at a time: a sparse 1 TiB layer has 16 M of them.
inline constexpr uint32_t kL2ZeroScanBytes = 64;
// Whether the n bytes at p (n a multiple of 8: an entry, or kL2ZeroScanBytes) are all zero.
[[nodiscard]] inline bool l2_bytes_unused(const uint8_t* p, std::size_t n) {
  uint64_t any = 0;
  for (std::size_t i = 0; i < n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, sizeof w);
    any |= w;
  }
  return any == 0;
}

// Geometry of one image, derived from the header.
struct Geometry {
  uint32_t cluster_bits = 16;
  bool extended_l2 = false;
  uint32_t refcount_order = 4;

  [[nodiscard]] constexpr uint64_t cluster_size() const { return 1ull << cluster_bits; }
  [[nodiscard]] constexpr uint32_t l2_entry_bytes() const { return extended_l2 ? 16 : 8; }
  [[nodiscard]] constexpr uint64_t l2_entries() const { return cluster_size() / l2_entry_bytes(); }
  [[nodiscard]] constexpr uint32_t l2_bits() const { return cluster_bits - (extended_l2 ? 4 : 3); }
  // Guest bytes covered by one L2 table (= by one L1 entry).
  [[nodiscard]] constexpr uint64_t l1_entry_span() const { return l2_entries() << cluster_bits; }
  [[nodiscard]] constexpr uint64_t subcluster_size() const {
    return extended_l2 ? cluster_size() / kSubclustersPerCluster : cluster_size();
  }
  [[nodiscard]] constexpr uint32_t subclusters() const {
    return extended_l2 ? kSubclustersPerCluster : 1;
  }
  [[nodiscard]] constexpr uint64_t l1_index(uint64_t guest) const {
    return guest >> (cluster_bits + l2_bits());
  }
  [[nodiscard]] constexpr uint64_t l2_index(uint64_t guest) const {
    return (guest >> cluster_bits) & (l2_entries() - 1);
  }
  [[nodiscard]] constexpr uint64_t l1_entries_for(uint64_t virtual_size) const {
    // No (size + span - 1) / span: that wraps for sizes near 2^64.
    return virtual_size / l1_entry_span() + (virtual_size % l1_entry_span() != 0);
  }
  [[nodiscard]] constexpr uint32_t refcount_bits() const { return 1u << refcount_order; }
  [[nodiscard]] constexpr uint64_t refcount_block_entries() const {
    return (cluster_size() * 8) >> refcount_order;
  }
  [[nodiscard]] constexpr uint64_t refcount_max() const {
    return refcount_order == 6 ? ~0ull : (1ull << refcount_bits()) - 1;
  }
  // Compressed cluster descriptor layout (spec: x = 62 - (cluster_bits - 8)): the host offset
  // is bits 0 to x-1 (coffset_mask), the sector count bits x to 61 (csize_mask << csize_shift).
  // Decoded only by parse_compressed_l2_entry() below.
  [[nodiscard]] constexpr uint32_t csize_shift() const { return 62 - (cluster_bits - 8); }
  [[nodiscard]] constexpr uint64_t csize_mask() const { return (1ull << (cluster_bits - 8)) - 1; }
  [[nodiscard]] constexpr uint64_t coffset_mask() const { return (1ull << csize_shift()) - 1; }
  [[nodiscard]] constexpr uint64_t offset_into_cluster(uint64_t off) const {
    return off & (cluster_size() - 1);
  }
  [[nodiscard]] constexpr uint64_t align_down(uint64_t off) const {
    return off & ~(cluster_size() - 1);
  }
  [[nodiscard]] constexpr uint64_t align_up(uint64_t off) const {
    return (off + cluster_size() - 1) & ~(cluster_size() - 1);
  }
};

// ---------------------------------------------------------------------------------------------
// L2 entries as stored. Every reader and writer of an L2 table goes through these: the layout of
// an entry (8 bytes, or 16 with extended L2), of a compressed cluster descriptor and of a
// subcluster bitmap is known here and nowhere else.

// Bytes from the start of an extended L2 entry to its subcluster bitmap.
inline constexpr uint32_t kL2BitmapOffsetBytes = 8;

// One L2 entry: the cluster descriptor and, with extended L2 entries, the subcluster bitmap
// (always 0 without them).
struct L2Entry {
  uint64_t descriptor = 0;
  uint64_t bitmap = 0;
};

// Entry `index` of the L2 table at `table` (cluster_size() bytes). No validation: the caller
// decides what an entry's bits mean and which combinations are corrupt.
[[nodiscard]] inline L2Entry load_l2_entry(const uint8_t* table, const Geometry& geo,
                                           uint64_t index) {
  const uint8_t* p = table + index * geo.l2_entry_bytes();
  L2Entry e;
  e.descriptor = boost::endian::load_big_u64(p);
  if (geo.extended_l2) e.bitmap = boost::endian::load_big_u64(p + kL2BitmapOffsetBytes);
  return e;
}

// Stores `e` as entry `index` of the L2 table at `table`; the bitmap only with extended L2.
inline void store_l2_entry(uint8_t* table, const Geometry& geo, uint64_t index, L2Entry e) {
  uint8_t* p = table + index * geo.l2_entry_bytes();
  boost::endian::store_big_u64(p, e.descriptor);
  if (geo.extended_l2) boost::endian::store_big_u64(p + kL2BitmapOffsetBytes, e.bitmap);
}

// A compressed cluster descriptor (an L2 entry with kOflagCompressed set), decoded. The spec
// (x = 62 - (cluster_bits - 8)): bits 0 to x-1 are the host byte offset of the compressed stream,
// usually aligned to neither a sector nor a cluster; bits x to 61 the number of 512-byte sectors
// the stream uses beyond the one holding that offset. The stream may end anywhere in its last
// sector, whose tail may hold the next compressed cluster.
struct CompressedDescriptor {
  uint64_t host_offset = 0;  // bytes: first byte of the compressed stream in the image file
  uint64_t sectors = 0;      // 512-byte sectors used, the one holding host_offset included (>= 1)

  // Host byte offset of the sector holding host_offset: where the used sectors begin.
  [[nodiscard]] constexpr uint64_t first_sector_offset() const {
    return host_offset & ~uint64_t(kCompressedSectorBytes - 1);
  }
  // Bytes of the used sectors: [first_sector_offset(), + sector_bytes()) is what the
  // descriptor keeps in use (a refcount reference to every cluster it touches).
  [[nodiscard]] constexpr uint64_t sector_bytes() const { return sectors * kCompressedSectorBytes; }
  // Bytes from host_offset to the end of the last used sector: the most a reader reads to
  // decompress the cluster (QEMU's csize).
  [[nodiscard]] constexpr uint64_t stream_bytes() const {
    return sector_bytes() - (host_offset & (kCompressedSectorBytes - 1));
  }
};

// The one decoder of compressed cluster descriptors. `entry` is the L2 entry's descriptor with
// kOflagCompressed set; bits 62 and 63 (the compressed and copied flags) are ignored. Total for
// every entry and every cluster_bits in [kMinClusterBits, kMaxClusterBits]: no check that the
// offset fits in the file or that its bits above 55 are clear (callers report those as they
// need).
[[nodiscard]] constexpr CompressedDescriptor parse_compressed_l2_entry(const Geometry& geo,
                                                                       uint64_t entry) {
  return {entry & geo.coffset_mask(), ((entry >> geo.csize_shift()) & geo.csize_mask()) + 1};
}

// The subcluster allocation bitmap of an extended L2 entry (spec, "Extended L2 Entries"): bit i
// of the low 32 bits says subcluster i is allocated (its data is in the host cluster), bit i of
// the high 32 bits that it reads as zeros. Neither: unallocated (the backing file's data).
struct SubclusterBitmap {
  uint32_t allocated = 0;
  uint32_t zero = 0;

  static constexpr uint32_t kAll = 0xffffffffu;  // every one of kSubclustersPerCluster

  [[nodiscard]] static constexpr SubclusterBitmap parse(uint64_t bitmap) {
    return {uint32_t(bitmap), uint32_t(bitmap >> 32)};
  }
  [[nodiscard]] constexpr uint64_t encode() const { return (uint64_t(zero) << 32) | allocated; }
  // A subcluster both allocated and zero: the entry is corrupt.
  [[nodiscard]] constexpr bool contradictory() const { return (allocated & zero) != 0; }
};
static_assert(kSubclustersPerCluster == 32, "a SubclusterBitmap half holds one bit a subcluster");
// Every subcluster allocated / every subcluster zero, as stored.
inline constexpr uint64_t kAllSubclustersAllocated =
    SubclusterBitmap{SubclusterBitmap::kAll, 0}.encode();
inline constexpr uint64_t kAllSubclustersZero =
    SubclusterBitmap{0, SubclusterBitmap::kAll}.encode();

// ---------------------------------------------------------------------------------------------
// Refcount blocks

// Refcount entry i of a refcount block with 2^order-bit entries. Sub-byte widths pack entries
// from the least significant bits of each byte; wider ones are big-endian.
[[nodiscard]] inline uint64_t refcount_entry(const uint8_t* block, uint32_t order, uint64_t i) {
  switch (order) {
    case 0:
      return (block[i / 8] >> (i % 8)) & 1;
    case 1:
      return (block[i / 4] >> (2 * (i % 4))) & 3;
    case 2:
      return (block[i / 2] >> (4 * (i % 2))) & 15;
    case 3:
      return block[i];
    case 4:
      return boost::endian::load_big_u16(block + 2 * i);
    case 5:
      return boost::endian::load_big_u32(block + 4 * i);
    default:
      return boost::endian::load_big_u64(block + 8 * i);
  }
}

// One past the last non-zero entry of a refcount block of `entries` 2^order-bit entries (0 when
// all are zero), found from the last non-zero byte: for sub-byte widths it may name a zero
// neighbour of the same byte, never less than the truth.
[[nodiscard]] inline uint64_t refcount_entries_in_use(std::span<const uint8_t> block,
                                                      uint32_t order, uint64_t entries) {
  size_t b = block.size();
  while (b > 0 && block[b - 1] == 0) --b;
  if (b == 0) return 0;
  const uint64_t bits = uint64_t(1) << order;
  return std::min(entries, (uint64_t(b) * 8 + bits - 1) / bits);
}

inline void set_refcount_entry(uint8_t* block, uint32_t order, uint64_t i, uint64_t v) {
  auto sub_byte = [&](uint64_t per_byte, uint32_t bits) {
    const uint32_t shift = uint32_t(bits * (i % per_byte));
    const uint32_t mask = ((1u << bits) - 1u) << shift;
    uint8_t& b = block[i / per_byte];
    b = uint8_t((b & ~mask) | ((uint32_t(v) << shift) & mask));
  };
  switch (order) {
    case 0:
      sub_byte(8, 1);
      break;
    case 1:
      sub_byte(4, 2);
      break;
    case 2:
      sub_byte(2, 4);
      break;
    case 3:
      block[i] = uint8_t(v);
      break;
    case 4:
      boost::endian::store_big_u16(block + 2 * i, uint16_t(v));
      break;
    case 5:
      boost::endian::store_big_u32(block + 4 * i, uint32_t(v));
      break;
    default:
      boost::endian::store_big_u64(block + 8 * i, v);
      break;
  }
}

static_assert(Geometry{16, false, 4}.l2_entries() == 8192);
static_assert(Geometry{16, true, 4}.l2_entries() == 4096);
static_assert(Geometry{16, false, 4}.l1_entry_span() == 512ull << 20);
static_assert(Geometry{16, false, 4}.csize_shift() == 54);
static_assert(kAllSubclustersAllocated == 0x00000000ffffffffull);
static_assert(kAllSubclustersZero == 0xffffffff00000000ull);
static_assert(Geometry{9, false, 0}.refcount_block_entries() == 4096);
static_assert(Geometry{16, false, 6}.refcount_max() == ~0ull);

}  // namespace qcommit::qcow2
