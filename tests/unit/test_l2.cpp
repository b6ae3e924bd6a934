// SPDX-License-Identifier: GPL-2.0-or-later
// L2 entry decoding and geometry: standard entries, zero clusters (plain and allocated),
// compressed descriptors for several cluster sizes, extended L2 subcluster bitmaps.
#include <doctest/doctest.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <numeric>

#include "qcow2/format.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;
using qcow2::Geometry;
using qcow2::Run;
using qcow2::SubclusterType;

namespace {

constexpr uint64_t kCopied = 1ull << 63;
constexpr uint64_t kZeroFlag = 1;

std::vector<uint8_t> deflate_raw(const std::vector<uint8_t>& in) {
  z_stream s{};
  REQUIRE(deflateInit2(&s, 6, Z_DEFLATED, -12, 9, Z_DEFAULT_STRATEGY) == Z_OK);
  std::vector<uint8_t> out(in.size() + 1024);
  s.next_in = const_cast<uint8_t*>(in.data());
  s.avail_in = uInt(in.size());
  s.next_out = out.data();
  s.avail_out = uInt(out.size());
  REQUIRE(deflate(&s, Z_FINISH) == Z_STREAM_END);
  out.resize(s.total_out);
  deflateEnd(&s);
  return out;
}

std::vector<uint8_t> zstd_frame(const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out(ZSTD_compressBound(in.size()));
  size_t n = ZSTD_compress(out.data(), out.size(), in.data(), in.size(), 3);
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// Guest data that compresses but is not trivial.
std::vector<uint8_t> pattern(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = uint8_t((i / 7 + seed) ^ (i % 13));
  return v;
}

}  // namespace

TEST_CASE("qcow2.geometry") {
  for (uint32_t bits = 9; bits <= 21; ++bits) {
    const Geometry g{bits, false, 4};
    CAPTURE(bits);
    CHECK(g.cluster_size() == 1ull << bits);
    CHECK(g.l2_entries() == (1ull << bits) / 8);
    CHECK(g.l1_entry_span() == ((1ull << bits) / 8) << bits);
    CHECK(g.l1_index(g.l1_entry_span() * 3 + 5) == 3);
    CHECK(g.l2_index(g.l1_entry_span() * 3 + (7ull << bits) + 1) == 7);
    CHECK(g.csize_shift() == 62 - (bits - 8));
    CHECK(g.csize_mask() == (1ull << (bits - 8)) - 1);
    CHECK(g.subcluster_size() == g.cluster_size());
    CHECK(g.subclusters() == 1);
    CHECK(g.l1_entries_for(g.l1_entry_span() + 1) == 2);
    CHECK(g.l1_entries_for(g.l1_entry_span()) == 1);
    CHECK(g.l1_entries_for(0) == 0);
    CHECK(g.l1_entries_for(~0ull) == (~0ull >> (bits + bits - 3)) + 1);  // no wrap-around
    CHECK(g.align_up((1ull << bits) + 1) == 2ull << bits);
    CHECK(g.align_down((1ull << bits) + 1) == 1ull << bits);
  }
  const Geometry x{16, true, 4};
  CHECK(x.l2_entry_bytes() == 16);
  CHECK(x.l2_entries() == 4096);
  CHECK(x.subcluster_size() == 2048);
  CHECK(x.subclusters() == 32);
  CHECK(x.l1_entry_span() == 256ull << 20);
  // refcounts: entries per block for every width
  for (uint32_t order = 0; order <= 6; ++order) {
    const Geometry g{12, false, order};
    CHECK(g.refcount_bits() == 1u << order);
    CHECK(g.refcount_block_entries() == 4096 * 8 / (1u << order));
    CHECK(g.refcount_max() == (order == 6 ? ~0ull : (1ull << (1u << order)) - 1));
  }
}

TEST_CASE("qcow2.l2.standard_entries") {
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 8ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 4096;
  const uint64_t h0 = b.write_cluster(0, 0xa0);
  const uint64_t h1 = b.write_cluster(cs, 0xa1);      // contiguous with h0
  b.alloc_cluster();                                  // gap on the host
  const uint64_t h3 = b.write_cluster(2 * cs, 0xa2);  // not contiguous
  b.set_l2(4 * cs, kZeroFlag);                        // zero, no host cluster
  const uint64_t hz = b.alloc_cluster();
  b.set_l2(5 * cs, hz | kCopied | kZeroFlag);  // zero, preallocated
  b.set_l2(6 * cs, hz | kZeroFlag);            // zero alloc without COPIED (shared)
  const uint64_t hn = b.alloc_cluster();
  b.set_l2(7 * cs, hn);  // normal without COPIED
  REQUIRE(h1 == h0 + cs);
  auto img = open_image(b);

  Run r = img->lookup(0, 8ull << 20);
  CHECK(r.type == SubclusterType::kNormal);
  CHECK(r.guest_offset == 0);
  CHECK(r.length == 2 * cs);  // two host-contiguous clusters merge
  CHECK(r.host_offset == h0);

  r = img->lookup(cs + 100, 8ull << 20);
  CHECK(r.type == SubclusterType::kNormal);
  CHECK(r.length == cs - 100);
  CHECK(r.host_offset == h1 + 100);

  r = img->lookup(2 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kNormal);
  CHECK(r.host_offset == h3);
  CHECK(r.length == cs);

  r = img->lookup(3 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kUnallocatedPlain);
  CHECK(r.length == cs);

  r = img->lookup(4 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kZeroPlain);
  CHECK(r.length == cs);

  r = img->lookup(5 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kZeroAlloc);
  CHECK(r.host_offset == hz);
  CHECK(r.length == cs);  // 6*cs maps to the same host cluster: not contiguous

  r = img->lookup(6 * cs + 1, 8ull << 20);
  CHECK(r.type == SubclusterType::kZeroAlloc);
  CHECK(r.host_offset == hz + 1);

  r = img->lookup(7 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kNormal);
  CHECK(r.host_offset == hn);

  // Unallocated to the end of the L2 table's span (here: the whole image).
  r = img->lookup(8 * cs, 8ull << 20);
  CHECK(r.type == SubclusterType::kUnallocatedPlain);
  CHECK(r.length == (2ull << 20) - 8 * cs);  // one L2 table covers 512 * 4 KiB = 2 MiB

  // max_len and the end of the image bound a run.
  CHECK(img->lookup(0, 10).length == 10);
  CHECK(img->lookup((8ull << 20) - 3, 100).length == 3);
  CHECK(img->lookup(8ull << 20, 100).length == 0);

  // Reads of normal clusters come from the right host bytes.
  std::vector<uint8_t> out(2 * cs);
  r = img->lookup(0, 2 * cs);
  img->read_run(r, 0, out);
  CHECK(std::all_of(out.begin(), out.begin() + long(cs), [](uint8_t v) { return v == 0xa0; }));
  CHECK(std::all_of(out.begin() + long(cs), out.end(), [](uint8_t v) { return v == 0xa1; }));
}

TEST_CASE("qcow2.l2.unallocated_l2_table_spans") {
  ImageSpec s;
  s.cluster_bits = 9;  // 64 entries per table: 32 KiB per L1 entry
  s.size = 1ull << 20;
  ImageBuilder b(s);
  b.write_cluster(40 * 1024, 0x33);  // L1 index 1
  auto img = open_image(b);
  Run r = img->lookup(0, 1ull << 20);
  CHECK(r.type == SubclusterType::kUnallocatedPlain);
  CHECK(r.length == 32 * 1024);  // no L2 table: the whole L1 entry
  r = img->lookup(32 * 1024, 1ull << 20);
  CHECK(r.type == SubclusterType::kUnallocatedPlain);
  CHECK(r.length == 8 * 1024);
  r = img->lookup(40 * 1024, 1ull << 20);
  CHECK(r.type == SubclusterType::kNormal);
  CHECK(r.length == 512);
}

TEST_CASE("qcow2.l2.own_extents") {
  ImageSpec s;
  s.cluster_bits = 9;  // 64 entries per table: 32 KiB per L1 entry
  s.size = 1ull << 20;
  {
    ImageBuilder b(s);
    auto img = open_image(b);
    CHECK(qcow2::own_extents(*img).empty());  // nothing of its own
  }
  ImageBuilder b(s);
  b.write_cluster(40 * 1024, 0x33);        // L1 index 1
  b.write_cluster(40 * 1024 + 512, 0x34);  // adjacent: one extent
  b.set_l2(100 * 1024, 0);                 // L1 index 3: an L2 table with nothing in it
  b.set_l2(70 * 1024, kZeroFlag);          // zeros of its own count: a commit writes them
  auto img = open_image(b);
  const std::vector<qcow2::GuestExtent> e = qcow2::own_extents(*img);
  REQUIRE(e.size() == 2);
  CHECK(e[0].offset == 40 * 1024);
  CHECK(e[0].length == 1024);
  CHECK(e[1].offset == 70 * 1024);
  CHECK(e[1].length == 512);
}

TEST_CASE("qcow2.l2.compressed_descriptor") {
  // Descriptor size encoding for several cluster sizes, streams at aligned and unaligned offsets.
  for (uint32_t bits : {9u, 12u, 16u, 21u}) {
    for (uint64_t skew : {0ull, 3ull, 511ull}) {
      CAPTURE(bits);
      CAPTURE(skew);
      ImageSpec s;
      s.cluster_bits = bits;
      s.size = 4ull << bits;
      ImageBuilder b(s);
      const uint64_t cs = 1ull << bits;
      const auto plain = pattern(cs, uint8_t(bits + skew));
      const auto z = deflate_raw(plain);
      const uint64_t off = b.write_compressed(cs, z, skew);
      auto img = open_image(b);
      Run r = img->lookup(cs + 5, 3 * cs);
      CHECK(r.type == SubclusterType::kCompressed);
      CHECK(r.length == cs - 5);  // one compressed cluster per run
      CHECK(r.compressed_offset == off);
      // The descriptor covers whole sectors from the offset: at least the stream, < 512 more.
      CHECK(r.compressed_size >= z.size());
      CHECK(r.compressed_size < z.size() + 512);
      CHECK((r.compressed_offset + r.compressed_size) % 512 == 0);
      std::vector<uint8_t> out(cs);
      img->decompress(r, out);
      CHECK(out == plain);
      // read_run: a piece in the middle of the cluster
      std::vector<uint8_t> piece(cs / 4);
      img->read_run(r, cs + cs / 2, piece);
      CHECK(std::equal(piece.begin(), piece.end(), plain.begin() + long(cs / 2)));
    }
  }
}

TEST_CASE("qcow2.l2.compressed_max_sectors") {
  // The largest encodable size field (all bits set) must decode to its full extent.
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 1 << 20;
  ImageBuilder b(s);
  const uint64_t off = b.alloc_cluster() + 512 * 3;
  const Geometry g{12, false, 4};
  b.set_l2(0, (1ull << 62) | (g.csize_mask() << g.csize_shift()) | off);
  auto img = open_image(b);
  Run r = img->lookup(0, 4096);
  CHECK(r.type == SubclusterType::kCompressed);
  CHECK(r.compressed_offset == off);
  CHECK(r.compressed_size == (g.csize_mask() + 1) * 512);
}

TEST_CASE("qcow2.l2.compressed_descriptor_decoding") {
  // Values worked out by hand from the spec's layout, x = 62 - (cluster_bits - 8): host offset in
  // bits 0 to x-1, additional sectors in bits x to 61; bits 62 (compressed) and 63 ignored.
  using qcow2::parse_compressed_l2_entry;
  constexpr uint64_t kCompressed = 1ull << 62;
  struct Case {
    uint32_t cluster_bits;
    uint64_t entry;
    uint64_t host_offset, sectors, first_sector_offset, sector_bytes, stream_bytes;
  };
  const Case cases[] = {
      // 512 B clusters: x = 61, a one-bit sector field (bit 61).
      {9, kCompressed | 0x1234567, 0x1234567, 1, 0x1234400, 512, 153},
      {9, kCompressed | (1ull << 61) | 0x1234567, 0x1234567, 2, 0x1234400, 1024, 665},
      {9, kCopied | kCompressed | 0x1fffffffffffffffull, 0x1fffffffffffffffull, 1,
       0x1ffffffffffffe00ull, 512, 1},
      // 64 KiB clusters: x = 54, an 8-bit sector field (bits 54-61).
      {16, kCompressed | (5ull << 54) | 0x10200, 0x10200, 6, 0x10200, 3072, 3072},
      {16, kCompressed | (0xffull << 54) | 0x3fffffffffffffull, 0x3fffffffffffffull, 256,
       0x3ffffffffffe00ull, 131072, 130561},
      // Bit 53: the top bit of the offset with 64 KiB clusters, the lowest of the sector count with
      // 128 KiB ones (x = 53, a 9-bit field): where the field widens by a bit.
      {16, kCompressed | (1ull << 53) | 0x200, 0x20000000000200ull, 1, 0x20000000000200ull, 512,
       512},
      {17, kCompressed | (1ull << 53) | 0x200, 0x200, 2, 0x200, 1024, 1024},
      // 2 MiB clusters: x = 49, a 13-bit sector field (bits 49-61).
      {21, kCompressed | (1ull << 49) | 0x1ffffffffffffull, 0x1ffffffffffffull, 2,
       0x1fffffffffe00ull, 1024, 513},
      {21, kCompressed | (0x1fffull << 49) | 0x40000000, 0x40000000, 8192, 0x40000000, 4ull << 20,
       4ull << 20},
  };
  for (const Case& c : cases) {
    CAPTURE(c.cluster_bits);
    CAPTURE(c.entry);
    const auto d = parse_compressed_l2_entry(Geometry{c.cluster_bits, false, 4}, c.entry);
    CHECK(d.host_offset == c.host_offset);
    CHECK(d.sectors == c.sectors);
    CHECK(d.first_sector_offset() == c.first_sector_offset);
    CHECK(d.sector_bytes() == c.sector_bytes);
    CHECK(d.stream_bytes() == c.stream_bytes);
  }
}

TEST_CASE("qcow2.l2.subcluster_bitmap_encoding") {
  // Spec: bit i of the low half allocates subcluster i, bit i of the high half makes it zero.
  using qcow2::SubclusterBitmap;
  const auto bm = SubclusterBitmap::parse(0x8000000100000003ull);
  CHECK(bm.allocated == 0x3u);
  CHECK(bm.zero == 0x80000001u);
  CHECK(bm.contradictory());
  CHECK(bm.encode() == 0x8000000100000003ull);
  CHECK_FALSE(SubclusterBitmap::parse(0x0000000c00000003ull).contradictory());
  CHECK(qcow2::kAllSubclustersAllocated == 0x00000000ffffffffull);
  CHECK(qcow2::kAllSubclustersZero == 0xffffffff00000000ull);
  // The entry's bitmap is the second 8 bytes of a 16-byte extended entry, big-endian.
  std::vector<uint8_t> table(64, 0);
  const Geometry x{16, true, 4};
  qcow2::store_l2_entry(table.data(), x, 2, {0x8000000000050000ull, 0x0000000200000001ull});
  CHECK(table[32] == 0x80);
  CHECK(table[37] == 0x05);
  CHECK(table[43] == 0x02);
  CHECK(table[47] == 0x01);
  const auto e = qcow2::load_l2_entry(table.data(), x, 2);
  CHECK(e.descriptor == 0x8000000000050000ull);
  CHECK(e.bitmap == 0x0000000200000001ull);
  // Without extended L2 an entry is 8 bytes and has no bitmap.
  const auto s = qcow2::load_l2_entry(table.data(), Geometry{16, false, 4}, 4);
  CHECK(s.descriptor == 0x8000000000050000ull);
  CHECK(s.bitmap == 0);
}

TEST_CASE("qcow2.l2.compressed_zstd") {
  for (uint32_t bits : {12u, 16u, 21u}) {
    CAPTURE(bits);
    ImageSpec s;
    s.cluster_bits = bits;
    s.size = 4ull << bits;
    s.compression_type = 1;
    ImageBuilder b(s);
    const uint64_t cs = 1ull << bits;
    const auto plain = pattern(cs, 9);
    b.write_compressed(2 * cs, zstd_frame(plain), 100);
    auto img = open_image(b);
    Run r = img->lookup(2 * cs, cs);
    REQUIRE(r.type == SubclusterType::kCompressed);
    std::vector<uint8_t> out(cs);
    img->decompress(r, out);
    CHECK(out == plain);
  }
}

TEST_CASE("qcow2.l2.extended_subclusters") {
  ImageSpec s;
  s.cluster_bits = 16;
  s.extended_l2 = true;
  s.size = 1ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 65536, sc = 2048;
  // Cluster 0: subclusters 0-3 allocated, 4-5 zero, 6 allocated, rest unallocated.
  const uint64_t alloc = 0b1001111ull, zero = 0b110000ull;
  const uint64_t h0 = b.write_cluster(0, 0x44, alloc | (zero << 32));
  // Cluster 1: no host cluster, subclusters 0-15 zero, 16-31 unallocated.
  b.set_l2(cs, 0, 0xffffull << 32);
  // Cluster 2: all 32 zero, no host cluster (the "zero cluster" of extended L2).
  b.set_l2(2 * cs, 0, 0xffffffffull << 32);
  // Cluster 3: all allocated, host contiguous with cluster 4 (also all allocated).
  const uint64_t h3 = b.write_cluster(3 * cs, 0x55);
  const uint64_t h4 = b.write_cluster(4 * cs, 0x56);
  REQUIRE(h4 == h3 + cs);
  auto img = open_image(b);

  auto expect = [&](uint64_t off, SubclusterType t, uint64_t len) {
    CAPTURE(off);
    Run r = img->lookup(off, 1ull << 20);
    CHECK(r.type == t);
    CHECK(r.length == len);
    return r;
  };
  Run r = expect(0, SubclusterType::kNormal, 4 * sc);
  CHECK(r.host_offset == h0);
  r = expect(4 * sc, SubclusterType::kZeroAlloc, 2 * sc);
  CHECK(r.host_offset == h0 + 4 * sc);
  r = expect(6 * sc, SubclusterType::kNormal, sc);
  CHECK(r.host_offset == h0 + 6 * sc);
  r = expect(7 * sc + 10, SubclusterType::kUnallocatedAlloc, 25 * sc - 10);
  CHECK(r.host_offset == h0 + 7 * sc + 10);
  expect(cs, SubclusterType::kZeroPlain, 16 * sc);
  expect(cs + 16 * sc, SubclusterType::kUnallocatedPlain, 16 * sc);
  expect(2 * cs, SubclusterType::kZeroPlain, cs);
  r = expect(3 * cs, SubclusterType::kNormal, 2 * cs);
  CHECK(r.host_offset == h3);
  expect(5 * cs, SubclusterType::kUnallocatedPlain, (1ull << 20) - 5 * cs);
}

TEST_CASE("qcow2.l2.extended_bitmap_errors") {
  ImageSpec s;
  s.extended_l2 = true;
  s.size = 1ull << 20;
  SUBCASE("allocated and zero at once") {
    ImageBuilder b(s);
    b.write_cluster(0, 1, 0x1ull | (0x1ull << 32));
    auto img = open_image(b);
    expect_error<qcow2::CorruptionError>([&] { (void)img->lookup(0, 4096); }, "mem.qcow2",
                                         "both allocated and zero");
  }
  SUBCASE("allocated subclusters without a host cluster") {
    ImageBuilder b(s);
    b.set_l2(0, 0, 0x3);
    auto img = open_image(b);
    expect_error<qcow2::CorruptionError>([&] { (void)img->lookup(0, 4096); }, "mem.qcow2",
                                         "without a host cluster");
  }
  SUBCASE("compressed with a bitmap") {
    ImageBuilder b(s);
    const uint64_t off = b.alloc_cluster();
    const Geometry g{16, true, 4};
    b.set_l2(0, (1ull << 62) | (1ull << g.csize_shift()) | off, 0x1);
    auto img = open_image(b);
    expect_error<qcow2::CorruptionError>([&] { (void)img->lookup(0, 4096); }, "mem.qcow2",
                                         "subcluster bitmap");
  }
}
