// SPDX-License-Identifier: GPL-2.0-or-later
// Focused tests of the controller and the pacer alone (no simulator).
#include <doctest/doctest.h>

#include <vector>

#include "throttle/chunk_gate.h"
#include "throttle/controller.h"
#include "throttle/pacer.h"
#include "throttle/probe.h"

using namespace qcommit::throttle;
using namespace std::chrono_literals;

namespace {

TimePoint at(Duration d) { return TimePoint(d); }

// Drives a controller with a steady, healthy copy: foreground latency `fg`, copy latency
// `copy`, the copy keeping its window full and draining `drain` bytes/s.
struct Driver {
  Controller c;
  Duration now{};
  Decision last{};
  explicit Driver(ControllerConfig cfg = {}) : c(cfg) {}

  Decision step(std::vector<Duration> fg, std::vector<CopySample> copy, double drain,
                Duration dt = 50ms, std::uint32_t fg_outstanding = 0,
                std::optional<Duration> fg_age = std::nullopt) {
    now += dt;
    TickInput in;
    in.now = at(now);
    in.foreground_latencies = fg;
    in.copy_samples = copy;
    in.foreground_outstanding = fg_outstanding;
    in.foreground_oldest_outstanding = fg_age;
    in.backlog_bytes = last.window_bytes;  // window-limited copy
    in.drained_bytes = static_cast<std::uint64_t>(drain * std::chrono::duration<double>(dt).count());
    last = c.tick(in);
    return last;
  }
  Decision healthy(double drain = 100e6, Duration dt = 50ms) {
    return step({1ms, 1ms, 1ms, 1ms, 1ms}, {{3ms, 256 * 1024}, {3ms, 256 * 1024}}, drain, dt);
  }
};

}  // namespace

TEST_CASE("throttle.config.validate") {
  ControllerConfig c;
  CHECK_FALSE(c.validate().has_value());

  auto bad = c;
  bad.latency_budget = 0ms;
  REQUIRE(bad.validate().has_value());
  CHECK(bad.validate()->find("latency_budget") != std::string::npos);

  bad = c;
  bad.floor_rate_bytes_per_s = 10e6;
  bad.ceiling_rate_bytes_per_s = 1e6;
  REQUIRE(bad.validate().has_value());
  CHECK(bad.validate()->find("floor_rate") != std::string::npos);

  bad = c;
  bad.floor_rate_bytes_per_s = 0;
  CHECK(bad.validate().has_value());

  bad = c;
  bad.min_window_bytes = 2 * bad.max_window_bytes;
  CHECK(bad.validate().has_value());

  bad = c;
  bad.slowdown_interval = bad.slowdown_duration;
  CHECK(bad.validate().has_value());

  bad = c;
  bad.initial_rate_bytes_per_s = bad.ceiling_rate_bytes_per_s * 2;
  CHECK(bad.validate().has_value());
}

TEST_CASE("throttle.controller.emergency_stop") {
  Driver d;
  for (int i = 0; i < 40; ++i) d.healthy();
  REQUIRE_FALSE(d.last.paused);
  const double rate_before = d.last.rate_bytes_per_s;
  // One guest flush takes 1 ms base + 45 ms queueing: > 2 × 20 ms budget.
  auto dec = d.step({1ms, 46ms}, {{3ms, 256 * 1024}}, 100e6);
  CHECK(dec.paused);
  CHECK(dec.emergency);
  CHECK(dec.rate_bytes_per_s <= rate_before * kEmergencyRateFactor + 1);
  CHECK(d.c.stats().emergencies == 1);
  // Still paused while samples stay bad; not counted twice.
  dec = d.step({30ms, 44ms}, {}, 0);
  CHECK(dec.paused);
  CHECK(d.c.stats().emergencies == 1);
  // Fresh good samples resume.
  dec = d.healthy();
  CHECK_FALSE(dec.paused);
}

