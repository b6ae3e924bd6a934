// SPDX-License-Identifier: GPL-2.0-or-later
// A small virtual world for governor tests: domain `dom` (disk vda on the pool "fast", target
// `base_path`) and vm2 (disk vdb on other storage) whose guests complete one write per 10 ms, a
// block job that copies at its set speed into the target's page cache, storage that drains the
// target's writeback pages.  Time advances in 1 ms steps (the pacer reacts within a few ms; a
// coarser world would hide or invent idle storage between its steps); the governor is stepped
// when it asks.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "plugin/govern/governor.h"
#include "tests/plugin/fake_hypervisor.h"

namespace qcommit::plugin::test {

inline constexpr const char* kBase = "/pool/vm1-base.qcow2";
inline constexpr const char* kTop = "/pool/vm1-top.qcow2";

struct World {
  FakeHypervisor hv;
  FakeTargetFiles files;
  std::shared_ptr<FakeFileState> base = std::make_shared<FakeFileState>();
  std::string dom;  // the domain whose disk vda runs the job
  TimePoint now{std::chrono::seconds(1000)};
  bool guest_active = true;  // dom/vda and vm2/vdb complete one write per 10 ms
  bool other_active = true;
  Duration guest_latency = std::chrono::milliseconds(2);
  // Bytes each of dom/vda's writes carries, reported in its stats (wr_bytes); 0: not reported.
  std::uint64_t guest_write_bytes = 0;
  // The world times the target's writeback busy periods (TargetFile::take_service_samples).
  bool time_writeback = false;
  Duration busy_time{};
  std::uint64_t busy_bytes = 0;
  double storage_bytes_per_s = 200.0 * 1024 * 1024;  // writeback drain
  double job_max_bytes_per_s = 0;  // > 0: the job copies no faster, whatever its speed
  // The guest dirties its disk at this rate: a mirror's work grows by it (QEMU's end moves).
  double guest_dirty_bytes_per_s = 0;
  double dirty_credit = 0;
  static constexpr std::uint64_t kJobChunkBytes = 64 * 1024;
  static constexpr Duration kStep = std::chrono::milliseconds(1);
  static constexpr Duration kGuestWriteEvery = std::chrono::milliseconds(10);
  double job_credit = 0;  // bytes the job may copy, not yet a whole chunk
  Duration guest_clock{};  // time since the guests' last completed write

