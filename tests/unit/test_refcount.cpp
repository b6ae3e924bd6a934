// SPDX-License-Identifier: GPL-2.0-or-later
// Refcounts of every width (1 to 64 bits), across several refcount blocks; bad blocks.
#include <doctest/doctest.h>

#include <algorithm>
#include <span>

#include "qcow2/check.h"
#include "qcow2/writer.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;

TEST_CASE("qcow2.refcount.widths") {
  for (uint32_t order = 0; order <= 6; ++order) {
    for (uint32_t bits : {9u, 12u}) {
      CAPTURE(order);
      CAPTURE(bits);
      ImageSpec s;
      s.cluster_bits = bits;
      s.size = 1ull << 20;
      s.refcount_order = order;
      ImageBuilder b(s);
      const uint64_t width = 1ull << order;
      const uint64_t max = order == 6 ? ~0ull : (1ull << width) - 1;
      const uint64_t per_block = (1ull << bits) * 8 / width;
      // Clusters in the first and in later refcount blocks, with values that exercise every bit
      // of the field and the neighbours on both sides.
      std::vector<std::pair<uint64_t, uint64_t>> want;
      const std::vector<uint64_t> clusters{
          10, 11, 12, 13, per_block - 1, per_block, per_block + 1, 3 * per_block + 5};
      for (size_t k = 0; k < clusters.size(); ++k) {
        const uint64_t v = k % 3 == 0 ? max : k % 3 == 1 ? (max / 3) | 1 : 0;
        want.emplace_back(clusters[k], v);
      }
      for (auto [c, v] : want) b.set_refcount(c, v);
      auto img = open_image(b);
      CHECK(img->geometry().refcount_bits() == width);
      CHECK(img->geometry().refcount_max() == max);
      for (const auto& cv : want) {
        const auto c = cv.first;  // a plain variable: clang 14 cannot capture a structured binding
        CAPTURE(c);
        CHECK(img->refcount(c) == cv.second);
      }
      // Header, refcount table and L1 table clusters are referenced once.
      CHECK(img->refcount(0) == 1);
      CHECK(img->refcount(1) == 1);
      CHECK(img->refcount(2) == 1);
      // Far beyond every refcount block: 0.
      CHECK(img->refcount(per_block * 1000) == 0);
      CHECK(img->refcount(~0ull / 2) == 0);
    }
  }
}

TEST_CASE("qcow2.refcount.bad_block") {
  ImageSpec s;
  ImageBuilder b(s);
  b.put64(b.reftable_offset() + 8, 0x12345);      // second refcount block: unaligned
  b.put64(b.reftable_offset() + 16, 1ull << 40);  // third: beyond end of file
  auto img = open_image(b);
  CHECK(img->refcount(0) == 1);
  const uint64_t per_block = 65536 * 8 / 16;
  expect_error<qcow2::CorruptionError>([&] { (void)img->refcount(per_block); }, "mem.qcow2",
                                       "refcount block");
  expect_error<qcow2::CorruptionError>([&] { (void)img->refcount(2 * per_block); }, "mem.qcow2",
                                       "refcount block");
}

TEST_CASE("qcow2.refcount.writer_refuses_bad_block") {
  // The writer's refcount updates load blocks as reads do: a refcount table entry that is not
  // cluster aligned is corruption, not a place to write refcounts to.
  ImageSpec s;
  s.cluster_bits = 12;
  s.refcount_order = 6;  // 64-bit refcounts: a block describes 4096 * 8 / 64 = 512 clusters
  s.size = 4ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 4096, per_block = 512;
  b.put64(b.reftable_offset() + 8, 0x12345);  // the block for clusters 512-1023: unaligned
  auto img = open_image(b);
  const std::vector<uint8_t> data(cs, 0x5a);
  auto view = [](uint64_t, std::span<uint8_t> out) { std::fill(out.begin(), out.end(), 0); };
  // Clusters are allocated past the end of the file until one needs the second block (or the
  // writer, looking for refcounts past the end of the file, reads that block first).
  expect_error<qcow2::CorruptionError>(
      [&] {
        qcow2::Writer w(*img);
        for (uint64_t g = 0; g < per_block * cs; g += cs) w.write(g, data, view);
      },
      "mem.qcow2", "refcount block at 0x12200 (refcount table index 1) is not cluster aligned");
}

