// SPDX-License-Identifier: GPL-2.0-or-later
// JobPacing (plugin/govern/job_pacing.h): a governed job's pacing as pure steps, driven with a
// manual clock and hand-made readings -- no hypervisor, no files.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "plugin/govern/job_pacing.h"

using namespace qcommit;
using namespace qcommit::plugin;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;

PacedJob paced(JobType type, bool direct_io = false) {
  PacedJob p;
  p.type = type;
  p.direct_io = direct_io;
  p.ceiling_bytes_per_s = 400.0 * kMiB;
  return p;
}

PageCacheState cache(std::uint64_t dirty, std::uint64_t writeback, bool per_file = true) {
  PageCacheState pc;
  pc.dirty_bytes = dirty;
  pc.writeback_bytes = writeback;
  pc.per_file = per_file;
  return pc;
}

throttle::Decision decision(double rate, std::uint64_t window) {
  throttle::Decision d;
  d.rate_bytes_per_s = rate;
  d.window_bytes = window;
  return d;
}

PacingReading reading(TimePoint now, std::uint64_t cur, std::uint64_t end,
                      std::optional<PageCacheState> pc, std::uint64_t speed_set) {
  PacingReading r;
  r.now = now;
  r.info.cur = cur;
  r.info.end = end;
  r.pc = pc;
  r.speed_set = speed_set;
  return r;
}

}  // namespace

TEST_CASE("plugin.pacing.held_at_the_floor_over_the_window") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  const TimePoint t0{};
  const throttle::Decision d = decision(20.0 * kMiB, 1 * kMiB);
  // Dirty pages up to one burst are not queued yet: the job copies at the controller's rate.
  PacingReading r = reading(t0, 0, 1024 * kMiB, cache(10 * kMiB, kMiB / 2), 4 * kMiB);
  PacingMeasure m = p.measure(r);
  JobSpeed s = p.speed(r, m, d, false);
  CHECK_FALSE(s.held);
  CHECK(s.speed == 20 * kMiB);
  // Under writeback plus dirty beyond the burst: 0.5 + 1.5 MiB > the 1 MiB window: the floor.
  r.pc = cache(kDirtyAllowanceBytes + 3 * kMiB / 2, kMiB / 2);
  m = p.measure(r);
  s = p.speed(r, m, d, false);
  CHECK(s.held);
  CHECK(s.speed == kMinJobSpeedBytesPerS);
  // Paused by the controller, or held for a settle: the floor whatever is queued.
  r.pc = cache(0, 0);
  throttle::Decision paused = d;
  paused.paused = true;
  CHECK(p.speed(r, m, paused, false).speed == kMinJobSpeedBytesPerS);
  CHECK(p.speed(r, m, d, true).held);
  // Never above the policy's ceiling.
  CHECK(p.speed(r, m, decision(1e12, 1 * kMiB), false).speed == 400 * kMiB);
}

TEST_CASE("plugin.pacing.mirror_converges_at_the_ceiling") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  const throttle::Decision d = decision(8.0 * kMiB, 1 * kMiB);
  PacingReading r =
      reading(TimePoint{}, 1023 * kMiB + kMiB / 2, 1024 * kMiB, cache(0, 0), 8 * kMiB);
  const PacingMeasure m = p.measure(r);
  CHECK(p.speed(r, m, d, false).speed == 400 * kMiB);
  // Ready: it copies what the guest writes, at the controller's rate.
  r.ready = true;
  CHECK(p.speed(r, m, d, false).speed == 8 * kMiB);
  // Near its end but not ready, the mirror's last burst counts whole: 2 MiB dirty > the window.
  r.ready = false;
  r.info.cur = 1020 * kMiB;
  r.pc = cache(2 * kMiB, 0);
  CHECK(p.speed(r, p.measure(r), d, false).held);
}

