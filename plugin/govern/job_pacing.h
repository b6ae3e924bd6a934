// SPDX-License-Identifier: GPL-2.0-or-later
// The pacing of one governed job as pure steps: the job's readings and `now` come in, decisions
// go out.  No hypervisor, no files, no clock of its own: the Governor reads the job and its
// target, and applies what comes out.  Per tick:
//   measure()  how much of the target is queued at storage (the backlog, at most the job's own
//              share where the reading is host-wide), how much of the job's progress the
//              controller is told drained (QEMU reports progress in bursts), and the job's own
//              bytes at storage (throttle::TickInput::own_queue_bytes);
//   decide()   the controller's decision; while the job is held for a settle the last one stands;
//   speed()    the speed QEMU's job gets from that decision: the floor while it is held, one
//              window per tick near the end of a non-active commit, a sprint for a mirror
//              about to converge (sprint_speed), never below the converge floor of a mirror that
//              does not converge (below);
//   writeback_window()  how much of the target the writeback pacer keeps at storage;
//   record()   the job as of this tick, for the next.
// tests/plugin/test_job_pacing.cpp drives it with a manual clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "plugin/govern/writeback.h"
#include "plugin/hypervisor/hypervisor.h"
#include "throttle/controller.h"

namespace qcommit::plugin {

using throttle::Duration;
using throttle::TimePoint;

inline constexpr std::uint64_t kMinJobSpeedBytesPerS = 64 * 1024;  // "paused": never 0
// Dirty (not yet under writeback) target pages tolerated before the job is held at the minimum:
// one burst of QEMU's mirror (16 requests x 1 MiB).  The pacer meters them out within the window.
inline constexpr std::uint64_t kDirtyAllowanceBytes = 16ull * 1024 * 1024;
// Job progress is released to the controller at up to this × the paced rate per tick, carrying
// at most kMaxDrainCredit worth of progress at that rate (JobPacing::measure).
inline constexpr double kDrainCreditRateFactor = 2.0;
inline constexpr Duration kMaxDrainCredit = std::chrono::seconds(2);
// A mirror with at most this much left (and not paused) sprints to ready (JobPacing::speed): at
// the ceiling where the guests add nothing to it, else at kSprintAddedFactor x the rate they add
// (at least kMinSprintBytesPerS).
inline constexpr std::uint64_t kMirrorConvergeBytes = 1024 * 1024;
inline constexpr double kSprintAddedFactor = 3.0;
// ... and never below this (at most the ceiling): a tick of it is 3.2 MiB, 64 ms at 50 MB/s.
inline constexpr double kMinSprintBytesPerS = 32.0 * 1024 * 1024;
// The least speed of a non-active commit near the end of its data (when the controller allows
// that much): 0.8 MiB per 100 ms tick, about 17 ms of 50 MB/s storage left dirty for QEMU's
// completion flush; the last 16 MiB in at most 2 s (JobPacing::speed).
inline constexpr std::uint64_t kFinishingSpeedBytesPerS = 8ull * 1024 * 1024;

// The pacer keeps this fraction of the controller's window under writeback for a mirror (active
// commit, copy).  The controller's window is a hard cap, and the pacer keeps writeback topped up
// to what it is given all the time, so a guest request nearly always finds that much ahead of
// it.  Lab, `virsh blockcommit --active` under qcommitd, writeback, 1.5 GiB: 1.0 -> p99
// 29.2-30.9 ms, 45.5-47.0 s; 0.8 -> 22.5-24.1 ms, 50.4-50.5 s; 0.5 -> 16.5 ms, 61.5 s.
// A non-active commit (qcommit live's first phase) keeps the whole window: at 0.8 it took 63.2 s
// instead of 49.3 s for p99 25.3 instead of 27.4 ms (why it is the more sensitive: not found).
inline constexpr double kMirrorPacerWindowFraction = 0.8;
// A mirror (an active commit, a copy) converges when its bytes left shrink: the guests add to
// them what they write to the disk, the copy takes off what it copies.  Where the guests write
// faster than the budget lets the copy go, it never becomes ready and never ends.  Bytes left
// that have not shrunk over the last window (kConvergeWindow, longer for a slow mirror: two of its
// bursts, at most kMaxConvergeWindow) while the guests add to them say it does not converge; once
// that has lasted
// kNotConvergingAfter, the way out is a converge floor: the job's speed stays at or above
// kConvergeFloorFactor x the rate the guests add (at least the policy's floor, at most its
// ceiling) until it is ready, above what the budget allows where need be.  Status and the log say
// so from the moment it stops converging.  The final phase this shortens is the one in which the
// guests' writes are mirrored: what the budget gives up is bounded by those writes' own rate.
inline constexpr Duration kConvergeWindow = std::chrono::seconds(10);
inline constexpr Duration kMaxConvergeWindow = std::chrono::seconds(120);
inline constexpr Duration kNotConvergingAfter = std::chrono::seconds(60);
inline constexpr double kConvergeFloorFactor = 2.0;

// QEMU's mirror job (active commit, copy): 16 x 1 MiB bursts, ready when it has caught up.
[[nodiscard]] bool mirror_job(JobType t);

// Without cachestat(2): the shortest gap between two fdatasyncs of a job's target (each is a
// thread and, on local disks, may flush the disk's cache).
inline constexpr Duration kFallbackSyncGap = std::chrono::milliseconds(20);

// Without per-file page-cache counts (no cachestat): fdatasyncs of the target while the job
// copies (TargetPacer::pace starts them); the job's progress at the last tick and whether it moved
// in it, the progress (as of the last tick) when the running sync started and when the last
// completed one did.
struct FallbackSync {
  std::optional<std::uint64_t> tick_cur;
  bool tick_progressed = false;
  std::optional<std::uint64_t> sync_start_cur;
  std::optional<std::uint64_t> synced_cur;
  std::optional<TimePoint> sync_started_at;
  // Progress counts start over (a new job, a reconnect); the sync gap still runs.
  void restart() {
    tick_cur.reset();
    tick_progressed = false;
    sync_start_cur.reset();
    synced_cur.reset();
  }
};

// What the pacing knows of its job, fixed when the job is adopted.
struct PacedJob {
  JobType type = JobType::Unknown;
  bool direct_io = false;  // cache=none/directsync: its writes bypass the page cache
  std::uint64_t min_speed_bytes_per_s = kMinJobSpeedBytesPerS;
  double ceiling_bytes_per_s = 0;
  Duration tick = std::chrono::milliseconds(100);  // GovernorOptions::tick
  Duration pace = std::chrono::milliseconds(2);    // GovernorOptions::pace
  // A non-active commit: the guest ranges it copies (ascending), where the host can read them.
  // QEMU skips the rest without writing.
  std::optional<std::vector<ByteRange>> commit_extents;
};

// One tick's readings of the job.
struct PacingReading {
  TimePoint now{};
  JobInfo info;                      // QEMU's progress
  std::optional<PageCacheState> pc;  // the target's page cache; nullopt: no target file
  std::uint64_t speed_set = 0;       // the speed QEMU was read back to have
  bool ready = false;                // a mirror that has caught up
};

// A mirror's convergence, as of the last measure().
struct Convergence {
  bool known = false;             // a whole window of progress seen (else nothing is said)
  bool converging = true;         // its bytes left shrank over the last window (above)
  double added_bytes_per_s = 0;   // what the guests added to them over it (QEMU's end moving)
  double copied_bytes_per_s = 0;  // what the copy took off (QEMU's progress)
  std::optional<TimePoint> stalled_since;  // not converging since
  double floor_bytes_per_s = 0;            // > 0: the converge floor is on
};

// What measure() found.
struct PacingMeasure {
  // At most this much of a host-wide reading is the job's (the maximum: no bound).
  std::uint64_t own_bound = 0;
  std::uint64_t backlog = 0;  // queued at storage or about to be (throttle::TickInput)
  std::uint64_t drained = 0;  // progress released to the controller this tick
  // The job's own bytes at storage; nullopt where the reading cannot tell them.
  std::optional<std::uint64_t> own_queue;
};

struct JobSpeed {
  std::uint64_t speed = 0;
  bool held = false;  // at the floor: paused, over its window or settling
};

class JobPacing {
 public:
  JobPacing(PacedJob job, const throttle::ControllerConfig& c);