  explicit World(std::string dom_name = "vm1", const std::string& base_path = kBase)
      : dom(std::move(dom_name)) {
    files.files[base_path] = base;
    DomainInfo vm1{dom, "11111111-1111-1111-1111-111111111111", {}, std::nullopt};
    vm1.disks.push_back(DiskInfo{"vda", kTop, {base_path}, std::nullopt, 7, "", ""});
    DomainInfo vm2{"vm2", "22222222-2222-2222-2222-222222222222", {}, std::nullopt};
    vm2.disks.push_back(DiskInfo{"vdb", "/other/vm2.qcow2", {}, std::nullopt, 9, "", ""});
    hv.domains = {vm1, vm2};
    hv.pool_list = {PoolInfo{"fast", "aaaaaaaa-0000-0000-0000-000000000001", "/pool"}};
    hv.stats[{dom, "vda"}] = {};
    hv.stats[{"vm2", "vdb"}] = {};
  }
  void start_job(JobType t = JobType::ActiveCommit, std::uint64_t end = 8ull << 30) {
    hv.jobs[{dom, "vda"}] = JobInfo{t, 0, end, 0};
  }
  // Advances the world by `dt` in kStep steps, stepping the governor when it asks; `after_step`
  // (if any) runs after every governor step.
  void run(Governor& g, Duration dt, TimePoint* next = nullptr,
           const std::function<void()>& after_step = {}) {
    TimePoint local_next = now;
    TimePoint& nx = next ? *next : local_next;
    const TimePoint until = now + dt;
    while (now < until) {
      if (now >= nx) {
        nx = g.step(now);
        if (after_step) after_step();
      }
      now += kStep;
      simulate(kStep);
    }
  }
  void simulate(Duration dt) {
    const double secs = std::chrono::duration<double>(dt).count();
    guest_clock += dt;
    const bool guest_write = guest_clock >= kGuestWriteEvery;
    if (guest_write) guest_clock -= kGuestWriteEvery;
    if (guest_active && guest_write) {
      auto& s = hv.stats[{dom, "vda"}];
      s.wr_reqs += 1;
      s.wr_total_times_ns += guest_latency.count();
      if (guest_write_bytes > 0)
        s.wr_bytes = std::max<std::int64_t>(s.wr_bytes, 0) + static_cast<std::int64_t>(guest_write_bytes);
    }
    if (other_active && guest_write) {
      auto& s = hv.stats[{"vm2", "vdb"}];
      s.wr_reqs += 1;
      s.wr_total_times_ns += 1000000;
    }
    auto it = hv.jobs.find({dom, "vda"});
    if (it != hv.jobs.end() && guest_dirty_bytes_per_s > 0) {
      dirty_credit += guest_dirty_bytes_per_s * secs;
      const auto added = static_cast<std::uint64_t>(dirty_credit);
      dirty_credit -= static_cast<double>(added);
      it->second.end += added;
    }
    if (it != hv.jobs.end() && it->second.bandwidth_bytes_per_s > 0) {
      // Like QEMU, the job copies whole chunks (kJobChunkBytes) and sleeps in between.
      double bw = static_cast<double>(it->second.bandwidth_bytes_per_s);
      if (job_max_bytes_per_s > 0) bw = std::min(bw, job_max_bytes_per_s);
      job_credit += bw * secs;
      const auto chunks = static_cast<std::uint64_t>(job_credit / static_cast<double>(kJobChunkBytes));
      job_credit -= static_cast<double>(chunks * kJobChunkBytes);
      const auto n = std::min<std::uint64_t>(it->second.end - it->second.cur, chunks * kJobChunkBytes);
      it->second.cur += n;
      base->dirty += n;
    }
    const std::uint64_t before = base->writeback;
    base->drain(static_cast<std::uint64_t>(storage_bytes_per_s * secs));
    if (time_writeback) time_busy_period(dt, before);
  }
  // A busy period runs while the target has writeback at storage; it is timed once it empties or
  // after 20 ms (as completion_clock.h's ServiceMeter does, exactly: the world knows what drained).
  void time_busy_period(Duration dt, std::uint64_t before) {
    if (before == 0) return;
    busy_time += dt;
    busy_bytes += before - base->writeback;
    if (base->writeback > 0 && busy_time < std::chrono::milliseconds(20)) return;
    base->service.push_back({busy_time, busy_bytes});
    busy_time = Duration::zero();
    busy_bytes = 0;
  }
  [[nodiscard]] std::uint64_t cur() const { return hv.jobs.at({dom, "vda"}).cur; }
  // Job progress (bytes/s) over the next `dt`.
  double progress(Governor& g, Duration dt, TimePoint& next) {
    const std::uint64_t c0 = cur();
    run(g, dt, &next);
    return static_cast<double>(cur() - c0) / std::chrono::duration<double>(dt).count();
  }
  [[nodiscard]] bool speed_ever_zero() const {
    return std::any_of(hv.speed_calls.begin(), hv.speed_calls.end(),
                       [](const SpeedCall& c) { return c.speed == 0; });
  }
};

// A Governor over a World, stepped in the world's virtual time (`next`: when it asked to be
// stepped again).
struct Governed {
  World& w;
  Governor g;
  TimePoint next;
  explicit Governed(World& world, DaemonConfig cfg = {}, GovernorOptions opt = {})
      : w(world), g(world.hv, world.files, std::move(cfg), opt), next(world.now) {}
  void run(Duration dt, const std::function<void()>& after_step = {}) {
    w.run(g, dt, &next, after_step);
  }
  double progress(Duration dt) { return w.progress(g, dt, next); }
};

}  // namespace qcommit::plugin::test