TEST_CASE("plugin.pacing.commit_finishing_speed") {
  PacedJob job = paced(JobType::Commit);
  // The layers' data: 0-64 MiB and 512-520 MiB of a 1 GiB image.
  job.commit_extents = std::vector<ByteRange>{{0, 64 * kMiB}, {512 * kMiB, 8 * kMiB}};
  JobPacing p(job, throttle::ControllerConfig{});
  const throttle::Decision d = decision(40.0 * kMiB, 1 * kMiB);
  // 100 MiB into the image only 8 MiB of data are left: near the end, one window per tick
  // (1 MiB / 100 ms), at least kFinishingSpeedBytesPerS.
  PacingReading r = reading(TimePoint{}, 100 * kMiB, 1024 * kMiB, cache(0, 0), 8 * kMiB);
  JobSpeed s = p.speed(r, p.measure(r), d, false);
  CHECK_FALSE(s.held);
  CHECK(s.speed == 10 * kMiB);
  CHECK(p.speed(r, p.measure(r), decision(40.0 * kMiB, 64 * 1024), false).speed ==
        kFinishingSpeedBytesPerS);
  // Never above the controller's rate.
  CHECK(p.speed(r, p.measure(r), decision(2.0 * kMiB, 1 * kMiB), false).speed == 2 * kMiB);
  // Near the end nothing dirty is allowed beyond the window.
  r.pc = cache(2 * kMiB, 0);
  CHECK(p.speed(r, p.measure(r), d, false).held);
  // Far from the end: the controller's rate, a burst of dirty pages allowed.
  r.info.cur = 10 * kMiB;
  CHECK(p.speed(r, p.measure(r), d, false).speed == 40 * kMiB);
  // cache=none leaves nothing dirty: no finishing speed.
  JobPacing direct(paced(JobType::Commit, true), throttle::ControllerConfig{});
  r.info.cur = 1020 * kMiB;
  r.pc = cache(0, 0);
  CHECK(direct.speed(r, direct.measure(r), d, false).speed == 40 * kMiB);
}

TEST_CASE("plugin.pacing.bursts_released_as_drain") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  TimePoint now{};
  const std::uint64_t speed = 4 * kMiB;
  PacingReading r = reading(now, 0, 1024 * kMiB, cache(0, 0), speed);
  CHECK(p.measure(r).drained == 0);  // no earlier tick
  p.record(r.info, 0);
  // A 16 MiB burst within one tick: released at <= 2 x 4 MiB/s per 100 ms tick, at most 2 s
  // worth of the rate (8 MiB) carried.
  now += 100ms;
  r = reading(now, 16 * kMiB, 1024 * kMiB, cache(0, 0), speed);
  const std::uint64_t first = p.measure(r).drained;
  CHECK(first == 8 * kMiB / 10);
  p.record(r.info, 0);
  std::uint64_t total = first;
  for (int i = 0; i < 30; ++i) {
    now += 100ms;
    r.now = now;
    const std::uint64_t drained = p.measure(r).drained;
    CHECK(drained <= 8 * kMiB / 10 + 1);
    total += drained;
    p.record(r.info, 0);
  }
  CHECK(total >= 8 * kMiB / 10 + 8 * kMiB - 32);
  CHECK(total <= 8 * kMiB / 10 + 8 * kMiB);
}

TEST_CASE("plugin.pacing.backlog_growth_is_not_drain") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  const std::uint64_t speed = 40 * kMiB;
  PacingReading r = reading(TimePoint{}, 0, 1024 * kMiB, cache(0, 0), speed);
  (void)p.measure(r);
  p.record(r.info, 0);
  // 4 MiB copied, 3 MiB more of them under writeback than a tick ago: 1 MiB reached storage.
  r = reading(TimePoint{} + 100ms, 4 * kMiB, 1024 * kMiB, cache(0, 3 * kMiB), speed);
  const PacingMeasure m = p.measure(r);
  CHECK(m.backlog == 3 * kMiB);
  CHECK(m.drained == 1 * kMiB);
}

