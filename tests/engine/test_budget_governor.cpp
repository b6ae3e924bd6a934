// SPDX-License-Identifier: GPL-2.0-or-later
// BudgetGovernor with co-tenants: a merge copying into a simulated FIFO storage (one queue at a
// fixed bandwidth, as the lab's slowfs) next to scripted co-tenant guests whose cumulative block
// stats move the way libvirt's do.  Simulated time; no probe (it would do real I/O).
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <functional>
#include <thread>

#include "engine/budget_governor.h"

namespace qcommit::engine {
namespace {

using namespace std::chrono_literals;

inline constexpr double kStorageBytesPerS = 100.0 * 1024 * 1024;
inline constexpr auto kStep = 1ms;                 // simulation step
inline constexpr auto kBudget = 20ms;
inline constexpr auto kSnapshotEvery = 100ms;      // what the runs record
inline constexpr int kOpsPerSample = 10;           // a busy co-tenant: 100 writes + flushes/s
inline constexpr auto kQuietLatency = 1ms;         // its latency with nothing queued ahead

struct ScriptedDisk {
  std::string id;
  int ops_per_sample = 0;  // writes and as many flushes completed per sample
  Duration latency{};
  bool present = true;
  throttle::IoCounters c{};
};

// Cumulative counters, advanced by the script's current behaviour on every sample() (libvirt:
// counters move when requests complete).
class ScriptedSource final : public ForegroundSource {
 public:
  std::vector<ScriptedDisk> disks;
  int calls = 0;
  std::vector<ForegroundDisk> sample() override {
    ++calls;
    std::vector<ForegroundDisk> out;
    for (auto& d : disks) {
      if (!d.present) continue;
      d.c.wr_reqs += d.ops_per_sample;
      d.c.wr_total_times_ns += d.ops_per_sample * d.latency.count();
      d.c.flush_reqs += d.ops_per_sample;
      d.c.flush_total_times_ns += d.ops_per_sample * d.latency.count();
      out.push_back({d.id, d.c});
    }
    return out;
  }
};

struct Snapshot {
  double t_s = 0;
  uint64_t copied = 0;  // cumulative bytes completed
  throttle::Decision d;
};

// Simulated start: past the next 10 s boundary of the monotonic clock, so that every run has
// the same first tick gap (clamped to 1 s by the controller) and the same slowdown slots
// (slowdowns align to multiples of 10 s): runs differ only in what the script does.
Clock::time_point sim_start() {
  const auto slot = std::chrono::duration_cast<std::chrono::seconds>(
                        (Clock::now() + 12s).time_since_epoch()) / 10 * 10;
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(slot + 500ms));
}

// Runs a merge for `seconds` against FIFO storage; `script(t_s, source)` changes the co-tenants
// before each of their samples (every kCotenantInterval).
std::vector<Snapshot> simulate(const std::shared_ptr<ScriptedSource>& src,
                               const std::function<void(double, ScriptedSource&)>& script, double seconds,
                               Clock::time_point t0) {
  BudgetGovernorConfig cfg;
  cfg.budget = kBudget;
  cfg.cotenants = src;
  cfg.cotenant_thread = false;
  if (const char* tr = std::getenv("QCOMMIT_TEST_TRACE")) cfg.trace_path = tr;
  REQUIRE(cfg.validate() == "");
  BudgetGovernor gov(cfg);
  struct Req {
    Clock::time_point issued, done;
    uint64_t bytes;
  };
  std::deque<Req> fifo;
  uint64_t inflight = 0, copied = 0;
  Clock::time_point busy_until = t0;
  Clock::time_point next_sample = t0, next_snap = t0 + kSnapshotEvery;
  std::vector<Snapshot> out;
  const auto end = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (auto t = t0; t < end; t += kStep) {
    while (!fifo.empty() && fifo.front().done <= t) {
      gov.completed(t, fifo.front().bytes, t - fifo.front().issued);
      inflight -= fifo.front().bytes;
      copied += fifo.front().bytes;
      fifo.pop_front();
    }
    if (src && t >= next_sample) {
      script(std::chrono::duration<double>(t - t0).count(), *src);
      gov.sample_cotenants(t);
      next_sample += kCotenantInterval;
    }
    gov.tick(t);
    for (;;) {
      const uint64_t bytes = gov.preferred_request_bytes();
      if (gov.admit(t, bytes, inflight) > Duration::zero()) break;
      const auto service = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(double(bytes) / kStorageBytesPerS));
      busy_until = std::max(busy_until, t) + service;
      fifo.push_back({t, busy_until, bytes});
      inflight += bytes;
    }
    if (t >= next_snap) {
      out.push_back({std::chrono::duration<double>(t - t0).count(), copied, gov.last_decision()});
      next_snap += kSnapshotEvery;
    }
  }
  return out;
}

