// SPDX-License-Identifier: GPL-2.0-or-later
// The check in two steps: plan_repair reads a damaged image and lays out its repairs without
// writing a byte; apply_repair writes them (the image then passes qemu-img check) and refuses an
// image that changed since the plan was made.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "qcow2/check.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;

namespace {

inline constexpr uint64_t kCopied = 1ull << 63;

// 64 KiB clusters: 0 header, 1 refcount table, 2 L1, 3 refcount block, 4 L2, 5-7 data of guest
// clusters 0-2, 8 a cluster nobody references, 9 data of guest cluster 3. Broken: cluster 5's
// refcount is 2 (a leak, and its COPIED flag is wrong), cluster 6's is 0 (too low, COPIED wrong),
// cluster 8 has refcount 1 (a leak), guest cluster 3's entry lacks COPIED though cluster 9's
// refcount is 1.
struct DamagedImage {
  ImageBuilder b{ImageSpec{}};
  uint64_t cs = b.cluster_size();
  DamagedImage() {
    for (uint64_t g = 0; g < 3; ++g) (void)b.write_cluster(g * cs, uint8_t(0xa0 + g));
    b.set_refcount(5, 2);
    b.set_refcount(6, 0);
    (void)b.alloc_cluster();
    const uint64_t host = b.alloc_cluster();
    b.set_l2(3 * cs, host);  // no COPIED flag
  }
};

std::vector<uint8_t>& bytes_of(qcow2::Image& img) {
  return dynamic_cast<qcow2::MemoryDevice&>(img.file()).bytes();
}

// qemu-img check's exit status for `bytes` written to a file (0: clean).
int qemu_img_check(const std::vector<uint8_t>& bytes) {
  TempDir dir;
  const std::string path = dir.write("repaired.qcow2", bytes);
  return WEXITSTATUS(std::system(("qemu-img check -q " + path + " >/dev/null 2>&1").c_str()));
}

}  // namespace

TEST_CASE("qcow2.check.plan_lists_repairs_and_writes_nothing") {
  DamagedImage d;
  auto img = open_image(d.b);
  const std::vector<uint8_t> before = bytes_of(*img);

  const qcow2::RepairPlan plan = qcow2::plan_repair(*img, qcow2::Repair::kAll);

  CHECK(bytes_of(*img) == before);
  CHECK(plan.findings.leaks == 2);
  CHECK(plan.findings.corruptions == 4);  // cluster 6's refcount, three COPIED flags
  CHECK(plan.findings.leaks_fixed == 0);
  CHECK(plan.findings.corruptions_fixed == 0);
  const uint64_t block = 3 * d.cs;
  REQUIRE(plan.refcount_fixes.size() == 3);
  const std::vector<std::vector<uint64_t>> want_refcounts{
      {5, block, 2, 1}, {6, block, 0, 1}, {8, block, 1, 0}};
  for (size_t i = 0; i < 3; ++i) {
    const qcow2::RefcountFix& f = plan.refcount_fixes[i];
    CAPTURE(i);
    CHECK(std::vector<uint64_t>{f.cluster, f.block_offset, f.from, f.to} == want_refcounts[i]);
  }
  const uint64_t l2 = 4 * d.cs;
  REQUIRE(plan.copied_fixes.size() == 3);
  const uint64_t want_entries[3][2] = {{5 * d.cs | kCopied, 5 * d.cs | kCopied},
                                       {6 * d.cs | kCopied, 6 * d.cs | kCopied},
                                       {9 * d.cs, 9 * d.cs | kCopied}};
  const uint64_t want_index[3] = {0, 1, 3};
  for (size_t i = 0; i < 3; ++i) {
    const qcow2::CopiedFlagFix& f = plan.copied_fixes[i];
    CAPTURE(i);
    CHECK(f.table == qcow2::CopiedFlagFix::Table::kL2);
    CHECK(f.table_offset == l2);
    CHECK(f.index == want_index[i]);
    CHECK(f.at == l2 + 8 * want_index[i]);
    CHECK(f.before == want_entries[i][0]);
    CHECK(f.after == want_entries[i][1]);
  }
  CHECK(plan.unrepairable.empty());
  CHECK_FALSE(plan.refused_unreliable);
  // The check alone plans nothing.
  const qcow2::RepairPlan none = qcow2::plan_repair(*img, qcow2::Repair::kNone);
  CHECK(none.refcount_fixes.empty());
  CHECK(none.copied_fixes.empty());
  CHECK(bytes_of(*img) == before);
}

TEST_CASE("qcow2.check.applied_plan_leaves_the_image_clean") {
  DamagedImage d;
  auto img = open_image(d.b);
  REQUIRE(qemu_img_check(bytes_of(*img)) != 0);
  const qcow2::RepairPlan plan = qcow2::plan_repair(*img, qcow2::Repair::kAll);

  const qcow2::CheckResult r = qcow2::apply_repair(*img, plan);

  CHECK(r.leaks_fixed == 2);
  CHECK(r.corruptions_fixed == 4);
  CHECK(r.clean());
  const std::vector<uint8_t> repaired = bytes_of(*img);
  CHECK(get_be(repaired, 4 * d.cs + 8 * 3, 8) == (9 * d.cs | kCopied));
  CHECK(qemu_img_check(repaired) == 0);
  auto again = open_bytes(repaired);
  const qcow2::CheckResult fresh = qcow2::check(*again);
  CHECK(fresh.corruptions == 0);
  CHECK(fresh.leaks == 0);
}

TEST_CASE("qcow2.check.apply_refuses_an_image_changed_since_the_plan") {
  DamagedImage d;
  auto img = open_image(d.b);
  const qcow2::RepairPlan plan = qcow2::plan_repair(*img, qcow2::Repair::kAll);
  SUBCASE("a refcount the plan rewrites") {
    put_be(bytes_of(*img), 3 * d.cs + 2 * 8, 3, 2);  // cluster 8's refcount, now 3
  }
  SUBCASE("a table entry the plan rewrites") {
    put_be(bytes_of(*img), 4 * d.cs + 8 * 3, 0, 8);  // guest cluster 3 discarded
  }
  SUBCASE("the header") {
    put_be(bytes_of(*img), 24, 128ull << 20, 8);  // virtual size
  }
  const std::vector<uint8_t> changed = bytes_of(*img);
  expect_error<qcow2::Error>([&] { (void)qcow2::apply_repair(*img, plan); }, "mem.qcow2",
                             "changed since its repair was planned");
  CHECK(bytes_of(*img) == changed);
}
