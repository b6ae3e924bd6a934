// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit live`: a governed merge that qcommit starts itself on a running domain.  The governor
// (plugin/governor.h) paces the job exactly as qcommitd would; this file decides which block jobs
// to start, in which order, and when to pivot.  No libvirt types: block-job control goes through
// BlockJobControl (implemented by LibvirtHypervisor), `now` is a parameter.
//
// Strategies for an active commit (TOP is the disk's active layer):
//  * direct:    one active commit TOP → BASE (QEMU's mirror engine: 16 × 1 MiB requests in
//               flight, the target flushed at the ready transition), then pivot;
//  * two-phase: a fresh external overlay NEW on top of TOP (disk-only, no metadata), then a
//               non-active commit TOP → BASE (QEMU's commit.c: one 512 KiB request at a time,
//               finely governable, no flush), then an active commit of the small NEW → BASE with
//               pivot; NEW is deleted after the pivot (we created it).
// A non-active commit (TOP below the active layer) is one commit job with either strategy.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "plugin/govern/governor.h"
#include "plugin/hypervisor/block_job_control.h"
#include "plugin/hypervisor/hypervisor.h"

namespace qcommit::plugin {

// Block-job actions on a running domain.  Failures throw BlockJobError with the hypervisor's
// message; a lost connection throws HypervisorDisconnected.
enum class LiveStrategy { Direct, TwoPhase };
[[nodiscard]] const char* to_string(LiveStrategy s);
inline constexpr LiveStrategy kDefaultLiveStrategy = LiveStrategy::TwoPhase;
inline constexpr auto kPivotRetry = std::chrono::milliseconds(100);
inline constexpr auto kPivotGateRecheck = std::chrono::milliseconds(5);

struct LiveRequest {
  std::string domain;
  std::string disk;
  std::string top;   // empty: the disk's active layer
  std::string base;  // empty: the bottom of the chain
  bool pivot = false;
  LiveStrategy strategy = kDefaultLiveStrategy;
  std::uint64_t initial_speed_bytes_per_s = 4u << 20;  // speed the jobs start with
};

struct LiveStep {
  enum class Kind { CreateOverlay, Commit, ActiveCommit, Pivot, RemoveOverlay } kind;
  std::string top, base;  // Commit / ActiveCommit; CreateOverlay/RemoveOverlay: top = the file
  [[nodiscard]] std::string describe() const;
};

// The steps for a request on a disk (throws BlockJobError when TOP/BASE are not in the chain).
[[nodiscard]] std::vector<LiveStep> plan_live(const LiveRequest& req, const DiskInfo& disk,
                                              const std::string& fresh_overlay_path);
// "<dir of TOP, or overlay_dir>/<TOP stem>.qcommit-<stamp>.qcow2"
[[nodiscard]] std::string fresh_overlay_path(const std::string& top, const std::string& stamp,
                                             const std::string& overlay_dir = "");

// Before `qcommit live` plans, a block job on the disk that it did not start (a backup's copy,
// an operator's commit, a job a previous run left at its finishing speed) is waited out for at
// most `limit`: the chain that job leaves is the one to plan on.  Polled with `now`.
class ForeignJobWait {
 public:
  enum class State { kClear, kWaiting, kTimedOut };
  inline static constexpr auto kRecheck = std::chrono::milliseconds(100);

  ForeignJobWait(Hypervisor& hv, std::string domain, std::string disk, Duration limit);
  [[nodiscard]] State poll(TimePoint now);
  // The job seen by the last poll that found one.
  [[nodiscard]] const std::optional<JobInfo>& job() const { return job_; }
  // "the commit block job on vm1 vda (42% done)"
  [[nodiscard]] std::string describe_job() const;

 private:
  Hypervisor& hv_;
  std::string domain_, disk_;
  Duration limit_;
  std::optional<TimePoint> since_;
  std::optional<JobInfo> job_;
};

class LiveMerge {
 public:
  LiveMerge(BlockJobControl& ctl, Hypervisor& hv, std::vector<LiveStep> steps, LiveRequest req);

  // Runs what is due; returns false when finished (done() or failed()).
  [[nodiscard]] bool step(TimePoint now);
  [[nodiscard]] bool done() const { return index_ >= steps_.size(); }
  [[nodiscard]] const std::optional<std::string>& error() const { return error_; }
  [[nodiscard]] std::size_t current() const { return index_; }
  [[nodiscard]] const std::vector<LiveStep>& steps() const { return steps_; }
  // Active commit reached ready and no pivot was requested: the job is left ready.
  [[nodiscard]] bool left_ready() const { return left_ready_; }
  // Asked before the pivot until it says true (the pacing settling the target first: QEMU
  // flushes it at the switch while the guest waits); none: pivot at once.
  using PivotGate = std::function<bool(TimePoint)>;
  void set_pivot_gate(PivotGate gate) { pivot_gate_ = std::move(gate); }
  [[nodiscard]] std::optional<JobInfo> last_info() const { return last_info_; }

 private:
  [[nodiscard]] bool chain_contains(const std::string& path);
  void finish_step(TimePoint now);

  BlockJobControl& ctl_;
  Hypervisor& hv_;
  std::vector<LiveStep> steps_;
  LiveRequest req_;
  std::size_t index_ = 0;
  bool started_ = false;
  bool left_ready_ = false;
  std::optional<TimePoint> next_try_;
  std::optional<JobInfo> last_info_;
  std::optional<std::string> error_;
  PivotGate pivot_gate_;
};

}  // namespace qcommit::plugin
