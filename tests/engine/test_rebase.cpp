// SPDX-License-Identifier: GPL-2.0-or-later
// engine.rebase.view_changes: where a child of TOP would read something else once backed by BASE
// after the merge, as a function of the sizes and of what the child and BASE hold.
#include <doctest/doctest.h>

#include <vector>

#include "engine/rebase.h"

namespace qcommit::test {
namespace {

using engine::ByteRange;
using engine::RebaseSizes;
using engine::view_changes_on_rebase;

constexpr uint64_t kMiB = 1ull << 20;

std::vector<ByteRange> changes(RebaseSizes s, std::vector<ByteRange> child, std::vector<ByteRange> base) {
  return view_changes_on_rebase(s, child, base);
}

TEST_CASE("engine.rebase.view_changes") {
  const std::vector<ByteRange> base_all{{0, 16 * kMiB}};

  SUBCASE("child larger than a TOP shorter than BASE: BASE's data past TOP's end") {
    CHECK(changes({12 * kMiB, 4 * kMiB, 16 * kMiB}, {}, base_all) ==
          std::vector<ByteRange>{{4 * kMiB, 12 * kMiB}});
  }
  SUBCASE("child larger than BASE too: past BASE's end both read zeros") {
    CHECK(changes({32 * kMiB, 4 * kMiB, 16 * kMiB}, {}, base_all) ==
          std::vector<ByteRange>{{4 * kMiB, 16 * kMiB}});
  }
  SUBCASE("no change where TOP is not shorter than BASE or the child is not larger than TOP") {
    CHECK(changes({16 * kMiB, 16 * kMiB, 16 * kMiB}, {}, base_all).empty());
    CHECK(changes({32 * kMiB, 20 * kMiB, 16 * kMiB}, {}, base_all).empty());
    CHECK(changes({4 * kMiB, 8 * kMiB, 16 * kMiB}, {}, base_all).empty());
    CHECK(changes({8 * kMiB, 8 * kMiB, 16 * kMiB}, {}, base_all).empty());
  }
  SUBCASE("what the child allocates itself and what BASE shows as zeros are left alone") {
    const std::vector<ByteRange> child{{0, 1 * kMiB}, {5 * kMiB, 6 * kMiB}, {7 * kMiB, 9 * kMiB},
                                       {11 * kMiB, 13 * kMiB}};
    const std::vector<ByteRange> base{{0, 2 * kMiB}, {3 * kMiB, 8 * kMiB}, {10 * kMiB, 16 * kMiB}};
    CHECK(changes({12 * kMiB, 4 * kMiB, 16 * kMiB}, child, base) ==
          std::vector<ByteRange>{{4 * kMiB, 5 * kMiB}, {6 * kMiB, 7 * kMiB}, {10 * kMiB, 11 * kMiB}});
  }
  SUBCASE("unaligned sizes: the range starts where TOP ends, byte exact") {
    CHECK(changes({3 * kMiB + 4096, kMiB + 512, 2 * kMiB + 7}, {}, {{0, 2 * kMiB + 7}}) ==
          std::vector<ByteRange>{{kMiB + 512, 2 * kMiB + 7}});
  }
  SUBCASE("adjacent pieces of BASE's map are joined; a child range covering all leaves nothing") {
    CHECK(changes({8 * kMiB, 2 * kMiB, 8 * kMiB}, {}, {{0, 3 * kMiB}, {3 * kMiB, 8 * kMiB}}) ==
          std::vector<ByteRange>{{2 * kMiB, 8 * kMiB}});
    CHECK(changes({8 * kMiB, 2 * kMiB, 8 * kMiB}, {{1 * kMiB, 9 * kMiB}}, base_all).empty());
  }
}

}  // namespace
}  // namespace qcommit::test