TEST_CASE("throttle.controller.stall_without_completions") {
  Driver d;
  for (int i = 0; i < 40; ++i) d.healthy();
  // A guest request is outstanding and nothing completes: no age given (libvirt case).
  Decision dec{};
  int ticks = 0;
  while (!dec.paused && ticks < 10) {
    dec = d.step({}, {}, 0, 50ms, /*fg_outstanding=*/1);
    ++ticks;
  }
  CHECK(dec.paused);
  CHECK(ticks <= 3);  // 2 × budget = 40 ms: the second quiet tick proves ≥ 50 ms
  // With the age known (engine probe), the first tick suffices.
  Driver e;
  for (int i = 0; i < 40; ++i) e.healthy();
  dec = e.step({}, {}, 0, 50ms, 1, 60ms);
  CHECK(dec.paused);
}

TEST_CASE("throttle.controller.no_increase_without_fresh_samples") {
  Driver d;
  for (int i = 0; i < 20; ++i) d.healthy(100e6);
  // The copy keeps draining (busy), but no latency sample arrives.
  for (int i = 0; i < 60; ++i) {
    const Decision before = d.last;
    const Decision dec = d.step({}, {}, 100e6);
    CHECK_FALSE(dec.fresh);
    CHECK(dec.rate_bytes_per_s <= before.rate_bytes_per_s);
    CHECK(dec.window_bytes <= before.window_bytes);
  }
  // Fresh samples let it grow again.
  const double r = d.last.rate_bytes_per_s;
  for (int i = 0; i < 20; ++i) d.healthy(100e6);
  CHECK(d.last.rate_bytes_per_s > r);
}

TEST_CASE("throttle.controller.window_cap") {
  Driver d;
  // Storage drains 50 MB/s; latencies stay low, so only the cap limits the window.
  for (int i = 0; i < 200; ++i) {
    const Decision dec = d.healthy(50e6);
    const double cap = 0.020 * dec.drain_estimate_bytes_per_s;
    CHECK(static_cast<double>(dec.window_bytes) <= std::max(cap, double(kMinWindowBytes)) + 1);
  }
  const Decision dec = d.healthy(50e6);
  CHECK(dec.drain_estimate_bytes_per_s == doctest::Approx(50e6).epsilon(0.05));
  if (dec.phase != Phase::Slowdown)
    CHECK(static_cast<double>(dec.window_bytes) == doctest::Approx(0.020 * 50e6).epsilon(0.1));
  // The pacing rate respects the configured ceiling.
  ControllerConfig cfg;
  cfg.ceiling_rate_bytes_per_s = 10e6;
  Driver e(cfg);
  for (int i = 0; i < 200; ++i) CHECK(e.healthy(100e6).rate_bytes_per_s <= 10e6);
}

TEST_CASE("throttle.controller.request_budget") {
  // A user's budget is per guest durable write (write + flush): half of it per storage request.
  CHECK(request_budget(20ms) == 10ms);
  CHECK(request_budget(1ms) == 500us);
  ControllerConfig cfg;
  cfg.latency_budget = request_budget(20ms);
  Driver d(cfg);
  Decision dec{};
  for (int i = 0; i < 200; ++i) dec = d.healthy(50e6);
  if (dec.phase != Phase::Slowdown)
    CHECK(static_cast<double>(dec.window_bytes) == doctest::Approx(0.010 * 50e6).epsilon(0.1));
}

TEST_CASE("throttle.controller.skip_until") {
  // A caller that holds the copy for two seconds of its own (qcommitd's settle) and then ticks
  // again with one interval's normal drain: without skip_until the interval spans the hold and
  // reads as a collapsed drain rate; with it the estimate (and the window) stay where they were.
  auto run = [](bool skip) {
    Driver d;
    for (int i = 0; i < 100; ++i) (void)d.healthy(50e6);
    const double before = d.last.drain_estimate_bytes_per_s;
    d.now += 2s;  // the hold (longer than the drain filter's horizon): no ticks
    if (skip) d.c.skip_until(at(d.now));
    double lowest = before;
    for (int i = 0; i < 10; ++i) lowest = std::min(lowest, d.healthy(50e6).drain_estimate_bytes_per_s);
    return lowest / before;
  };
  CHECK(run(true) > 0.9);
  CHECK(run(false) < 0.5);
}