  [[nodiscard]] PacingMeasure measure(const PacingReading& r);
  // `in` carries measure()'s figures and the foreground signals.  Held (a settle): the last
  // decision stands and the controller's next interval starts at in.now.
  [[nodiscard]] throttle::Decision decide(const throttle::TickInput& in, bool holding);
  [[nodiscard]] JobSpeed speed(const PacingReading& r, const PacingMeasure& m,
                               const throttle::Decision& d, bool holding) const;
  // What the writeback pacer may keep under writeback after decision `d`: its window (a
  // mirror's kMirrorPacerWindowFraction of it), and under a converge floor at least what
  // carries the floor's rate through the delay measured at storage (Little's law), so that
  // what the floor copies reaches storage instead of piling up dirty for the pivot's flush.
  [[nodiscard]] std::uint64_t writeback_window(const throttle::Decision& d) const;
  // The job as of this tick: its progress, and the backlog the next tick's drain is taken from.
  void record(const JobInfo& info, std::uint64_t backlog);
  // The progress baseline starts over (the connection was lost: it may be another job when the
  // governor is back).  A mirror's convergence stays (measure() starts it over for another job).
  void restart();
  // A new controller (another request size: a throttle filter went in).
  void reconfigure(const throttle::ControllerConfig& c);

  [[nodiscard]] const throttle::ControllerConfig& config() const { return ctl_.config(); }
  [[nodiscard]] const std::optional<throttle::Decision>& decision() const { return decision_; }
  [[nodiscard]] std::uint64_t backlog() const { return backlog_; }
  [[nodiscard]] FallbackSync& fallback() { return fallback_; }
  [[nodiscard]] const Convergence& convergence() const { return convergence_; }

