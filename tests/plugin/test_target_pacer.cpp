// SPDX-License-Identifier: GPL-2.0-or-later
// TargetPacer (plugin/govern/target_pacer.h): a job's writeback and settles, driven with a manual
// clock against a scripted page cache (FakeTargetFiles) -- no hypervisor, no Governor.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "plugin/govern/target_pacer.h"
#include "tests/plugin/fake_hypervisor.h"

using namespace qcommit;
using namespace qcommit::plugin;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr Duration kRefresh = 100ms;

// One target file with a scripted page cache, and a pacer for it.
struct Bench {
  explicit Bench(SettleConfig settle = {10s, 2s}) : pacer(WritebackConfig{}, settle, kRefresh) {
    files.files["/base"] = state;
    file = files.open("/base");
  }
  std::shared_ptr<test::FakeFileState> state = std::make_shared<test::FakeFileState>();
  test::FakeTargetFiles files;
  std::unique_ptr<TargetFile> file;
  TargetPacer pacer;
  FallbackSync fallback;
  TimePoint t0{};

  void pace(std::uint64_t window, Duration at) {
    pacer.pace(*file, window, fallback, false, t0 + at);
  }
  bool settle(Duration at) {
    const std::optional<PageCacheState> pc = pacer.read(*file, t0 + at);
    return pacer.settle(*file, pc, t0 + at);
  }
};

}  // namespace

TEST_CASE("plugin.target_pacer.keeps_the_window_and_reads_ranges_between_readings") {
  Bench b;
  b.state->dirty = 64 * kMiB;
  const std::uint64_t window = 8 * kMiB;
  b.pace(window, 0ms);
  CHECK(b.state->whole_readings == 1);
  CHECK(b.state->writeback > 0);
  CHECK(b.state->writeback <= window);
  // Nothing drained: the next paces (within the refresh) start nothing more, and read only the
  // ranges they issued, not the whole file.
  const std::uint64_t issued = b.state->writeback_started;
  for (int i = 1; i <= 10; ++i) b.pace(window, i * 2ms);
  CHECK(b.state->writeback_started == issued);
  CHECK(b.state->whole_readings == 1);
  CHECK(b.state->range_readings > 0);
  // Storage takes half the window: the pacer refills it from the ranges' reading alone.
  b.state->drain(window / 2);
  b.pace(window, 30ms);
  CHECK(b.state->whole_readings == 1);
  CHECK(b.state->writeback_started > issued);
  CHECK(b.state->writeback <= window);
  // The refresh's age passed: a whole-file reading again.
  b.pace(window, kRefresh + 30ms);
  CHECK(b.state->whole_readings == 2);
}

TEST_CASE("plugin.target_pacer.without_per_file_counts_syncs_while_the_job_copies") {
  Bench b;
  b.state->host_wide = true;
  b.state->dirty = 4 * kMiB;
  b.fallback.tick_cur = 10 * kMiB;
  b.fallback.tick_progressed = true;
  b.pace(8 * kMiB, 0ms);
  CHECK(b.state->settled_with_dirty.size() == 1);
  // The sync runs until the writeback it started is done; none beside it.
  b.pace(8 * kMiB, kFallbackSyncGap);
  CHECK(b.state->settled_with_dirty.size() == 1);
  b.state->drain(b.state->writeback);
  b.state->dirty = 1 * kMiB;
  b.pace(8 * kMiB, 2 * kFallbackSyncGap);  // sees the sync done: synced up to tick_cur
  CHECK(b.fallback.synced_cur == b.fallback.tick_cur);
  CHECK(b.state->settled_with_dirty.size() == 2);  // the job still copies: the next one
  // A job whose writes bypass the page cache gets none.
  Bench direct;
  direct.state->host_wide = true;
  direct.fallback.tick_cur = 1;
  direct.fallback.tick_progressed = true;
  direct.pacer.pace(*direct.file, 8 * kMiB, direct.fallback, true, direct.t0);
  CHECK(direct.state->settled_with_dirty.empty());
}