TEST_CASE("qcow2.refcount.clusters_past_a_cut_file_are_not_free") {
  // A file cut short after its tables were written: the L2 entry of guest cluster 1 and its
  // refcount still name a cluster past the end of the file. check reports the reference, as
  // qemu-img check does; a writer must not hand that cluster out again (it would show the new
  // data at guest cluster 1 too).
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 4ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 4096;
  (void)b.write_cluster(0, 0x11);
  const uint64_t cut = b.write_cluster(cs, 0x22);
  REQUIRE(cut + cs == b.bytes().size());
  b.bytes().resize(cut);
  auto img = open_image(b);

  const qcow2::CheckResult r = qcow2::check(*img, qcow2::Repair::kNone);
  CHECK(r.corruptions == 1);
  const bool named = std::any_of(r.messages.begin(), r.messages.end(), [&](const std::string& m) {
    return m.find("data cluster at " + qcow2::hex(cut)) != std::string::npos &&
           m.find("beyond end of file") != std::string::npos;
  });
  CHECK(named);

  qcow2::Writer w(*img);
  const std::vector<uint8_t> data(cs, 0x5a);
  auto view = [](uint64_t, std::span<uint8_t> out) { std::fill(out.begin(), out.end(), 0); };
  w.write(5 * cs, data, view);
  w.commit();
  const qcow2::Run run = img->lookup(5 * cs, cs);
  CHECK(run.host_offset > cut);
  CHECK(img->lookup(cs, cs).host_offset == cut);
}

TEST_CASE("qcow2.refcount.no_leak_repair_past_a_cut_file") {
  // A compressed stream over two clusters, the file cut inside the first: the reference ends
  // more than a cluster past the end of the file, so it is not counted (a corruption, as QEMU
  // says) and the first cluster, inside the file, looks leaked. A leak repair would free a
  // cluster that the L2 entry still names; nothing is repaired.
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 4ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 4096;
  const uint64_t off = b.write_compressed(0, std::vector<uint8_t>(6000, 0x5a));
  REQUIRE(off % cs == 0);
  b.bytes().resize(off + 512);
  auto img = open_image(b);
  const qcow2::CheckResult r = qcow2::check(*img, qcow2::Repair::kLeaks);
  CHECK(r.corruptions == 1);
  CHECK(r.leaks_fixed == 0);
  CHECK(img->refcount(off / cs) == 1);
}

TEST_CASE("qcow2.refcount.stray_refcount_far_out_does_not_grow_the_file") {
  // One refcount far past the end of the file (no table names the cluster: not even a
  // corruption): the writer still takes the first free cluster after the file, as QEMU's
  // allocator does, instead of extending the file past the stray one (80 MiB here; terabytes
  // with a larger index).
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 4ull << 20;
  ImageBuilder b(s);
  const uint64_t cs = 4096, stray = 20000;
  (void)b.write_cluster(0, 0x11);
  b.set_refcount(stray, 1);
  const uint64_t size_before = b.bytes().size();
  auto img = open_image(b);
  qcow2::Writer w(*img);
  const std::vector<uint8_t> data(cs, 0x5a);
  auto view = [](uint64_t, std::span<uint8_t> out) { std::fill(out.begin(), out.end(), 0); };
  w.write(5 * cs, data, view);
  w.commit();
  CHECK(img->file().size() <= size_before + 4 * cs);
  CHECK(img->lookup(5 * cs, cs).host_offset < stray * cs);
}
