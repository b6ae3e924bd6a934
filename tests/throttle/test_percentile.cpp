// SPDX-License-Identifier: GPL-2.0-or-later
// throttle::percentile: the nearest rank, the one definition behind every p99 the product reports.
#include <doctest/doctest.h>

#include <numeric>
#include <optional>
#include <vector>

#include "throttle/percentile.h"

using namespace qcommit::throttle;

namespace {
// 1, 2, ..., n in reverse order: the percentile must not depend on the samples' order.
std::vector<int> one_to(int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  std::iota(v.rbegin(), v.rend(), 1);
  return v;
}
}  // namespace

TEST_CASE("throttle.percentile.nearest_rank") {
  CHECK(nearest_rank_index(1, 99) == 0);
  CHECK(nearest_rank_index(10, 99) == 9);    // rank ceil(9.9) = 10: the largest of ten
  CHECK(nearest_rank_index(100, 99) == 98);  // rank 99: one sample of a hundred above it
  CHECK(nearest_rank_index(101, 99) == 99);  // rank ceil(99.99) = 100
  CHECK(nearest_rank_index(200, 99) == 197);
  CHECK(nearest_rank_index(100, 50) == 49);
  CHECK(nearest_rank_index(100, 100) == 99);
  CHECK(nearest_rank_index(10, 150) == 9);  // past 100 %: the max, never past the end
  CHECK(nearest_rank_index(10, 0) == 0);
  CHECK(percentile(one_to(100), kP99Percent) == std::optional<int>(99));
  CHECK(percentile(one_to(1000), kP99Percent) == std::optional<int>(990));
  CHECK(percentile(one_to(3), kP99Percent) == std::optional<int>(3));
  CHECK(percentile(std::vector<int>{}, kP99Percent) == std::nullopt);
}