TEST_CASE("plugin.pacing.host_wide_reading_bounded_by_syncs") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  const std::uint64_t speed = 4 * kMiB;
  const PageCacheState host = cache(100 * kMiB, 0, false);  // /proc/meminfo: every writer's
  PacingReading r = reading(TimePoint{}, 0, 1024 * kMiB, host, speed);
  PacingMeasure m = p.measure(r);
  CHECK(m.own_bound == std::numeric_limits<std::uint64_t>::max());  // nothing synced yet
  CHECK_FALSE(m.own_queue.has_value());
  p.record(r.info, m.backlog);
  p.fallback().synced_cur = 0;  // a sync of the target started at progress 0 has completed
  // 10 MiB copied since: all of it may still be dirty, less what the set speed allowed out with
  // this tick's syncs (0.4 MiB).
  r = reading(TimePoint{} + 100ms, 10 * kMiB, 1024 * kMiB, host, speed);
  m = p.measure(r);
  CHECK(m.own_bound == 10 * kMiB - 4 * kMiB / 10);
  CHECK(m.backlog == m.own_bound);
  CHECK(p.fallback().tick_progressed);
  // A job whose writes bypass the page cache has none of the host's dirty pages.
  JobPacing direct(paced(JobType::ActiveCommit, true), throttle::ControllerConfig{});
  CHECK(direct.measure(r).backlog == 0);
}

