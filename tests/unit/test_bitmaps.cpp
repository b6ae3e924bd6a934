// SPDX-License-Identifier: GPL-2.0-or-later
// Persistent bitmaps, valid and stale: what the check counts as in use is what the writer frees.
// A stale bitmaps extension (autoclear bitmaps bit clear) describes nothing: its clusters are
// leaks, the check's repair may free them, and a writer never frees or follows them, even once
// they hold other data.
#include <doctest/doctest.h>

#include "qcow2/check.h"
#include "qcow2/writer.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;

namespace {

inline constexpr uint32_t kBitmapsExtType = 0x23852875;
inline constexpr uint64_t kBitmapsAutoclearBit = 1;
inline constexpr uint32_t kHeaderV3Bytes = 104;  // the builder's header_length
// The bitmaps extension's payload follows its 8-byte type/length header, right after the header.
inline constexpr uint64_t kExtPayload = kHeaderV3Bytes + 8;
inline constexpr uint64_t kOflagCopied = 1ull << 63;

struct BitmapImage {
  ImageBuilder b;
  uint64_t directory = 0, table = 0, data = 0;  // host offsets of the bitmap's three clusters
};

// A 64 MiB image with one bitmap "b0": directory, table and one data cluster, refcount 1 each.
BitmapImage with_bitmap(bool autoclear_bit) {
  ImageSpec s;
  s.autoclear = autoclear_bit ? kBitmapsAutoclearBit : 0;
  s.extensions = {{kBitmapsExtType, std::vector<uint8_t>(24, 0)}};
  BitmapImage m{ImageBuilder(s)};
  ImageBuilder& b = m.b;
  b.write_cluster(0, 0x11);
  m.directory = b.alloc_cluster();
  m.table = b.alloc_cluster();
  m.data = b.alloc_cluster();
  auto& bytes = b.bytes();
  put_be(bytes, kExtPayload + 0, 1, 4);             // nb_bitmaps
  put_be(bytes, kExtPayload + 8, 32, 8);            // directory size: one entry, name "b0", padded
  put_be(bytes, kExtPayload + 16, m.directory, 8);  // directory offset
  put_be(bytes, m.directory + 0, m.table, 8);       // bitmap table offset
  put_be(bytes, m.directory + 8, 1, 4);             // bitmap table size (entries)
  put_be(bytes, m.directory + 12, 2, 4);            // flags: auto
  bytes[m.directory + 16] = 1;                      // type: dirty tracking bitmap
  bytes[m.directory + 17] = 16;                     // granularity bits
  put_be(bytes, m.directory + 18, 2, 2);            // name size
  put_be(bytes, m.directory + 20, 0, 4);            // extra data size
  bytes[m.directory + 24] = 'b';
  bytes[m.directory + 25] = '0';
  put_be(bytes, m.table, m.data, 8);
  std::memset(bytes.data() + m.data, 0xff, b.cluster_size());
  return m;
}

// The image's bytes as the device holds them now (after a writer or a repair).
std::unique_ptr<qcow2::Image> reopen(qcow2::Image& img) {
  std::vector<uint8_t> bytes(img.file().size());
  img.file().read(0, bytes);
  return open_bytes(std::move(bytes));
}

bool has_bitmaps_extension(const qcow2::Image& img) {
  for (const auto& e : img.extensions())
    if (e.type == kBitmapsExtType) return true;
  return false;
}

}  // namespace

TEST_CASE("qcow2.bitmaps.valid_in_use_then_removed") {
  BitmapImage m = with_bitmap(true);
  auto img = open_image(m.b);
  REQUIRE(img->bitmaps());
  CHECK(img->bitmaps()->nb_bitmaps == 1);
  CHECK(has_bitmaps_extension(*img));
  auto r = qcow2::check(*img);
  CHECK(r.leaks == 0);
  CHECK(r.corruptions == 0);

  qcow2::Writer w(*img);
  CHECK(w.remove_bitmaps() == 1);
  w.commit();
  auto after = reopen(*img);
  CHECK_FALSE(after->bitmaps());
  CHECK_FALSE(has_bitmaps_extension(*after));
  CHECK((after->header().autoclear_features & kBitmapsAutoclearBit) == 0);
  const uint64_t cs = after->cluster_size();
  for (uint64_t off : {m.directory, m.table, m.data}) {
    CAPTURE(off);
    CHECK(after->refcount(off / cs) == 0);
  }
  r = qcow2::check(*after);
  CHECK(r.leaks == 0);
  CHECK(r.corruptions == 0);
}