TEST_CASE("throttle.controller.copy_request_floor") {
  // QEMU's commit writes 512 KiB at a time: at 50 MB/s one of them delays a guest request by
  // ~10.5 ms whatever the speed.  With a 10 ms per-request budget (target 5 ms) guest samples
  // of 1 + 9 ms (one chunk ahead) make the controller cut the rate again and again; knowing the
  // copy's indivisible request it keeps its rate instead.
  auto run = [](std::uint64_t unit) {
    ControllerConfig cfg;
    cfg.latency_budget = 10ms;
    cfg.copy_request_bytes = unit;
    Driver d(cfg);
    for (int i = 0; i < 40; ++i) (void)d.healthy(50e6);  // base latencies and drain learned
    Decision dec{};
    for (int i = 0; i < 200; ++i) dec = d.step({1ms, 10ms}, {}, 50e6);
    return std::pair{dec.rate_bytes_per_s, d.c.stats().emergencies};
  };
  const auto [rate_unit, emerg_unit] = run(512 * 1024);
  const auto [rate_none, emerg_none] = run(0);
  MESSAGE("rate with the 512 KiB floor " << rate_unit / 1e6 << " MB/s, without " << rate_none / 1e6);
  CHECK(rate_unit > 4 * rate_none);
  CHECK(rate_unit >= 40e6);
  CHECK(emerg_unit == 0);
  // A delay beyond twice the unit still stops the copy.
  ControllerConfig cfg;
  cfg.latency_budget = 10ms;
  cfg.copy_request_bytes = 512 * 1024;
  Driver d(cfg);
  for (int i = 0; i < 40; ++i) (void)d.healthy(50e6);
  CHECK(d.step({40ms}, {}, 50e6).paused);
}

TEST_CASE("throttle.controller.base_relearned") {
  ControllerConfig cfg;
  Driver d(cfg);
  for (int i = 0; i < 100; ++i) d.healthy();
  REQUIRE(d.last.foreground_base.has_value());
  CHECK(*d.last.foreground_base == 1ms);
  // Base latency rises to 16 ms for good (no queue).  Two slowdown intervals later it is known.
  const Duration change = d.now;
  while (d.now < change + 2 * cfg.slowdown_interval + 2 * cfg.slowdown_duration)
    d.step({16ms, 16ms, 16ms}, {{18ms, 256 * 1024}}, 50e6);
  REQUIRE(d.last.foreground_base.has_value());
  CHECK(*d.last.foreground_base == 16ms);
  CHECK(d.last.queue_delay < 5ms);
}

TEST_CASE("throttle.pacer.durations") {
  Pacer p(1e6, 64 * 1024);  // 1 MB/s, 64 KiB burst
  const TimePoint t0 = at(0ms);
  CHECK(p.reserve(t0, 64 * 1024) == Duration::zero());  // full bucket
  // The next 64 KiB must wait 65.536 ms.
  const Duration w = p.reserve(t0, 64 * 1024);
  CHECK(std::chrono::duration<double>(w).count() == doctest::Approx(0.065536).epsilon(0.001));
  // A caller arriving later waits correspondingly less (the earlier debt is honoured).
  const Duration w2 = p.wait_for(at(100ms), 64 * 1024);
  CHECK(std::chrono::duration<double>(w2).count() == doctest::Approx(0.031072).epsilon(0.001));
  // Raising the rate shortens the wait for the remaining debt.
  p.set_rate(at(100ms), 10e6);
  const Duration w3 = p.wait_for(at(100ms), 64 * 1024);
  CHECK(std::chrono::duration<double>(w3).count() == doctest::Approx(0.0031072).epsilon(0.001));
  // Long-run rate equals the configured rate.
  Pacer q(2e6, 16 * 1024);
  Duration now{};
  std::uint64_t sent = 0;
  while (now < 10s) {
    now += q.reserve(at(now), 16 * 1024);
    sent += 16 * 1024;
  }
  CHECK(static_cast<double>(sent) / 10.0 == doctest::Approx(2e6).epsilon(0.01));
}