TEST_CASE("plugin.target_pacer.settle_holds_until_clean_then_syncs") {
  Bench b;
  b.state->dirty = 4 * kMiB;
  CHECK_FALSE(b.settle(0s));  // dirty from now on
  CHECK_FALSE(b.settle(9s));
  CHECK(b.settle(10s));  // due: held, nothing synced while dirty
  CHECK(b.pacer.settling());
  CHECK(b.state->settled_with_dirty.empty());
  b.state->dirty = 0;
  CHECK(b.settle(10s + 500ms));  // clean: the sync starts, still held while it runs
  REQUIRE(b.state->settled_with_dirty.size() == 1);
  CHECK(b.state->settled_with_dirty[0] == 0);
  b.state->settle_busy = true;
  CHECK(b.settle(10s + 600ms));
  b.state->settle_busy = false;
  CHECK_FALSE(b.settle(10s + 700ms));  // done: let go
  CHECK_FALSE(b.pacer.settling());
  CHECK(b.pacer.settles() == 1);
}

TEST_CASE("plugin.target_pacer.hold_given_up_then_as_long_as_its_drain_needs") {
  Bench b;  // every 10 s, holds of 2 s at first
  b.state->dirty = 8 * kMiB;
  CHECK_FALSE(b.settle(0s));
  CHECK(b.settle(10s));
  b.state->dirty = 3 * kMiB;  // drained 2.5 MiB/s: 8 MiB take 3.2 s
  CHECK(b.settle(11s));
  CHECK_FALSE(b.settle(12s));  // held 2 s without getting clean: given up
  CHECK_FALSE(b.pacer.settling());
  CHECK(b.pacer.settles() == 0);
  CHECK(b.pacer.settles_given_up() == 1);
  CHECK(b.state->settled_with_dirty.empty());
  CHECK(b.pacer.hold_limit() == 4s);  // 3.2 s and a quarter
  b.state->dirty = 8 * kMiB;
  CHECK_FALSE(b.settle(21s));  // retried an interval after the give-up, not before
  CHECK(b.settle(22s));
  b.state->dirty = 6 * kMiB;
  CHECK(b.settle(25s));  // the second hold may take 4 s
  CHECK_FALSE(b.settle(26s));
  // 0.5 MiB/s: 16 s for 8 MiB, more than half an interval: a longer hold would not do.
  CHECK(b.pacer.hold_limit() == 2s);
  b.state->dirty = 8 * kMiB;
  CHECK(b.settle(36s));
  b.state->dirty = 2 * kMiB;
  CHECK_FALSE(b.settle(38s));
  // 3 MiB/s: 8 MiB take 2.67 s, and a quarter.
  CHECK(b.pacer.hold_limit() > 3300ms);
  CHECK(b.pacer.hold_limit() < 3400ms);
  b.state->dirty = 8 * kMiB;
  CHECK(b.settle(48s));
  b.state->dirty = 0;
  CHECK(b.settle(50s + 100ms));  // clean within the longer hold: synced
  CHECK(b.state->settled_with_dirty.size() == 1);
  CHECK_FALSE(b.settle(50s + 200ms));
  CHECK(b.pacer.settles() == 1);
  CHECK(b.pacer.hold_limit() == 2s);  // a settle that worked: back to the shortest hold
}

TEST_CASE("plugin.target_pacer.a_pivot_after_a_longer_hold_waits_for_it") {
  Bench b;
  b.state->dirty = 8 * kMiB;
  CHECK_FALSE(b.settle(0s));
  CHECK(b.settle(10s));
  b.state->dirty = 3 * kMiB;
  CHECK_FALSE(b.settle(12s));  // given up; the next hold may take 4 s
  REQUIRE(b.pacer.hold_limit() == 4s);
  // A pivot with no reading to settle on waits two such holds, not two of 2 s.
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0 + 13s));
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0 + 17s + 500ms));
  CHECK(b.pacer.settled_for_pivot(b.t0 + 21s));
}