TEST_CASE("plugin.pacing.own_queue_at_storage") {
  // Past the page cache: the requests QEMU keeps in flight, where their size is known.
  throttle::ControllerConfig c;
  c.copy_request_bytes = 1 * kMiB;
  c.copy_requests_in_flight = 16;
  JobPacing direct(paced(JobType::ActiveCommit, true), c);
  PacingReading r = reading(TimePoint{}, 0, 1024 * kMiB, cache(0, 0), 4 * kMiB);
  CHECK(direct.measure(r).own_queue == 16 * kMiB);
  JobPacing unknown(paced(JobType::ActiveCommit, true), throttle::ControllerConfig{});
  CHECK_FALSE(unknown.measure(r).own_queue.has_value());
  // Through the page cache: the target's pages under writeback, counted for the file only.
  JobPacing cached(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  r.pc = cache(5 * kMiB, 3 * kMiB);
  CHECK(cached.measure(r).own_queue == 3 * kMiB);
  PageCacheState bound = cache(5 * kMiB, 3 * kMiB);
  bound.dirty_upper_bound = true;  // a memory cgroup's count
  r.pc = bound;
  CHECK_FALSE(cached.measure(r).own_queue.has_value());
  r.pc.reset();
  CHECK_FALSE(cached.measure(r).own_queue.has_value());
}

TEST_CASE("plugin.pacing.settle_hold_keeps_the_decision") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  TimePoint now{};
  throttle::TickInput in;
  in.now = now;
  in.foreground_idle = true;
  const throttle::Decision first = p.decide(in, false);
  REQUIRE(p.decision().has_value());
  // A burst is credited, then the job is held for a settle: the decision stands and the credit
  // is dropped (the hold made the progress, not the storage).
  PacingReading r = reading(now, 0, 1024 * kMiB, cache(0, 0), 4 * kMiB);
  (void)p.measure(r);
  p.record(r.info, 0);
  now += 100ms;
  r = reading(now, 16 * kMiB, 1024 * kMiB, cache(0, 0), 4 * kMiB);
  CHECK(p.measure(r).drained > 0);
  p.record(r.info, 0);
  in.now = now;
  // The guests' requests waited 200 ms (10 x the budget): fed, the controller would stop the
  // copy; held, the hold made that, and the decision from before stands.
  const std::vector<Duration> slow(20, 200ms);
  in.foreground_latencies = slow;
  in.foreground_idle = false;
  const throttle::Decision held = p.decide(in, true);
  CHECK_FALSE(held.paused);
  CHECK(held.rate_bytes_per_s == first.rate_bytes_per_s);
  CHECK(held.window_bytes == first.window_bytes);
  JobPacing fed(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  in.now = TimePoint{};
  in.foreground_latencies = {};
  in.foreground_idle = true;
  (void)fed.decide(in, false);
  in.now = now;
  in.foreground_latencies = slow;
  in.foreground_idle = false;
  const throttle::Decision d = fed.decide(in, false);
  CHECK((d.paused || d.rate_bytes_per_s < first.rate_bytes_per_s));
  now += 100ms;
  r.now = now;
  CHECK(p.measure(r).drained == 0);
}

namespace {

// A mirror's readings every 100 ms for `dt`: the guests add `added` bytes/s to its end, it copies
// `copied` bytes/s (in whole `burst`s when given), at speed `speed`.
struct MirrorRun {
  JobPacing& p;
  TimePoint now{};
  double cur = 0;
  double end = 1024.0 * kMiB;
  double copied_credit = 0;
  void run(Duration dt, double added, double copied, std::uint64_t speed, double burst = 0,
           bool ready = false) {
    for (const TimePoint until = now + dt; now < until; now += 100ms) {
      end += added / 10;
      copied_credit += copied / 10;
      const double step = burst > 0 ? std::floor(copied_credit / burst) * burst : copied_credit;
      cur = std::min(cur + step, end);
      copied_credit -= step;
      PacingReading r = reading(now, static_cast<std::uint64_t>(cur),
                                static_cast<std::uint64_t>(end), cache(0, 0), speed);
      r.ready = ready;
      const PacingMeasure m = p.measure(r);
      p.record(r.info, m.backlog);
    }
  }
};

}  // namespace

TEST_CASE("plugin.pacing.sprint_outruns_the_guests_without_a_flood") {
  // A mirror within kMirrorConvergeBytes of its end, after `added` MiB/s of the guests' writes
  // over a window it kept up with: its sprint speed.
  const auto sprint = [](double added, double ceiling) {
    PacedJob job = paced(JobType::ActiveCommit);
    job.ceiling_bytes_per_s = ceiling;
    JobPacing p(job, throttle::ControllerConfig{});
    MirrorRun m{p};  // 1 GiB to go: it keeps up, its work left shrinks (never caught up here)
    m.run(12s, added, 1.5 * added, 8 * kMiB);
    REQUIRE(p.convergence().known);
    CHECK(p.convergence().converging);
    const PacingReading r = reading(m.now, static_cast<std::uint64_t>(m.end) - kMiB / 2,
                                    static_cast<std::uint64_t>(m.end), cache(0, 0), 8 * kMiB);
    const JobSpeed s = p.speed(r, p.measure(r), decision(8.0 * kMiB, 1 * kMiB), false);
    CHECK_FALSE(s.held);
    return static_cast<double>(s.speed);
  };
  // The guests add 16 MiB/s: 3 x that, not the ceiling (400 MiB/s).
  CHECK(sprint(16.0 * kMiB, 400.0 * kMiB) ==
        doctest::Approx(kSprintAddedFactor * 16.0 * kMiB).epsilon(0.02));
  // A little (a probe's writes): never below kMinSprintBytesPerS, at which it finishes.
  CHECK(sprint(0.5 * kMiB, 400.0 * kMiB) == kMinSprintBytesPerS);
  // Never above the ceiling.
  CHECK(sprint(16.0 * kMiB, 20.0 * kMiB) == 20.0 * kMiB);
  // Never slower than the controller's rate before it.
  PacedJob job = paced(JobType::ActiveCommit);
  JobPacing p(job, throttle::ControllerConfig{});
  MirrorRun m{p};
  m.run(12s, 1.0 * kMiB, 1.5 * kMiB, 8 * kMiB);
  const PacingReading r = reading(m.now, static_cast<std::uint64_t>(m.end) - kMiB / 2,
                                  static_cast<std::uint64_t>(m.end), cache(0, 0), 8 * kMiB);
  CHECK(p.speed(r, p.measure(r), decision(50.0 * kMiB, 1 * kMiB), false).speed == 50 * kMiB);
}

TEST_CASE("plugin.pacing.converge_floor_after_a_stall") {
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  MirrorRun m{p};
  // At 2 MiB/s the window is two 16 MiB bursts: 16 s.  The guests add 4 MiB/s.
  m.run(15s, 4.0 * kMiB, 1.0 * kMiB, 2 * kMiB);
  CHECK_FALSE(p.convergence().known);
  m.run(2s, 4.0 * kMiB, 1.0 * kMiB, 2 * kMiB);
  REQUIRE(p.convergence().known);
  CHECK_FALSE(p.convergence().converging);
  CHECK(p.convergence().added_bytes_per_s == doctest::Approx(4.0 * kMiB).epsilon(0.01));
  CHECK(p.convergence().floor_bytes_per_s == 0);
  m.run(kNotConvergingAfter - 2s, 4.0 * kMiB, 1.0 * kMiB, 2 * kMiB);
  CHECK(p.convergence().floor_bytes_per_s == 0);
  m.run(3s, 4.0 * kMiB, 1.0 * kMiB, 2 * kMiB);
  CHECK(p.convergence().floor_bytes_per_s == doctest::Approx(8.0 * kMiB).epsilon(0.01));
  // The floor holds the job up even where the controller would hold it at the minimum, and
  // raises the controller's rate -- but not through a settle's hold.
  const PacingReading r = reading(m.now, static_cast<std::uint64_t>(m.cur),
                                  static_cast<std::uint64_t>(m.end), cache(0, 0), 8 * kMiB);
  const PacingMeasure pm{std::numeric_limits<std::uint64_t>::max(), 0, 0, std::nullopt};
  throttle::Decision paused = decision(1.0 * kMiB, 64 * 1024);
  paused.paused = true;
  CHECK(p.speed(r, pm, paused, false).speed >= 8 * kMiB * 99 / 100);
  CHECK(p.speed(r, pm, decision(2.0 * kMiB, 1 * kMiB), false).speed >= 8 * kMiB * 99 / 100);
  CHECK(p.speed(r, pm, decision(2.0 * kMiB, 1 * kMiB), true).speed == kMinJobSpeedBytesPerS);
  // Its writeback window carries the floor's rate through the delay measured (+ the budget).
  throttle::Decision slow = decision(1.0 * kMiB, 64 * 1024);
  slow.measured_delay = 180ms;
  CHECK(p.writeback_window(slow) >= 8 * kMiB * 2 / 10 * 99 / 100);
  // It only ratchets up: the guests slowing down leaves it.
  m.run(30s, 1.0 * kMiB, 8.0 * kMiB, 8 * kMiB);
  CHECK(p.convergence().converging);
  CHECK(p.convergence().floor_bytes_per_s == doctest::Approx(8.0 * kMiB).epsilon(0.01));
  // A step back by one byte is the same job (libvirt's unready mirror); ready ends it all.
  m.cur -= 1;
  m.run(100ms, 0, 0, 8 * kMiB);
  CHECK(p.convergence().floor_bytes_per_s > 0);
  m.run(100ms, 0, 0, 8 * kMiB, 0, true);
  CHECK_FALSE(p.convergence().known);
  CHECK(p.convergence().floor_bytes_per_s == 0);
}

TEST_CASE("plugin.pacing.converge_floor_within_the_policy") {
  PacedJob job = paced(JobType::ActiveCommit);
  job.ceiling_bytes_per_s = 6.0 * kMiB;
  JobPacing p(job, throttle::ControllerConfig{});
  MirrorRun m{p};
  m.run(kConvergeWindow + kNotConvergingAfter + 2s, 4.0 * kMiB, 1.0 * kMiB, 4 * kMiB);
  CHECK(p.convergence().floor_bytes_per_s == doctest::Approx(6.0 * kMiB));  // the ceiling
  JobPacing q(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  MirrorRun n{q};
  n.run(kConvergeWindow + kNotConvergingAfter + 2s, 0.25 * kMiB, 0, 4 * kMiB);
  CHECK(q.convergence().floor_bytes_per_s == doctest::Approx(1.0 * kMiB));  // the policy's floor
}

TEST_CASE("plugin.pacing.slow_or_idle_mirror_is_not_a_stall") {
  // At 1 MiB/s QEMU's mirror copies a 16 MiB burst every 16 s: a 10 s window without one is no
  // stall while the guests add 0.4 MiB/s.
  JobPacing p(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  MirrorRun m{p};
  bool ever_stalled = false;
  for (int i = 0; i < 200; ++i) {
    m.run(1s, 0.4 * kMiB, 1.0 * kMiB, 1 * kMiB, 16.0 * kMiB);
    ever_stalled = ever_stalled || (p.convergence().known && !p.convergence().converging);
  }
  CHECK(p.convergence().known);
  CHECK_FALSE(ever_stalled);
  // Held at the minimum with nothing added: it ends whenever the governor lets it copy.
  JobPacing q(paced(JobType::ActiveCommit), throttle::ControllerConfig{});
  MirrorRun n{q};
  n.run(kMaxConvergeWindow + kNotConvergingAfter + 5s, 0, 0, kMinJobSpeedBytesPerS);
  CHECK(q.convergence().known);
  CHECK(q.convergence().converging);
  CHECK(q.convergence().floor_bytes_per_s == 0);
}
