// SPDX-License-Identifier: GPL-2.0-or-later
// CopyGovernor for our own merges, driven by throttle::Controller.
// Signals: latency of our own writes (only without a working probe, see tick()), a probe (one 4 KiB O_DIRECT write + fdatasync per tick to a
// small file on the target's filesystem — it queues behind whatever we queued, like a guest's
// sync write would), and the bytes we have in flight. Actuators: the byte window (max in flight),
// the pacing rate, and the request size (preferred_request_bytes: a fraction of the window).
//
// Co-tenants (optional, ForegroundSource): the cumulative I/O counters of the running guests
// that share BASE's storage, sampled every cotenant_interval on a thread of the governor's own
// (a slow hypervisor delays the next sample, never the copy) and turned into latency samples and
// suspected stalls by throttle::IoCounterSampler; they join the probe's samples as foreground
// signals of the controller.
//
// Why write + fdatasync and not one O_DSYNC write: a guest's sync write reaches the host as a
// write followed by a flush (virtio-blk has no FUA; QEMU turns the flush into fdatasync), and on
// sync network storage (NFS, the lab's FUSE FIFO) both wait behind our queued bytes. A single
// O_DIRECT|O_DSYNC write there is one request (no separate flush/COMMIT), so it would see half
// of what the guest sees.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/defaults.h"
#include "common/unique_fd.h"
#include "engine/foreground.h"
#include "engine/merge.h"
#include "throttle/controller.h"
#include "throttle/pacer.h"

namespace qcommit::engine {

inline constexpr uint64_t kProbeBytes = 4096;
inline constexpr auto kProbeInterval = std::chrono::milliseconds(50);
inline constexpr double kInitialRateBytesPerS = 32.0 * 1024 * 1024;
inline constexpr double kAdditiveIncreaseBytesPerS2 = 256.0 * 1024 * 1024;
// Request size: the largest power of two ≤ window / kRequestsPerWindow (within the bounds).
// Two requests fit the window, so one is queued while the other is served, and a co-tenant
// waits behind at most a window. Smaller requests cost throughput where the storage serves our
// writes one at a time (FUSE serialises O_DIRECT writes that extend the file, as a growing
// qcow2 BASE's are): each request then pays a round trip with the storage idle (lab: ~0.4 ms,
// 15% at 128 KiB on 50 MB/s, 8% at 256 KiB).
inline constexpr uint64_t kRequestsPerWindow = 2;
inline constexpr uint64_t kMinRequestBytes = 64 * 1024;
inline constexpr auto kRequestSizeEpoch = std::chrono::seconds(5);  // request size: max window of 1-2 epochs
// Co-tenants' block stats: how often they are read (QEMU counts per request, libvirt answers in
// ~1 ms per disk); a sampled stall state older than kCotenantStateMaxAge is not used (the
// sampling thread is stuck in the hypervisor); the destructor waits at most kCotenantJoinTimeout
// for a sampling thread stuck there, then leaves it behind (it owns what it touches).
inline constexpr auto kCotenantInterval = std::chrono::milliseconds(100);
inline constexpr auto kCotenantStateMaxAge = std::chrono::seconds(1);
inline constexpr auto kCotenantJoinTimeout = std::chrono::seconds(1);

struct BudgetGovernorConfig {
  Duration budget = defaults::kBudget;
  std::string probe_dir;  // empty: no probe
  std::string trace_path;  // CSV, one row per controller tick (empty: none)
  // The merge's parameters, written as "# key=value" lines before the trace's CSV header (a
  // backslash, CR and LF in a value as \\, \r, \n); the governor adds start (UTC) and budget_ms.
  std::vector<std::pair<std::string, std::string>> trace_params;
  // Co-tenants' counters (null: none), read every cotenant_interval on the governor's own thread,
  // or, with cotenant_thread false, only when the owner calls sample_cotenants() (tests).
  std::shared_ptr<ForegroundSource> cotenants;
  Duration cotenant_interval = kCotenantInterval;
  bool cotenant_thread = true;
  throttle::ControllerConfig controller = default_controller();  // latency_budget from `budget`
  static throttle::ControllerConfig default_controller() {
    throttle::ControllerConfig c;
    c.initial_rate_bytes_per_s = kInitialRateBytesPerS;  // our I/O is large; start at a useful rate
    c.additive_increase_bytes_per_s2 = kAdditiveIncreaseBytesPerS2;
    return c;
  }
  [[nodiscard]] std::string validate() const;
};

// What the co-tenants contributed so far.
struct CotenantStats {
  uint64_t polls = 0;           // answers of the ForegroundSource
  size_t disks = 0;             // disks in the latest answer
  size_t max_disks = 0;
  uint64_t samples = 0;         // latency samples fed to the controller
  uint64_t stall_polls = 0;     // answers with a suspected stall
  Duration max_latency{};       // largest sample
};

class BudgetGovernor final : public CopyGovernor {
 public:
  explicit BudgetGovernor(BudgetGovernorConfig cfg);
  ~BudgetGovernor() override;

