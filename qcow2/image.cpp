// SPDX-License-Identifier: GPL-2.0-or-later
// A qcow2 image: opened (its header is image_header.cpp's), its L1, L2 and refcount tables read
// through the cache, a guest offset looked up into runs, runs read and decompressed.
#include "qcow2/image.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>

#include "qcow2/error.h"

namespace qcommit::qcow2 {

using boost::endian::load_big_u64;

const char* to_string(SubclusterType t) {
  switch (t) {
    case SubclusterType::kUnallocatedPlain:
      return "unallocated";
    case SubclusterType::kUnallocatedAlloc:
      return "unallocated-alloc";
    case SubclusterType::kZeroPlain:
      return "zero";
    case SubclusterType::kZeroAlloc:
      return "zero-alloc";
    case SubclusterType::kNormal:
      return "normal";
    case SubclusterType::kCompressed:
      return "compressed";
  }
  return "?";
}

Image::Image(std::unique_ptr<BlockDevice> file, ImageOptions options)
    : file_(std::move(file)), options_(options), cache_(options.cache_bytes) {}

Image::~Image() = default;

std::unique_ptr<Image> Image::open(std::unique_ptr<BlockDevice> file, ImageOptions options) {
  std::unique_ptr<Image> img(new Image(std::move(file), options));
  img->parse_header();
  img->load_tables();
  return img;
}

void Image::corrupt_at(const std::string& what) const {
  throw CorruptionError(name(), what);
}

void Image::load_tables() {
  const Header& h = header_;
  l1_.resize(h.l1_size);
  if (h.l1_size) {
    std::vector<uint8_t> buf(size_t(h.l1_size) * 8);
    file_->read(h.l1_table_offset, buf);
    for (size_t i = 0; i < l1_.size(); ++i) l1_[i] = load_big_u64(buf.data() + i * 8);
  }
  const size_t rt_entries = (size_t(h.refcount_table_clusters) << h.cluster_bits) / 8;
  reftable_.resize(rt_entries);
  std::vector<uint8_t> buf(rt_entries * 8);
  file_->read(h.refcount_table_offset, buf);
  for (size_t i = 0; i < rt_entries; ++i) reftable_[i] = load_big_u64(buf.data() + i * 8);
}

void Image::attach_data_file(std::unique_ptr<BlockDevice> data) {
  data_ = std::move(data);
}

std::shared_ptr<const std::vector<uint8_t>> Image::l2_table(uint64_t l2_offset, uint64_t l1_index) {
  const uint64_t cs = cluster_size();
  auto where = [&] {
    return "L2 table at " + hex(l2_offset) + " (L1 index " + std::to_string(l1_index) + ")";
  };
  if (l2_offset % cs != 0) corrupt_at(where() + " is not cluster aligned");
  if (l2_offset < cs) corrupt_at(where() + " overlaps the image header");
  // The end-of-file check applies to tables read from disk; tables a writer has just allocated
  // live in the cache until they are written.
  return cache_.get(l2_offset, cs, [&](std::vector<uint8_t>& t) {
    if (l2_offset >= file_->size() || file_->size() - l2_offset < cs)
      corrupt_at(where() + " lies beyond end of file");
    file_->read(l2_offset, t);
  });
}

Image::Entry Image::decode(const std::vector<uint8_t>& l2, uint64_t l2_offset, uint64_t index,
                           uint32_t sub) const {
  const L2Entry entry = load_l2_entry(l2.data(), geo_, index);
  const uint64_t e = entry.descriptor;
  auto where = [&] { return "L2 table at " + hex(l2_offset) + " entry " + std::to_string(index); };
  if (e & kOflagCompressed) {
    if (has_data_file()) corrupt_at(where() + ": compressed cluster in an image with a data file");
    if (entry.bitmap != 0)
      corrupt_at(where() + ": compressed cluster with a non-zero subcluster bitmap");
    const CompressedDescriptor cd = parse_compressed_l2_entry(geo_, e);
    if (cd.host_offset < cluster_size())
      corrupt_at(where() + ": compressed data overlaps the image header");
    return {SubclusterType::kCompressed, 0, cd.host_offset, cd.stream_bytes()};
  }
  const uint64_t host = e & kL2OffsetMask;
  const bool has_host = host != 0 || (has_data_file() && (e & kOflagCopied));
  if (has_host) {
    if (host % cluster_size() != 0)
      corrupt_at(where() + ": host cluster offset " + hex(host) + " is not cluster aligned");
    if (!has_data_file() && host < cluster_size())
      corrupt_at(where() + ": host cluster offset " + hex(host) + " points into the image header");
  }
  if (geo_.extended_l2) {
    const SubclusterBitmap bm = SubclusterBitmap::parse(entry.bitmap);
    if (bm.contradictory()) corrupt_at(where() + ": subclusters marked both allocated and zero");
    const bool a = bm.allocated & (1u << sub), z = bm.zero & (1u << sub);
    if (!has_host) {
      if (bm.allocated) corrupt_at(where() + ": allocated subclusters without a host cluster");
      return {z ? SubclusterType::kZeroPlain : SubclusterType::kUnallocatedPlain, 0};
    }
    if (a) return {SubclusterType::kNormal, host};
    if (z) return {SubclusterType::kZeroAlloc, host};
    return {SubclusterType::kUnallocatedAlloc, host};
  }
  if (e & kOflagZero)
    return {has_host ? SubclusterType::kZeroAlloc : SubclusterType::kZeroPlain, host};
  return {has_host ? SubclusterType::kNormal : SubclusterType::kUnallocatedPlain, host};
}

Run Image::lookup(uint64_t guest_offset, uint64_t max_len) {
  Run run;
  run.guest_offset = guest_offset;
  if (guest_offset >= virtual_size() || max_len == 0) return run;
  max_len = std::min(max_len, virtual_size() - guest_offset);
  const uint64_t l1i = geo_.l1_index(guest_offset);
  const uint64_t span_end = std::min(guest_offset + max_len, (l1i + 1) * geo_.l1_entry_span());
  const uint64_t l1e = l1i < l1_.size() ? l1_[l1i] : 0;
  const uint64_t l2_offset = l1e & kL1OffsetMask;
  if (l2_offset == 0) {
    run.length = span_end - guest_offset;
    return run;
  }
  auto l2 = l2_table(l2_offset, l1i);
  const uint64_t sc = geo_.subcluster_size();
  uint64_t pos = guest_offset;
  bool first = true;
  Entry first_entry{};
  uint64_t expect_host = 0;
  const uint64_t cs = cluster_size();
  const uint64_t eb = geo_.l2_entry_bytes();
  while (pos < span_end) {
    const uint64_t idx = geo_.l2_index(pos);
    if (!first && first_entry.type == SubclusterType::kUnallocatedPlain && pos % cs == 0) {
      // A run of unused entries (all bytes zero, bitmap included: unallocated, no host
      // cluster) continues without decoding each: a sparse 1 TiB layer is 16 M of them.
      const uint8_t* p = l2->data() + idx * eb;
      uint64_t k = 0;
      const uint64_t room = (span_end - pos + cs - 1) / cs;  // entries left in the span
      const uint64_t block = kL2ZeroScanBytes / eb;          // entries per scan block
      while (k + block <= room && l2_bytes_unused(p + k * eb, kL2ZeroScanBytes)) k += block;
      while (k < room && l2_bytes_unused(p + k * eb, eb)) ++k;
      if (k) {
        pos = std::min(span_end, pos + k * cs);
        continue;
      }
    }
    const uint32_t sub = uint32_t(geo_.offset_into_cluster(pos) / sc);
    Entry en = decode(*l2, l2_offset, idx, sub);
    const uint64_t host_here = en.cluster_host + geo_.offset_into_cluster(pos);
    if (first) {
      first_entry = en;
      run.type = en.type;
      if (en.type == SubclusterType::kCompressed) {
        run.compressed_offset = en.coffset;
        run.compressed_size = en.csize;
      } else if (en.type == SubclusterType::kNormal || en.type == SubclusterType::kZeroAlloc ||
                 en.type == SubclusterType::kUnallocatedAlloc) {
        run.host_offset = host_here;
      }
      first = false;
    } else {
      if (en.type != first_entry.type) break;
      if (en.type == SubclusterType::kCompressed) break;  // one compressed cluster per run
      if ((en.type == SubclusterType::kNormal || en.type == SubclusterType::kZeroAlloc ||
           en.type == SubclusterType::kUnallocatedAlloc) &&
          host_here != expect_host)
        break;
    }
    const uint64_t next = std::min(span_end, (pos / sc + 1) * sc);
    expect_host = host_here + (next - pos);
    pos = next;
  }
  run.length = pos - guest_offset;
  return run;
}

void Image::read_run(const Run& run, uint64_t guest_offset, std::span<uint8_t> out) {
  if (run.type == SubclusterType::kNormal) {
    data_device().read(run.host_offset + (guest_offset - run.guest_offset), out);
    return;
  }
  if (run.type == SubclusterType::kCompressed) {
    const uint64_t cs = cluster_size();
    if (decompressed_key_ != run.compressed_offset) {
      decompressed_.resize(cs);
      decompressed_key_ = ~0ull;
      decompress(run, decompressed_);
      decompressed_key_ = run.compressed_offset;
    }
    const uint64_t in_cluster = geo_.offset_into_cluster(guest_offset);
    std::memcpy(out.data(), decompressed_.data() + in_cluster, out.size());
    return;
  }
  std::fill(out.begin(), out.end(), uint8_t{0});
}

void Image::decompress(const Run& run, std::span<uint8_t> out) {
  const uint64_t file_size = file_->size();
  if (run.compressed_offset >= file_size)
    corrupt_at("compressed cluster at " + hex(run.compressed_offset) + " lies beyond end of file");
  const uint64_t csize = std::min(run.compressed_size, file_size - run.compressed_offset);
  std::vector<uint8_t> in(csize);
  file_->read(run.compressed_offset, in);
  bool ok = false;
  if (header_.compression_type == CompressionType::kZlib) {
    z_stream s{};
    if (inflateInit2(&s, -12) != Z_OK) throw Error(name(), "zlib initialisation failed");
    s.next_in = in.data();
    s.avail_in = uInt(in.size());
    s.next_out = out.data();
    s.avail_out = uInt(out.size());
    int r = inflate(&s, Z_FINISH);
    ok = (r == Z_STREAM_END || r == Z_BUF_ERROR) && s.avail_out == 0;
    if (ok && r != Z_STREAM_END) {
      // Output full before the end of the stream: a stream with more than one cluster of data
      // is corrupt (it would otherwise be silently truncated).
      uint8_t extra = 0;
      s.next_out = &extra;
      s.avail_out = 1;
      (void)inflate(&s, Z_FINISH);
      if (s.avail_out == 0) ok = false;
    }
    inflateEnd(&s);
  } else {
    ZSTD_DCtx* d = ZSTD_createDCtx();
    if (!d) throw Error(name(), "zstd initialisation failed");
    ZSTD_inBuffer ib{in.data(), in.size(), 0};
    ZSTD_outBuffer ob{out.data(), out.size(), 0};
    size_t frame_left = 1;  // ZSTD_decompressStream's hint: 0 once the frame is complete
    while (ob.pos < ob.size) {
      size_t r = ZSTD_decompressStream(d, &ob, &ib);
      if (ZSTD_isError(r)) break;
      frame_left = r;
      if (r == 0 && ob.pos < ob.size) break;  // frame ended early
      if (ib.pos == ib.size && ob.pos < ob.size) break;
    }
    ok = ob.pos == ob.size;
    if (ok && frame_left != 0) {
      // Output full before the end of the frame: more than one cluster of data is corrupt, not
      // silently truncated. (Input bytes after a complete frame belong to the next cluster's
      // stream: the descriptor's size is rounded up to sectors.)
      uint8_t extra = 0;
      ZSTD_outBuffer eb{&extra, 1, 0};
      size_t r = ZSTD_decompressStream(d, &eb, &ib);
      if (!ZSTD_isError(r) && eb.pos > 0) ok = false;
    }
    ZSTD_freeDCtx(d);
  }
  if (!ok)
    corrupt_at("compressed cluster at " + hex(run.compressed_offset) + " (guest " +
               hex(run.guest_offset) + ") does not decompress to exactly one cluster");
}

Image::RefcountBlock Image::refcount_block(uint64_t bi) {
  if (bi >= reftable_.size()) return {};
  const uint64_t block = reftable_[bi] & kRefTableOffsetMask;
  if (block == 0) return {};
  const uint64_t cs = cluster_size();
  if (block % cs != 0)
    corrupt_at("refcount block at " + hex(block) + " (refcount table index " + std::to_string(bi) +
               ") is not cluster aligned");
  auto t = cache_.get(block, cs, [&](std::vector<uint8_t>& b) {
    if (block >= file_->size() || file_->size() - block < cs)
      corrupt_at("refcount block at " + hex(block) + " (refcount table index " +
                 std::to_string(bi) + ") lies beyond end of file");
    file_->read(block, b);
  });
  return {block, std::move(t)};
}

uint64_t Image::refcount(uint64_t cluster_index) {
  const uint64_t per_block = geo_.refcount_block_entries();
  const RefcountBlock b = refcount_block(cluster_index / per_block);
  if (!b.table) return 0;
  return refcount_entry(b.table->data(), geo_.refcount_order, cluster_index % per_block);
}

bool Image::metadata_preallocated() {
  if (metadata_prealloc_) return *metadata_prealloc_;
  const uint64_t cs = cluster_size();
  const uint64_t real_clusters = file_->allocated_bytes() / cs;
  const uint64_t threshold = std::max(real_clusters * 10 / 9, real_clusters + 2);
  const uint64_t end_cluster = (file_->size() + cs - 1) / cs;
  uint64_t count = 0;
  for (uint64_t i = 0; i < end_cluster && count < threshold; ++i) count += refcount(i) != 0;
  metadata_prealloc_ = count >= threshold;
  return *metadata_prealloc_;
}

std::vector<GuestExtent> own_extents(Image& img) {
  const Geometry& geo = img.geometry();
  const std::vector<uint64_t>& l1 = img.l1_table();
  std::vector<GuestExtent> out;
  for (size_t i = 0; i < l1.size(); ++i) {
    if ((l1[i] & kL1OffsetMask) == 0) continue;
    const uint64_t begin = i * geo.l1_entry_span();
    if (begin >= img.virtual_size()) break;
    const uint64_t end = std::min(img.virtual_size(), begin + geo.l1_entry_span());
    for (uint64_t off = begin; off < end;) {
      const Run r = img.lookup(off, end - off);
      if (r.length == 0) break;
      if (r.type != SubclusterType::kUnallocatedPlain &&
          r.type != SubclusterType::kUnallocatedAlloc) {
        if (!out.empty() && out.back().offset + out.back().length == r.guest_offset)
          out.back().length += r.length;
        else
          out.push_back({r.guest_offset, r.length});
      }
      off = r.guest_offset + r.length;
    }
  }
  return out;
}

}  // namespace qcommit::qcow2