uint64_t copied_between(const std::vector<Snapshot>& s, double from_s, double to_s) {
  uint64_t a = 0, b = 0;
  for (const auto& x : s) {
    if (x.t_s <= from_s) a = x.copied;
    if (x.t_s <= to_s) b = x.copied;
  }
  return b - a;
}

bool paused_throughout(const std::vector<Snapshot>& s, double from_s, double to_s) {
  bool any = false;
  for (const auto& x : s) {
    if (x.t_s < from_s || x.t_s > to_s) continue;
    any = true;
    if (!x.d.paused) return false;
  }
  return any;
}

auto busy(Duration latency) {
  return [latency](double, ScriptedSource& s) {
    for (auto& d : s.disks) {
      d.ops_per_sample = kOpsPerSample;
      d.latency = latency;
    }
  };
}

std::shared_ptr<ScriptedSource> one_disk() {
  auto s = std::make_shared<ScriptedSource>();
  s->disks.push_back({.id = "vm1/vda"});
  return s;
}

}  // namespace

TEST_CASE("engine.governor.idle_cotenant_changes_nothing") {
  // A co-tenant that does no I/O (counters never move) must not change a single decision.
  const auto t0 = sim_start();
  const auto alone = simulate(nullptr, nullptr, 6, t0);
  const auto idle = simulate(one_disk(), [](double, ScriptedSource&) {}, 6, t0);
  REQUIRE(alone.size() == idle.size());
  REQUIRE(alone.size() >= 50);
  for (size_t i = 0; i < alone.size(); ++i) {
    CAPTURE(alone[i].t_s);
    CHECK(idle[i].copied == alone[i].copied);
    CHECK(idle[i].d.rate_bytes_per_s == doctest::Approx(alone[i].d.rate_bytes_per_s).epsilon(1e-9));
    CHECK(idle[i].d.window_bytes == alone[i].d.window_bytes);
    CHECK(idle[i].d.paused == alone[i].d.paused);
  }
  // And the merge did run: most of the storage's bandwidth over the last 3 s.
  CHECK(double(copied_between(alone, 3, 6)) > 0.5 * 3 * kStorageBytesPerS);
}

TEST_CASE("engine.governor.cotenant_latency_slows_down") {
  // A busy co-tenant whose latency stays at its quiet level: the merge runs as fast as alone.
  // When its latency rises to 35 ms (a queue of 34 ms ahead of it: above the 10 ms target, below
  // the 40 ms emergency level) the merge must slow down; at 60 ms it must stop.
  const auto t0 = sim_start();
  const auto quiet = simulate(one_disk(), busy(kQuietLatency), 8, t0);
  auto rising = [](Duration high) {
    return [high](double t, ScriptedSource& s) { busy(t < 4.0 ? kQuietLatency : high)(t, s); };
  };
  const auto slow = simulate(one_disk(), rising(35ms), 8, t0);
  const auto stop = simulate(one_disk(), rising(60ms), 8, t0);

  const uint64_t quiet_late = copied_between(quiet, 5, 8);
  MESSAGE("copied 5-8 s: quiet " << quiet_late << ", 35 ms " << copied_between(slow, 5, 8) << ", 60 ms "
                                  << copied_between(stop, 4.3, 8) << "; rate at 8 s: quiet "
                                  << quiet.back().d.rate_bytes_per_s << ", 35 ms " << slow.back().d.rate_bytes_per_s);
  CHECK(double(quiet_late) > 0.5 * 3 * kStorageBytesPerS);  // the quiet co-tenant costs little
  // Identical until the latency rises.
  CHECK(copied_between(slow, 0, 4) == copied_between(quiet, 0, 4));
  // 35 ms: the co-tenant keeps waiting (its latency does not depend on us in this script), so
  // the rate goes down to the floor and the merge nearly stops.
  CHECK(slow.back().d.rate_bytes_per_s < 0.1 * quiet.back().d.rate_bytes_per_s);
  CHECK(double(copied_between(slow, 5, 8)) < 0.1 * double(quiet_late));
  // 60 ms: paused (emergency stop) from shortly after the rise on, nothing more is issued.
  CHECK(paused_throughout(stop, 4.3, 8));
  CHECK(copied_between(stop, 4.3, 8) <= 4 * kChunkBytes);
  CHECK(!paused_throughout(quiet, 4.3, 8));
}

TEST_CASE("engine.governor.cotenant_stall_pauses") {
  // The co-tenant completes requests every sample, then nothing completes from 4 s on:
  // libvirt's counters stand still, which is a stuck request, never good news.  The merge must
  // stop within about kStallFactor sample intervals and stay stopped while the stall lasts.
  const auto t0 = sim_start();
  const auto quiet = simulate(one_disk(), busy(kQuietLatency), 6, t0);
  const auto stalled = simulate(
      one_disk(),
      [](double t, ScriptedSource& s) {
        s.disks[0].latency = kQuietLatency;
        s.disks[0].ops_per_sample = t < 4.0 ? kOpsPerSample : 0;
      },
      6, t0);
  CHECK(copied_between(stalled, 0, 4) == copied_between(quiet, 0, 4));
  MESSAGE("copied 4.6-6 s: quiet " << copied_between(quiet, 4.6, 6) << ", stalled " << copied_between(stalled, 4.6, 6));
  CHECK(paused_throughout(stalled, 4.6, 6));
  CHECK(copied_between(stalled, 4.6, 6) <= 4 * kChunkBytes);
  CHECK(double(copied_between(quiet, 4.6, 6)) > 0.5 * 1.4 * kStorageBytesPerS);
}