  Duration admit(Clock::time_point now, uint64_t bytes, uint64_t inflight) override;
  void completed(Clock::time_point now, uint64_t bytes, Duration latency) override;
  void tick(Clock::time_point now) override;
  [[nodiscard]] uint64_t preferred_request_bytes() override;
  // Starts the probe (its scratch file beside BASE): the merge has passed its checks.
  void begin(Clock::time_point now) override;

  [[nodiscard]] throttle::Decision last_decision();

  // The trace's last row, at the merge's end: the bytes completed and the samples taken since the
  // last controller tick, with its decision (no tick is run). Once; the destructor calls it too.
  void finish_trace(Clock::time_point now);

  // Reads the co-tenants' counters once, as at `now` (the sampling thread does this every
  // cotenant_interval).  No-op without cfg.cotenants.
  void sample_cotenants(Clock::time_point now);
  [[nodiscard]] CotenantStats cotenant_stats();
  // The 99th percentile of the foreground latencies (the probe's and the co-tenants', what the
  // guests see) since the previous call, and forgets them; nullopt without any.
  [[nodiscard]] std::optional<Duration> take_foreground_p99();

 private:
  struct Feed;
  void probe_loop();
  void open_trace();
  void trace_row(Clock::time_point now, const throttle::TickInput& in,
                 const std::vector<throttle::CopySample>& copy, const throttle::ForegroundSignals& cot);
  [[nodiscard]] uint64_t request_bytes_locked() const;
  throttle::TimePoint tp(Clock::time_point t) const;

  BudgetGovernorConfig cfg_;
  std::mutex mu_;
  throttle::Controller ctl_;
  throttle::Pacer pacer_;
  throttle::Decision decision_;
  Clock::time_point next_tick_{};
  Clock::time_point epoch_;
  std::chrono::system_clock::time_point wall_epoch_;  // epoch_ on the wall clock (trace's start)
  std::vector<throttle::Duration> fg_samples_;
  std::vector<throttle::Duration> recent_fg_;  // since take_foreground_p99, at most kRecentSamples
  std::vector<throttle::CopySample> copy_samples_;
  uint64_t inflight_ = 0;
  uint64_t drained_ = 0;
  uint64_t drained_total_ = 0;
  uint64_t window_max_cur_ = 0, window_max_prev_ = 0;  // for the request size
  Clock::time_point window_epoch_start_{};
  FILE* trace_ = nullptr;
  // probe
  UniqueFd probe_fd_;  // created by begin()
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> probe_started_ns_{0};  // 0 = no probe outstanding
  bool probe_samples_ok_ = false;  // (mu_) a probe write+fdatasync has succeeded
  std::thread probe_thread_;
  // co-tenants
  std::shared_ptr<Feed> feed_;
  std::thread feed_thread_;
};

}  // namespace qcommit::engine