TEST_CASE("qcow2.bitmaps.stale_clusters_are_leaks") {
  BitmapImage m = with_bitmap(false);
  auto img = open_image(m.b);
  CHECK_FALSE(img->bitmaps());
  CHECK_FALSE(has_bitmaps_extension(*img));
  REQUIRE(img->stale_bitmaps());
  CHECK(img->stale_bitmaps()->nb_bitmaps == 1);
  auto r = qcow2::check(*img);
  CHECK(r.leaks == 3);  // directory, table, data (qemu-img check counts the same)
  CHECK(r.corruptions == 0);
  CHECK(r.stale_bitmaps == 1);

  r = qcow2::check(*img, qcow2::Repair::kLeaks);
  CHECK(r.leaks_fixed == 3);
  CHECK(r.stale_bitmaps_dropped);
  auto after = reopen(*img);
  CHECK_FALSE(after->stale_bitmaps());  // dropped from the header, as QEMU drops it
  r = qcow2::check(*after);
  CHECK(r.leaks == 0);
  CHECK(r.corruptions == 0);

  // A merge after the repair: nothing of the stale extension is freed a second time.
  auto again = open_image(m.b);
  REQUIRE(qcow2::check(*again, qcow2::Repair::kLeaks).leaks_fixed == 3);
  qcow2::Writer w(*again);
  CHECK(w.remove_bitmaps() == 0);
  CHECK_NOTHROW(w.commit());
  r = qcow2::check(*reopen(*again));
  CHECK(r.leaks == 0);
  CHECK(r.corruptions == 0);
}

TEST_CASE("qcow2.bitmaps.stale_clusters_in_use_again") {
  // The stale extension's clusters hold guest data now (a tool freed and reused them): the
  // image is valid, and removing bitmaps must leave those clusters alone.
  BitmapImage m = with_bitmap(false);
  const uint64_t cs = m.b.cluster_size();
  const std::vector<uint64_t> reused{m.directory, m.table, m.data};
  for (size_t i = 0; i < reused.size(); ++i) m.b.set_l2((i + 1) * cs, reused[i] | kOflagCopied);
  auto img = open_image(m.b);
  auto r = qcow2::check(*img);
  REQUIRE(r.leaks == 0);
  REQUIRE(r.corruptions == 0);

  qcow2::Writer w(*img);
  CHECK(w.remove_bitmaps() == 0);
  CHECK(w.has_staged_changes());  // the header rewrite that drops the stale extension
  w.commit();
  auto after = reopen(*img);
  for (uint64_t off : reused) {
    CAPTURE(off);
    CHECK(after->refcount(off / cs) == 1);
  }
  CHECK_FALSE(after->stale_bitmaps());
  CHECK_FALSE(has_bitmaps_extension(*after));
  r = qcow2::check(*after);
  CHECK(r.leaks == 0);
  CHECK(r.corruptions == 0);
}

TEST_CASE("qcow2.bitmaps.inconsistent_directory") {
  // With the autoclear bit set, a directory that cannot be read is a corruption for the check
  // and a refusal, before anything is staged, for the writer.
  SUBCASE("beyond end of file") {
    BitmapImage m = with_bitmap(true);
    put_be(m.b.bytes(), kExtPayload + 16, 1ull << 40, 8);
    auto img = open_image(m.b);
    auto r = qcow2::check(*img);
    CHECK(r.corruptions >= 1);
    qcow2::Writer w(*img);
    CHECK_THROWS_AS((void)w.remove_bitmaps(), qcow2::CorruptionError);
    CHECK_FALSE(w.has_staged_changes());
  }
  SUBCASE("fewer entries than listed") {
    BitmapImage m = with_bitmap(true);
    put_be(m.b.bytes(), kExtPayload + 0, 2, 4);  // nb_bitmaps 2, one entry in 32 bytes
    auto img = open_image(m.b);
    auto r = qcow2::check(*img);
    CHECK(r.corruptions >= 1);
    CHECK(r.leaks == 0);  // the entry that is there still counts its table and data
    qcow2::Writer w(*img);
    CHECK_THROWS_AS((void)w.remove_bitmaps(), qcow2::CorruptionError);
    CHECK_FALSE(w.has_staged_changes());
  }
}
