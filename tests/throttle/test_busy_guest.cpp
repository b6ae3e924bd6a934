// SPDX-License-Identifier: GPL-2.0-or-later
// A busy guest: besides a 4 KiB write+fsync probe, a database-like writer whose 1 MiB
// write+fsync requests (8 MiB/s, about 17 % of 50 MB/s storage) queue behind each other and take
// ~21 ms each at the storage whatever the copy does.  The daemon's controller sees every guest
// request's latency (as per-operation block stats), so the writer's own service and queueing
// look like delay.  Told its own queue and the guests' largest requests (TickInput::
// own_queue_bytes, foreground_own_bytes), the controller charges the copy what its own queue
// can explain: the copy gets what the guests leave, and the probe still gains no more than the
// budget.  (Several hosts' copies, which the guests' requests do not explain: test_scenarios.)
#include <doctest/doctest.h>

#include "tests/throttle/scenarios.h"

using namespace qcommit::throttle;
using namespace qcommit::throttle::sim;

namespace {

constexpr double kBusyCapacity = 50 * kMBps;
constexpr double kWriterRate = 8.0 * kMiBytes;  // bytes/s
constexpr Ns kRun = 60 * kSec;

struct BusyRun {
  std::unique_ptr<Simulator> sim;
  int job = 0;
  int probe = 0;
};

// The daemon's view of a QEMU job: no copy latencies, its progress and backlog only (and, with
// own_queue_visible, its own queue).
struct BusyOptions {
  bool own_queue_visible = true;
  bool copy = true;       // false: the guests run alone (the baseline)
  bool writer = true;     // false: the probe alone (an idle guest)
  bool buffered = false;  // the copy writes through the host's page cache (QEMU cache=writeback)
};

BusyRun run_busy(const BusyOptions& o) {
  StorageConfig storage;
  storage.bandwidth = kBusyCapacity;
  PageCacheConfig cache;
  cache.enabled = o.buffered;
  BusyRun r{std::make_unique<Simulator>(storage, cache, 7), 0, 0};
  GuestConfig probe;
  probe.kind = GuestKind::SyncPeriodic;
  probe.io_bytes = 4 * kKiB;
  probe.interval = 100 * kMs;
  r.probe = r.sim->add_guest(probe);
  GuestConfig writer;
  writer.kind = GuestKind::OpenLoop;
  writer.io_bytes = 1 * kMiBytes;
  writer.rate = kWriterRate;
  if (o.writer) r.sim->add_guest(writer);
  JobConfig j = copy_job(Policy{}, 4 * kGiB);
  j.controller.latency_budget = request_budget(Duration(kBudget));
  j.copy_latency_visible = false;
  j.own_queue_visible = o.own_queue_visible;
  j.buffered = o.buffered;
  if (o.copy) r.job = r.sim->add_job(j);
  r.sim->run(kRun);
  return r;
}

// The probe guest's added latency (ms) over [a, b).
std::vector<double> probe_added_ms(const Simulator& s, int probe, Ns a, Ns b) {
  std::vector<double> out;
  for (const auto& g : s.guest_samples())
    if (g.guest == probe && g.submit >= a && g.submit < b)
      out.push_back(static_cast<double>(g.added) / kMs);
  return out;
}

// The copy's share of what the guests leave, and the probe's p99 and max over the same guests
// alone, checked against the bounds the busy-guest cases share.
void check_busy(const BusyOptions& o) {
  BusyOptions base_options = o;
  base_options.copy = false;
  const BusyRun alone = run_busy(base_options);
  const BusyRun r = run_busy(o);
  const Ns from = 10 * kSec;
  const double copy = r.sim->job(r.job).throughput(from, kRun);
  const double left = kBusyCapacity - r.sim->guest_throughput(from, kRun);
  // The probe's latency over what it would be on the storage alone: its own service and the
  // writer's requests ahead of it count in both.
  const auto base = probe_added_ms(*alone.sim, alone.probe, from, kRun);
  const auto probe = probe_added_ms(*r.sim, r.probe, from, kRun);
  REQUIRE(probe.size() > 100);
  REQUIRE(base.size() > 100);
  const double request_budget_ms = static_cast<double>(request_budget(Duration(kBudget)).count()) / kMs;
  MESSAGE("copy " << copy / kMBps << " MB/s of " << left / kMBps << " MB/s left ("
                  << 100 * copy / left << " %); probe p99 " << percentile(probe, 99) << " ms (alone "
                  << percentile(base, 99) << "), max " << percentile(probe, 100) << " ms (alone "
                  << percentile(base, 100) << ")");
  // Work conservation: at least 80 % of what the guests leave.
  CHECK(copy >= 0.8 * left);
  // What the copy adds to a storage request of the probe (its write+fsync is one request here)
  // stays within the per-request budget at p99, and within twice it at the max.
  CHECK(percentile(probe, 99) <= percentile(base, 99) + request_budget_ms);
  CHECK(percentile(probe, 100) <= percentile(base, 100) + 2 * request_budget_ms);
  // The guests keep their rate.
  CHECK(r.sim->guest_throughput(from, kRun) >= 0.95 * alone.sim->guest_throughput(from, kRun));
}

}  // namespace

TEST_CASE("throttle.busy_guest.copy_gets_what_the_guests_leave") { check_busy({}); }

TEST_CASE("throttle.busy_guest.through_the_page_cache") {
  // QEMU at cache=writeback: the copy's bytes are pages under writeback at storage.
  check_busy({.buffered = true});
}

TEST_CASE("throttle.busy_guest.idle_guest_keeps_its_budget") {
  // Only the probe: the own-queue bound must not let the copy past the budget where the measured
  // delay is the copy's doing.
  check_busy({.writer = false});
}

TEST_CASE("throttle.busy_guest.every_delay_charged_starves_the_copy") {
  // The same guests, the controller not told its own queue: it charges the writer's own queueing
  // to the copy and holds it near its floor -- the behaviour the own-queue bound exists to end.
  const BusyRun charged = run_busy({.own_queue_visible = false});
  const BusyRun bounded = run_busy({});
  const Ns from = 10 * kSec;
  const double starved = charged.sim->job(charged.job).throughput(from, kRun);
  const double fair = bounded.sim->job(bounded.job).throughput(from, kRun);
  MESSAGE("copy, every delay charged: " << starved / kMBps << " MB/s; own queue bounded: "
                                         << fair / kMBps << " MB/s");
  CHECK(starved <= 0.1 * (kBusyCapacity - charged.sim->guest_throughput(from, kRun)));
  CHECK(fair >= 2 * starved);
}