TEST_CASE("plugin.target_pacer.an_upper_bound_count_sets_no_longer_hold") {
  Bench b;
  b.state->memcg_bound = true;
  b.state->cgroup_other_dirty = 32 * kMiB;
  b.state->dirty = 8 * kMiB;
  CHECK_FALSE(b.settle(0s));
  CHECK(b.settle(10s));
  b.state->cgroup_other_dirty = 8 * kMiB;  // the guests' pages drain, not necessarily the target's
  CHECK_FALSE(b.settle(12s));
  CHECK(b.pacer.settles_given_up() == 1);
  CHECK(b.pacer.hold_limit() == 2s);
}

TEST_CASE("plugin.target_pacer.a_hold_without_drain_stays_short") {
  Bench b;
  b.state->dirty = 8 * kMiB;
  CHECK_FALSE(b.settle(0s));
  CHECK(b.settle(10s));
  CHECK_FALSE(b.settle(12s));  // nothing drained: nothing says how long a clean target takes
  CHECK(b.pacer.settles_given_up() == 1);
  CHECK(b.pacer.hold_limit() == 2s);
}

TEST_CASE("plugin.target_pacer.a_pivot_settles_at_once_and_stays_held") {
  Bench b;
  b.state->dirty = 4 * kMiB;
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0 + 1s));
  CHECK(b.settle(1s));  // not due by the interval: the pivot asked
  b.state->dirty = 0;
  CHECK(b.settle(1s + 100ms));  // sync started
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0 + 1s + 150ms));
  CHECK(b.settle(1s + 200ms));  // sync done: held until the pivot ends the job
  CHECK(b.pacer.settled_for_pivot(b.t0 + 1s + 250ms));
  b.state->dirty = 1 * kMiB;
  CHECK(b.settle(30s));
}

TEST_CASE("plugin.target_pacer.a_pivot_waits_two_holds_without_readings") {
  Bench b;
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0));
  CHECK_FALSE(b.pacer.settled_for_pivot(b.t0 + 3s));
  CHECK(b.pacer.settled_for_pivot(b.t0 + 4s));
}

TEST_CASE("plugin.target_pacer.upper_bound_counts_need_a_clean_sweep") {
  Bench b;
  b.state->memcg_bound = true;
  b.state->cgroup_other_dirty = 32 * kMiB;  // the guests' cached writes: never zero
  b.state->dirty_at_front = true;
  b.state->dirty = 1 * kMiB;
  CHECK_FALSE(b.settle(0s));
  CHECK(b.settle(10s));
  b.pace(8 * kMiB, 10s + 10ms);  // pushes the file's own dirty bytes
  CHECK(b.state->dirty == 0);
  CHECK(b.settle(10s + 100ms));
  CHECK(b.state->settled_with_dirty.empty());  // no sweep has found the file clean yet
  // Sweeps on (a whole lap of the file, pieces at a time) until one finds nothing to push.
  for (int i = 1; i <= 400 && b.state->settled_with_dirty.empty(); ++i) {
    b.pace(8 * kMiB, 10s + 100ms + i * 2ms);
    (void)b.settle(10s + 100ms + i * 2ms);
  }
  CHECK(b.state->settled_with_dirty.size() == 1);
  CHECK_FALSE(b.settle(11s));
  CHECK(b.pacer.settles() == 1);
}

TEST_CASE("plugin.target_pacer.no_settles_when_off") {
  Bench b(SettleConfig{Duration::zero(), 2s});
  b.state->dirty = 4 * kMiB;
  for (int s = 0; s <= 60; s += 10) CHECK_FALSE(b.settle(std::chrono::seconds(s)));
  CHECK_FALSE(b.pacer.settles_enabled());
}