TEST_CASE("engine.governor.cotenant_disks_come_and_go") {
  // Disks vanish (domain stopped) and come back with counters from zero (new QEMU): no bogus
  // sample (negative or huge), no stall for a disk that is gone.
  auto src = one_disk();
  src->disks.push_back({.id = "vm2/vda"});
  BudgetGovernorConfig cfg;
  cfg.budget = kBudget;
  cfg.cotenants = src;
  cfg.cotenant_thread = false;
  BudgetGovernor gov(cfg);
  auto t = Clock::now();
  for (auto& d : src->disks) {
    d.ops_per_sample = kOpsPerSample;
    d.latency = 3ms;
  }
  for (int i = 0; i < 5; ++i, t += kCotenantInterval) gov.sample_cotenants(t);
  CotenantStats st = gov.cotenant_stats();
  CHECK(st.polls == 5);
  CHECK(st.disks == 2);
  CHECK(st.samples == 2 * 2 * 4);  // per disk a write and a flush sample from the 2nd poll on
  CHECK(st.max_latency == 3ms);
  src->disks[1].present = false;
  for (int i = 0; i < 10; ++i, t += kCotenantInterval) gov.sample_cotenants(t);
  st = gov.cotenant_stats();
  CHECK(st.disks == 1);
  CHECK(st.max_disks == 2);
  CHECK(st.stall_polls == 0);
  src->disks[1].present = true;
  src->disks[1].c = {};  // restarted: counters from zero
  src->disks[1].latency = 3ms;
  for (int i = 0; i < 3; ++i, t += kCotenantInterval) gov.sample_cotenants(t);
  st = gov.cotenant_stats();
  CHECK(st.max_latency == 3ms);
  CHECK(st.stall_polls == 0);
  CHECK(st.samples == 2 * 2 * 4 + 2 * 10 + 2 * 3 + 2 * 2);
  // Silent while present: a suspected stall once the silence exceeds kStallFactor intervals.
  for (auto& d : src->disks) d.ops_per_sample = 0;
  for (int i = 0; i < 5; ++i, t += kCotenantInterval) gov.sample_cotenants(t);
  CHECK(gov.cotenant_stats().stall_polls > 0);
}

TEST_CASE("engine.governor.sampling_never_blocks_the_copy") {
  // A hypervisor that takes 400 ms per answer: the copy's calls stay fast, samples still arrive,
  // and the governor's end does not wait for a source stuck for seconds.
  struct SlowSource final : ForegroundSource {
    std::chrono::milliseconds delay;
    std::atomic<int> calls{0};
    explicit SlowSource(std::chrono::milliseconds d) : delay(d) {}
    std::vector<ForegroundDisk> sample() override {
      ++calls;
      std::this_thread::sleep_for(delay);
      throttle::IoCounters c;
      c.wr_reqs = calls * 10;
      c.wr_total_times_ns = c.wr_reqs * 1'000'000;
      return {{"vm1/vda", c}};
    }
  };
  auto src = std::make_shared<SlowSource>(400ms);
  Duration slowest{};
  {
    BudgetGovernorConfig cfg;
    cfg.budget = kBudget;
    cfg.cotenants = src;
    BudgetGovernor gov(cfg);
    const auto start = Clock::now();
    uint64_t inflight = 0;
    while (Clock::now() - start < 1500ms) {
      const auto a = Clock::now();
      gov.tick(a);
      if (gov.admit(a, 65536, inflight) == Duration::zero()) {
        inflight += 65536;
        gov.completed(Clock::now(), 65536, 1ms);
        inflight -= 65536;
      }
      slowest = std::max<Duration>(slowest, Clock::now() - a);
      std::this_thread::sleep_for(1ms);
    }
    CHECK(src->calls >= 3);
    CHECK(gov.cotenant_stats().samples >= 1);
  }
  CHECK(slowest < 100ms);  // far below the source's 400 ms
  auto stuck = std::make_shared<SlowSource>(5000ms);
  const auto a = Clock::now();
  {
    BudgetGovernorConfig cfg;
    cfg.budget = kBudget;
    cfg.cotenants = stuck;
    BudgetGovernor gov(cfg);
    std::this_thread::sleep_for(50ms);
  }
  CHECK(Clock::now() - a < kCotenantJoinTimeout + 1s);
}

}  // namespace qcommit::engine
