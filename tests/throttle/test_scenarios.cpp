// SPDX-License-Identifier: GPL-2.0-or-later
// The storage scenarios, run in the deterministic simulator with numeric pass criteria.
// Budget T = 20 ms, C = 100 MB/s unless stated.  "Added latency" = guest latency − the same
// request's latency without any copy (base latency + its own service time).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "tests/throttle/scenarios.h"

using namespace qcommit::throttle;
using namespace qcommit::throttle::sim;

namespace {

constexpr double kT = static_cast<double>(kBudget) / kMs;  // 20 ms
const Policy kOurs{PolicyKind::Controller, 0};

double max_of(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

double leftover(const ScenarioRun& r, Ns a, Ns b, double capacity) {
  return capacity - r.sim->guest_throughput(a, b);
}

}  // namespace

TEST_CASE("throttle.sim.fifo_physics") {
  // The simulator reproduces the stall physics: a guest flush waits for the bytes queued
  // ahead of it ÷ bandwidth.  An unthrottled mirror-like copy keeps 16 MiB in flight.
  auto sim = std::make_unique<Simulator>(StorageConfig{}, PageCacheConfig{}, 1);
  GuestConfig g;
  g.interval = 10 * kMs;
  sim->add_guest(g);
  JobConfig j = copy_job(Policy{PolicyKind::Unlimited, 0}, 2 * kGiB);
  sim->add_job(j);
  sim->run(10 * kSec);
  const auto lat = added_ms(*sim, 2 * kSec, 10 * kSec);
  REQUIRE(lat.size() > 20);
  const double expect_ms = 16.0 * 1024 * 1024 / kCapacity * 1000;  // ≈ 168 ms
  CHECK(percentile(lat, 50) == doctest::Approx(expect_ms).epsilon(0.1));
  // And with no copy the added latency is zero.
  auto idle = std::make_unique<Simulator>(StorageConfig{}, PageCacheConfig{}, 1);
  idle->add_guest(g);
  idle->run(2 * kSec);
  CHECK(max_of(added_ms(*idle, 0, 2 * kSec)) < 0.01);
}

TEST_CASE("throttle.scenario.01_flush_guest") {
  const auto r = run_scenario(1, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  REQUIRE(job.finished_at > 0);  // 20 GiB copied
  const auto lat = added_ms(*r.sim, 0, r.to);
  MESSAGE("added p99 " << percentile(lat, 99) << " ms, max " << max_of(lat) << " ms");
  CHECK(percentile(lat, 99) <= kT);
  CHECK(max_of(lat) <= 2 * kT);
  const double copy = job.throughput(0, job.finished_at);
  const double left = leftover(r, 0, job.finished_at, kCapacity);
  MESSAGE("copy " << 100 * copy / left << "% of leftover");
  CHECK(copy >= 0.8 * left);
}

TEST_CASE("throttle.scenario.02_idle_then_active") {
  const auto r = run_scenario(2, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const double idle = job.throughput(0, 30 * kSec);
  MESSAGE("copy while idle " << idle / kMBps << " MB/s");
  CHECK(idle >= 0.9 * kCapacity);
  const auto first_s = added_ms(*r.sim, 30 * kSec, 31 * kSec);
  const auto after_2s = added_ms(*r.sim, 32 * kSec, 60 * kSec);
  REQUIRE(first_s.size() > 50);
  MESSAGE("p99 first second " << percentile(first_s, 99) << " ms, after 2 s "
                              << percentile(after_2s, 99) << " ms");
  CHECK(percentile(first_s, 99) <= 2 * kT);
  CHECK(percentile(after_2s, 99) <= kT);
}

TEST_CASE("throttle.scenario.03_capacity_drop") {
  const auto r = run_scenario(3, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const double want = static_cast<double>(kBudget) / kSec * 30 * kMBps;  // T × 30 MB/s = 600 kB
  int checked = 0;
  for (const auto& t : job.ticks) {
    if (t.t < 32 * kSec || t.d.phase == Phase::Slowdown || t.d.phase == Phase::Paused) continue;
    ++checked;
    INFO("t=" << static_cast<double>(t.t) / kSec << " window=" << t.d.window_bytes);
    CHECK(static_cast<double>(t.d.window_bytes) >= 0.8 * want);
    CHECK(static_cast<double>(t.d.window_bytes) <= 1.2 * want);
  }
  CHECK(checked > 100);
  const auto transition = added_ms(*r.sim, 30 * kSec, 32 * kSec);
  MESSAGE("transition p99 " << percentile(transition, 99) << " ms, max " << max_of(transition));
  CHECK(percentile(transition, 99) <= 3 * kT);
}

TEST_CASE("throttle.scenario.04_capacity_restore") {
  const auto r = run_scenario(4, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const double left = leftover(r, 60 * kSec, 90 * kSec, kCapacity);
  Ns reached = -1;
  for (Ns t = 60 * kSec; t + kSec <= 90 * kSec; t += 100 * kMs)
    if (job.throughput(t, t + kSec) >= 0.8 * left) {
      reached = t + kSec;
      break;
    }
  MESSAGE("80% of leftover reached after " << static_cast<double>(reached - 60 * kSec) / kSec << " s");
  REQUIRE(reached > 0);
  CHECK(reached - 60 * kSec <= 10 * kSec);
  CHECK(job.throughput(70 * kSec, 90 * kSec) >= 0.8 * left);
  CHECK(percentile(added_ms(*r.sim, 60 * kSec, 90 * kSec), 99) <= kT);
}

TEST_CASE("throttle.scenario.05_storage_stall") {
  const auto r = run_scenario(5, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  // Detection: the first tick during the stall that pauses the copy.
  Ns detected = -1;
  for (const auto& t : job.ticks)
    if (t.t >= 30 * kSec && t.t < 32 * kSec && t.d.paused) {
      detected = t.t;
      break;
    }
  REQUIRE(detected > 0);
  MESSAGE("stall detected after " << static_cast<double>(detected - 30 * kSec) / kMs << " ms");
  // The oldest guest request exceeds 2T after 40 ms; the controller ticks every ≤ 50 ms.
  CHECK(detected - 30 * kSec <= 2 * kBudget + 2 * 50 * kMs);
  // Not one tick later: no copy I/O at all from the detecting tick to the end of the stall.
  const auto after = std::count_if(job.submits.begin(), job.submits.end(),
                                   [&](Ns s) { return s >= detected && s < 32 * kSec; });
  CHECK(after == 0);
  const auto recovered = added_ms(*r.sim, 33 * kSec, 45 * kSec);
  MESSAGE("p99 from 1 s after the stall " << percentile(recovered, 99) << " ms");
  CHECK(percentile(recovered, 99) <= kT);
  // The copy resumed.
  CHECK(job.throughput(35 * kSec, 45 * kSec) > 0.5 * kCapacity);
}

TEST_CASE("throttle.scenario.06_page_cache") {
  const auto r = run_scenario(6, kOurs);
  const double tc = static_cast<double>(kBudget) / kSec * kCapacity;  // T × C = 2 MB
  MESSAGE("max dirty+in-flight " << r.sim->max_total_copy_backlog() << " bytes (T×C = " << tc << ")");
  CHECK(static_cast<double>(r.sim->max_total_copy_backlog()) <= tc);
  const auto lat = added_ms(*r.sim, 0, r.to);
  MESSAGE("guest max " << max_of(lat) << " ms");
  CHECK(max_of(lat) < 100);
  CHECK(r.sim->job(r.jobs[0]).finished_at > 0);
  // Uncontrolled baseline in the same setting: the page cache fills, writeback floods the FIFO.
  const auto u = run_scenario(6, Policy{PolicyKind::Unlimited, 0});
  const auto ulat = added_ms(*u.sim, 0, u.to);
  MESSAGE("uncontrolled guest max " << max_of(ulat) << " ms");
  CHECK(max_of(ulat) > 1000);
}

TEST_CASE("throttle.scenario.07_guest_saturates") {
  const auto r = run_scenario(7, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const double copy = job.throughput(0, 60 * kSec);
  const double floor = default_controller_config().floor_rate_bytes_per_s;
  MESSAGE("copy " << copy / kMBps << " MB/s");
  CHECK(copy <= std::max(0.05 * kCapacity, floor));
  const auto lat = added_ms(*r.sim, 0, 60 * kSec);
  MESSAGE("guest added p99 " << percentile(lat, 99) << " ms");
  CHECK(percentile(lat, 99) <= kT);
}

TEST_CASE("throttle.scenario.08_two_copies") {
  const auto r = run_scenario(8, kOurs);
  const auto lat = added_ms(*r.sim, 0, 180 * kSec);
  MESSAGE("guest added p99 " << percentile(lat, 99) << " ms");
  CHECK(percentile(lat, 99) <= kT);
  const double a = r.sim->job(r.jobs[0]).throughput(120 * kSec, 180 * kSec);
  const double b = r.sim->job(r.jobs[1]).throughput(120 * kSec, 180 * kSec);
  REQUIRE(b > 0);
  MESSAGE("throughput A " << a / kMBps << " MB/s, B " << b / kMBps << " MB/s");
  CHECK(a / b >= 0.5);
  CHECK(a / b <= 2.0);
}

TEST_CASE("throttle.scenario.09_base_latency_change") {
  const auto r = run_scenario(9, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const auto cfg = default_controller_config();
  // Base latency goes from 1 ms to 16 ms at 30 s (a 4 KiB flush adds 0.04 ms of service).
  const Ns relearn_by = 30 * kSec + 2 * cfg.slowdown_interval.count() + cfg.slowdown_duration.count();
  int checked = 0;
  for (const auto& t : job.ticks) {
    if (t.t < relearn_by || !t.d.foreground_base) continue;
    ++checked;
    INFO("t=" << static_cast<double>(t.t) / kSec);
    CHECK(std::abs(static_cast<double>(t.d.foreground_base->count()) / kMs - 16.04) <= 1.0);
  }
  CHECK(checked > 100);
  // Never pinned at the minimum rate for more than 30 s.
  Ns pinned_since = -1, longest = 0;
  for (const auto& t : job.ticks) {
    const bool at_floor = t.d.rate_bytes_per_s <= cfg.floor_rate_bytes_per_s * 1.05 || t.d.paused;
    if (at_floor && pinned_since < 0) pinned_since = t.t;
    if (!at_floor) pinned_since = -1;
    if (pinned_since >= 0) longest = std::max(longest, t.t - pinned_since);
  }
  MESSAGE("longest time at minimum " << static_cast<double>(longest) / kSec << " s");
  CHECK(longest < 30 * kSec);
  const double left = leftover(r, 60 * kSec, 90 * kSec, kCapacity);
  MESSAGE("copy after re-learning " << 100 * job.throughput(60 * kSec, 90 * kSec) / left << "% of leftover");
  CHECK(percentile(added_ms(*r.sim, 60 * kSec, 90 * kSec), 99) <= kT);
}

TEST_CASE("throttle.scenario.10_noise") {
  const auto r = run_scenario(10, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  double sum = 0, sum2 = 0;
  int n = 0, emergencies = 0;
  for (const auto& t : job.ticks) {
    if (t.d.emergency) ++emergencies;
    if (t.t < 10 * kSec) continue;  // after slow start
    const double w = static_cast<double>(t.d.window_bytes);
    sum += w;
    sum2 += w * w;
    ++n;
  }
  REQUIRE(n > 1000);
  const double mean = sum / n;
  const double sd = std::sqrt(std::max(0.0, sum2 / n - mean * mean));
  MESSAGE("window mean " << mean << " sd/mean " << sd / mean << ", emergencies " << emergencies
                         << ", copy " << job.throughput(0, 600 * kSec) / kMBps << " MB/s");
  CHECK(sd / mean <= 0.25);
  CHECK(emergencies <= 1);  // 600 s run = 10 min
}

TEST_CASE("throttle.scenario.11_jitter_lost_samples") {
  const auto r = run_scenario(11, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  REQUIRE(job.finished_at > 0);
  // No increase on a tick without fresh samples.
  for (std::size_t i = 1; i < job.ticks.size(); ++i) {
    if (job.ticks[i].samples_delivered) continue;
    INFO("tick at " << static_cast<double>(job.ticks[i].t) / kSec);
    CHECK(job.ticks[i].d.rate_bytes_per_s <= job.ticks[i - 1].d.rate_bytes_per_s);
    CHECK(job.ticks[i].d.window_bytes <= job.ticks[i - 1].d.window_bytes);
  }
  // Bounds of scenario 1.
  const auto lat = added_ms(*r.sim, 0, r.to);
  MESSAGE("added p99 " << percentile(lat, 99) << " ms, max " << max_of(lat) << " ms");
  CHECK(percentile(lat, 99) <= kT);
  CHECK(max_of(lat) <= 2 * kT);
  const double copy = job.throughput(0, job.finished_at);
  const double left = leftover(r, 0, job.finished_at, kCapacity);
  MESSAGE("copy " << 100 * copy / left << "% of leftover");
  CHECK(copy >= 0.8 * left);
}

TEST_CASE("throttle.scenario.12_cancel") {
  const auto r = run_scenario(12, kOurs);
  const auto& job = r.sim->job(r.jobs[0]);
  const Ns cancel = 10 * kSec;
  REQUIRE(job.drained_total > 0);
  const auto late = std::count_if(job.submits.begin(), job.submits.end(),
                                  [&](Ns s) { return s > cancel; });
  CHECK(late == 0);  // no new copy I/O after the cancel
  // What was in flight completes: bounded by the window (≤ T × drain) plus one chunk and the
  // base latency.
  const Ns chunk_time = static_cast<Ns>(1.0 * kMiBytes / kCapacity * kSec);
  MESSAGE("last copy completion " << static_cast<double>(job.last_completion - cancel) / kMs
                                  << " ms after cancel");
  CHECK(job.last_completion - cancel <= kBudget + chunk_time + StorageConfig{}.base_latency);
}

TEST_CASE("throttle.sim.host_visibility") {
  // A controller sees the guests of its own host only: with the guest on another host it never
  // gets a foreground sample (no foreground base), with the guest on its host it does.
  auto sees_guest = [](int guest_host) {
    auto sim = std::make_unique<Simulator>(StorageConfig{}, PageCacheConfig{}, 1);
    GuestConfig g;
    g.host = guest_host;
    sim->add_guest(g);
    JobConfig j = copy_job(kOurs, 1 * kGiB);
    j.host = 1;
    const int job = sim->add_job(j);
    sim->run(5 * kSec);
    const auto& ticks = sim->job(job).ticks;
    return std::any_of(ticks.begin(), ticks.end(),
                       [](const TickTrace& t) { return t.d.foreground_base.has_value(); });
  };
  CHECK(sees_guest(1));
  CHECK_FALSE(sees_guest(0));
}

namespace {

// The targets for several hosts: every guest p99 ≤ T and max ≤ 2T (whole run), the
// merges together ≥ 80 % of the leftover and Jain ≥ 0.9 between them (all merges running).
const Policy kProbeSynced{PolicyKind::Controller, 0, true, true};
const Policy kNoProbe{PolicyKind::Controller, 0, false, false};

void check_guests(const MultiHostSummary& s, double max_bound_ms) {
  for (const auto& g : s.guests) {
    INFO("guest on host " << g.host << (g.seen ? "" : " (seen by no controller)"));
    CHECK(g.p99_ms <= kT);
    CHECK(g.max_ms <= max_bound_ms);
  }
}

void check_merges(const MultiHostSummary& s) {
  CHECK(s.total_share_pct >= 80);
  if (s.share_pct.size() > 1) CHECK(s.jain >= 0.9);
  // The probes' load: at most 1 % of the capacity per host.
  CHECK(s.probe_load_pct <= 1.0 * static_cast<double>(s.share_pct.size()));
}

void report(const MultiHostRun& r, const MultiHostSummary& s) {
  MESSAGE(r.name << ": worst guest p99 " << s.worst_p99_ms << " ms, max " << s.worst_max_ms
                 << " ms; merges " << s.total_share_pct << "% of leftover, Jain " << s.jain
                 << ", probes " << s.probe_load_pct << "% of C");
}

}  // namespace

TEST_CASE("throttle.multi_host.guests_everywhere") {
  for (int n : kMultiHostCounts) {
    const auto r = run_multi_host(n, HostLayout::GuestsEverywhere, kProbeSynced);
    const auto s = summarize(r);
    report(r, s);
    INFO(r.name);
    REQUIRE(s.share_pct.size() == static_cast<std::size_t>(n));
    check_guests(s, 2 * kT);
    check_merges(s);
  }
}

TEST_CASE("throttle.multi_host.hidden_guests") {
  // The merging hosts' own guests are idle: only the probe shows the queue the other hosts'
  // guests wait in.  Without it (qcommitd before the probe) their p99 passes the budget.
  for (int n : kMultiHostCounts) {
    const auto r = run_multi_host(n, HostLayout::HiddenGuests, kProbeSynced);
    const auto s = summarize(r);
    report(r, s);
    INFO(r.name);
    check_guests(s, 2 * kT);
    check_merges(s);
    const auto before = summarize(run_multi_host(n, HostLayout::HiddenGuests, kNoProbe));
    MESSAGE("without probe: worst p99 " << before.worst_p99_ms << " ms, max " << before.worst_max_ms
                                        << " ms, Jain " << before.jain);
    CHECK(s.worst_p99_ms < before.worst_p99_ms);
  }
}

TEST_CASE("throttle.multi_host.capacity_drop") {
  // The storage falls to 40 % of its capacity for 10 s (another export of the server got busy).
  // Target missed: at the instant of the drop the queue the merges keep (≈ the budget at the old
  // capacity) takes budget / 0.4 = 50 ms to drain, so the max is ~2.5 T for every per-host
  // policy (single host, guest seen: scenario 3's max is 65 ms).  What holds is checked: p99,
  // the merges' share and fairness, and the max no worse than that queue.
  for (int n : kMultiHostCounts) {
    const auto r = run_multi_host(n, HostLayout::HiddenGuestsCapacityDrop, kProbeSynced);
    const auto s = summarize(r);
    report(r, s);
    INFO(r.name);
    check_guests(s, 1.05 * kT / kDropFraction);
    check_merges(s);
  }
}