  // Bytes of the target queued at storage or about to be: under writeback, plus dirty pages
  // beyond `dirty_allowance`; at most `own_bound`.
  [[nodiscard]] static std::uint64_t queued_bytes(const std::optional<PageCacheState>& pc,
                                                  std::uint64_t dirty_allowance,
                                                  std::uint64_t own_bound);

 private:
  [[nodiscard]] std::uint64_t own_backlog_bound(const PacingReading& r);
  [[nodiscard]] std::optional<std::uint64_t> own_queue_bytes(
      const std::optional<PageCacheState>& pc) const;
  [[nodiscard]] std::uint64_t release_drain(const PacingReading& r, std::uint64_t backlog);
  [[nodiscard]] std::uint64_t bytes_left(const JobInfo& info) const;
  [[nodiscard]] std::uint64_t sprint_speed() const;
  void follow_convergence(const PacingReading& r);
  struct ProgressSample {
    TimePoint at;
    std::uint64_t cur = 0;
    std::uint64_t end = 0;
  };

  PacedJob job_;
  throttle::Controller ctl_;
  std::optional<throttle::Decision> decision_;
  std::optional<std::uint64_t> last_cur_;  // progress at the last record()
  std::uint64_t backlog_ = 0;              // backlog at the last record()
  double drain_credit_ = 0;                // bytes of progress not yet released
  std::optional<TimePoint> last_tick_;
  FallbackSync fallback_;
  std::deque<ProgressSample> progress_;  // a mirror's, over the last kMaxConvergeWindow
  Convergence convergence_;
};

}  // namespace qcommit::plugin