TEST_CASE("throttle.chunk_gate.spacing") {
  ChunkGateConfig cfg;
  cfg.chunk_bytes = 512 * 1024;
  cfg.open_hold = 2ms;
  REQUIRE_FALSE(cfg.validate());
  ChunkGate g(cfg);
  const double rate = 512.0 * 1024 / 0.015;  // one chunk per 15 ms
  CHECK(g.period(rate) == 15ms);
  // Stepped every millisecond for 300 ms: opens every 15 ms, each closed 2 ms later.
  std::vector<Duration> opens, closes;
  for (Duration t = 0ms; t < 300ms; t += 1ms) {
    switch (g.step(at(t), rate, true)) {
      case ChunkGate::Action::kOpen:
        opens.push_back(t);
        break;
      case ChunkGate::Action::kClose:
        closes.push_back(t);
        break;
      case ChunkGate::Action::kNone:
        break;
    }
  }
  REQUIRE(opens.size() == 20);
  REQUIRE(closes.size() == 20);
  for (std::size_t i = 0; i < opens.size(); ++i) {
    CHECK(opens[i] == i * 15ms);
    CHECK(closes[i] == opens[i] + 2ms);
  }
  // A late step does not make up for missed openings: one opening, then the period again.
  ChunkGate late(cfg);
  CHECK(late.step(at(0ms), rate, true) == ChunkGate::Action::kOpen);
  CHECK(late.step(at(2ms), rate, true) == ChunkGate::Action::kClose);
  CHECK(late.step(at(100ms), rate, true) == ChunkGate::Action::kOpen);
  CHECK(late.step(at(102ms), rate, true) == ChunkGate::Action::kClose);
  CHECK(late.step(at(110ms), rate, true) == ChunkGate::Action::kNone);
  CHECK(late.step(at(115ms), rate, true) == ChunkGate::Action::kOpen);
  // Not allowed: an open gate closes at once and stays closed.
  CHECK(late.step(at(116ms), rate, false) == ChunkGate::Action::kClose);
  CHECK(late.step(at(200ms), rate, false) == ChunkGate::Action::kNone);
  CHECK_FALSE(late.is_open());
  CHECK(late.step(at(201ms), rate, true) == ChunkGate::Action::kOpen);
  ChunkGateConfig bad;
  bad.chunk_bytes = 0;
  CHECK(bad.validate());
}

TEST_CASE("throttle.controller.probe_signal") {
  // A copy on a host whose own guests are idle: only its shared-queue probe (a write + flush,
  // two storage requests per sample) shows the queue that guests on other hosts wait in.
  Controller c(ControllerConfig{});  // 20 ms per request: target 10 ms, emergency above 40 ms
  Duration now{};
  Decision d{};
  auto tick = [&](std::vector<Duration> probe, std::optional<Duration> outstanding = {},
                  std::vector<Duration> guests = {}, bool idle = true) {
    now += 50ms;
    TickInput in;
    in.now = at(now);
    in.foreground_idle = idle;
    in.foreground_latencies = guests;
    in.probe_latencies = probe;
    in.probe_outstanding = outstanding;
    in.backlog_bytes = d.window_bytes;  // window-limited
    in.drained_bytes = 5'000'000;       // 100 MB/s
    d = c.tick(in);
    return d;
  };
  for (int i = 0; i < 100; ++i) (void)tick({10ms}, {}, {1ms}, false);
  // The probe's base is its own: a guest request's 1 ms is no base for a write + flush of 10 ms.
  REQUIRE(d.probe_base.has_value());
  CHECK(*d.probe_base == 10ms);
  CHECK(*d.foreground_base == 1ms);
  CHECK(d.probe_delay == 0ms);
  CHECK_FALSE(d.paused);
  // Probe samples alone make a tick fresh (the host's guests neither idle nor sampled).
  CHECK(tick({10ms}, {}, {}, false).fresh);
  const double rate = d.rate_bytes_per_s;
  // 10 + 30 ms: 15 ms per request, over the 10 ms target: the rate comes down, no pause.
  CHECK(tick({40ms}).probe_delay == 15ms);
  CHECK(d.rate_bytes_per_s < rate);
  CHECK_FALSE(d.paused);
  // 10 + 90 ms: 45 ms per request, over twice the budget: emergency stop.
  CHECK(tick({100ms}).paused);
  CHECK(d.emergency);
  // A good probe resumes.
  CHECK_FALSE(tick({10ms}).paused);
  // A probe outstanding for 100 ms, nothing completed: (100 − 10) / 2 = 45 ms, a stall.
  CHECK(tick({}, 100ms).paused);
}

