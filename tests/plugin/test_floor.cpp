// SPDX-License-Identifier: GPL-2.0-or-later
// A floor-limited job: QEMU's mirror at cache=none into a raw base on QEMU 10 (no throttle filter
// can go under it), on storage where one of its 1 MiB requests takes longer than the budget.
#include <doctest/doctest.h>

#include <chrono>
#include <string>

#include "tests/plugin/world.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

constexpr double kStorageBytesPerS = 50.0 * 1024 * 1024;
constexpr Duration kGuestBase = 2ms;
// One 1 MiB request at 50 MiB/s: what a guest's request waits behind one of the job's.
constexpr Duration kRequestFloor = 20ms;
// Below this speed the job's requests are rare enough that the guests' writes rarely meet one.
constexpr std::uint64_t kRareRequestsBytesPerS = 2 * 1024 * 1024;

// Runs the world for `dt` with the guests' latency at the floor whenever the job copies, the
// job's writes past the page cache (cache=none); `each_ms` after every millisecond.
void run_at_the_floor(Governed& gv, Duration dt, const std::function<void()>& each_ms) {
  World& w = gv.w;
  const TimePoint until = w.now + dt;
  while (w.now < until) {
    if (w.now >= gv.next) gv.next = gv.g.step(w.now);
    const std::uint64_t speed = w.hv.speed(w.dom, "vda");
    w.guest_latency = speed >= kRareRequestsBytesPerS ? kGuestBase + kRequestFloor : kGuestBase;
    w.now += World::kStep;
    w.simulate(World::kStep);
    w.base->dirty = 0;  // cache=none: nothing of the job's stays in the page cache
    each_ms();
  }
}

}  // namespace

TEST_CASE("plugin.governor.floor_limited_mirror_keeps_its_share") {
  // A 20 ms budget is 10 ms per storage request; one of the mirror's 1 MiB requests takes 20 ms
  // at 50 MiB/s, so every guest write meets one at any speed above a trickle.  Cutting the speed
  // for it made the job crawl (lab, QEMU 10.0, raw base: 12.8 MiB/s, 3.65x its ungoverned time).
  // Floor-limited, the job keeps at least 70 % of the storage, and status names the floor.
  World w("vm1", "/pool/vm1-base.raw");
  w.hv.domains[0].disks[0].cache = "none";
  w.hv.domains[0].disks[0].format_options_known = false;  // no node to put a filter under
  w.hv.version = 10000013;                                // QEMU 10.0.13, Debian 13's
  w.job_max_bytes_per_s = kStorageBytesPerS;
  w.start_job(JobType::ActiveCommit, 64ull << 30);
  Governed gv(w);
  run_at_the_floor(gv, 10s, [] {});  // the storage's rate measured
  const std::uint64_t cur0 = w.cur();
  std::uint64_t ms = 0, at_share = 0;
  const double share = qcommit::throttle::kFloorLimitedDrainShare * kStorageBytesPerS * 0.98;
  run_at_the_floor(gv, 50s, [&] {
    ++ms;
    at_share += static_cast<double>(w.hv.speed("vm1", "vda")) >= share;
  });
  const double progress = static_cast<double>(w.cur() - cur0) / 50.0;
  const JobStatus js = gv.g.status(w.now).jobs.at(0);
  MESSAGE("progress " << progress / (1 << 20) << " MiB/s, speed at the share "
                      << 100.0 * static_cast<double>(at_share) / static_cast<double>(ms)
                      << " % of the time; floor: " << js.floor);
  CHECK(progress >= 0.95 * qcommit::throttle::kFloorLimitedDrainShare * kStorageBytesPerS);
  CHECK(static_cast<double>(at_share) >= 0.95 * static_cast<double>(ms));  // slowdowns aside
  CHECK(js.floor.rfind("QEMU mirror: 1 MiB requests (16 in flight) at cache=none: 2", 0) == 0);
  CHECK(js.floor.find("above the budget's 10 ms per request; runs at >= 70 % of the storage") !=
        std::string::npos);
  CHECK(js.floor.find("`qcommit live` would do better for this disk") != std::string::npos);
}