TEST_CASE("throttle.probe.schedule") {
  ProbeConfig cfg;  // 4 KiB every 100 ms, at most 1 % of the storage's throughput
  cfg.period = 100ms;
  REQUIRE_FALSE(cfg.validate());
  ProbeSchedule p(cfg);
  CHECK(p.until_next(at(0ms), 100e6) == 0ms);
  p.started(at(0ms));
  // Synchronous: nothing starts while one is outstanding; its age is known.
  CHECK_FALSE(p.until_next(at(5ms), 100e6).has_value());
  CHECK(p.outstanding_age(at(5ms)) == 5ms);
  CHECK(p.completed(at(7ms)) == 7ms);
  CHECK_FALSE(p.outstanding_age(at(7ms)).has_value());
  CHECK(p.until_next(at(7ms), 100e6) == 93ms);
  // A probe that took longer than the period: the next one may start at once.
  p.started(at(100ms));
  CHECK(p.completed(at(350ms)) == 250ms);
  CHECK(p.until_next(at(350ms), 100e6) == 0ms);
  // The load cap stretches the period on slow storage: 4 KiB at most 1 % of 100 kB/s.
  CHECK(p.effective_period(100e3) == std::chrono::microseconds(4'096'000));
  for (double bps : {1e5, 1e6, 1e7, 1e8, 1e9}) {
    const double period_s = std::chrono::duration<double>(p.effective_period(bps)).count();
    CHECK(4096.0 / period_s <= 0.01 * bps * 1.0001);
    CHECK(period_s >= 0.1);
  }
  // Off: never.
  ProbeConfig off;
  off.enabled = false;
  REQUIRE_FALSE(off.validate());
  CHECK_FALSE(ProbeSchedule(off).until_next(at(0ms), 100e6).has_value());
  ProbeConfig bad = cfg;
  bad.period = 1ms;
  CHECK(bad.validate());
  bad = cfg;
  bad.max_load_fraction = 0;
  CHECK(bad.validate());
  bad = cfg;
  bad.bytes = 0;
  CHECK(bad.validate());
}

TEST_CASE("throttle.controller.wall_clock_slowdowns") {
  // Two hosts' controllers whose monotonic clocks are 3.7 s apart, given one synchronised wall
  // clock: their periodic slowdowns start on the same ticks, at multiples of the interval on the
  // wall clock, so that both copies drain the shared queue together.
  const ControllerConfig cfg;
  const Duration offset_b = 3700ms;
  const Duration wall0 = std::chrono::hours(480000) + 250ms;  // some date, not slot-aligned
  const Duration tick = 50ms;
  struct Host {
    Controller c{ControllerConfig{}};
    Decision d{};
    std::vector<Duration> starts;  // wall time of each slowdown start
  };
  Host a, b;
  auto step = [&](Host& h, Duration mono, Duration wall) {
    const std::vector<Duration> fg{1ms, 1ms};
    TickInput in;
    in.now = at(mono);
    in.wall_clock = wall;
    in.foreground_latencies = fg;
    in.backlog_bytes = h.d.window_bytes;
    in.drained_bytes = 2'500'000;  // 50 MB/s
    const auto before = h.c.stats().slowdowns;
    h.d = h.c.tick(in);
    if (h.c.stats().slowdowns > before) h.starts.push_back(wall);
  };
  for (Duration t = tick; t < 35s; t += tick) {
    step(a, t, wall0 + t);
    step(b, t + offset_b, wall0 + t);
  }
  REQUIRE(a.starts.size() >= 3);  // one per interval
  CHECK(a.starts == b.starts);
  for (Duration s : a.starts) CHECK(s % cfg.slowdown_interval < tick);
}
