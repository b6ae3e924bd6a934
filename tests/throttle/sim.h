// SPDX-License-Identifier: GPL-2.0-or-later
// Deterministic discrete-event storage simulator for the throttle controller.
//
// Virtual time in integer nanoseconds, one seeded RNG, no threads, no clock reads.
//  * Storage: one FIFO server.  A request occupies the server for bytes × noise / rate, then
//    completes after the base latency (propagation; it does not block the FIFO).  rate =
//    bandwidth × depth factor (optional: fewer queued requests ⇒ lower throughput); capacity
//    changes and full stalls (rate 0) are scheduled events; noise is lognormal with mean 1.
//  * Host page cache (optional): buffered copy writes become dirty pages (memcpy speed, blocked
//    at the dirty limit); writeback moves dirty pages into the FIFO in writeback_io pieces,
//    keeping at most writeback_inflight_max bytes queued — when dirty > background threshold,
//    or when the writer asked for it (sync_file_range).
//  * Guests: synchronous periodic write+fsync (the next op waits for the previous), open-loop
//    constant-rate writes, periodic bursts.  Guest requests go straight to the FIFO (their
//    flush waits behind everything queued).  A write+fsync is modelled as one FIFO request.
//  * Copy jobs: each with its own policy (our Controller + Pacer, or a fixed-rate limiter with
//    a QEMU-mirror-like in-flight cap, or unlimited), its own tick loop with optional jitter
//    and lost samples, start time, cancel time.
//  * Hosts: every guest and job belongs to a host (default 0).  A job's controller sees only the
//    guests of its own host (their samples, outstanding requests and idleness), and its own
//    shared-queue probe when it has one: a synchronous 4 KiB write + flush of the job's host on
//    the same FIFO (one request, as a guest's write+fsync), scheduled by throttle::ProbeSchedule.
//    Its own clock may be offset (hosts' monotonic clocks are not aligned).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "throttle/controller.h"
#include "throttle/pacer.h"
#include "throttle/probe.h"

namespace qcommit::throttle::sim {

using Ns = std::int64_t;
inline constexpr Ns kUs = 1'000;
inline constexpr Ns kMs = 1'000'000;
inline constexpr Ns kSec = 1'000'000'000;
inline constexpr std::uint64_t kKiB = 1024;
inline constexpr std::uint64_t kMiBytes = 1024 * 1024;
inline constexpr std::uint64_t kGiB = 1024ull * 1024 * 1024;
inline constexpr double kMBps = 1e6;  // bytes/s in one MB/s

struct StorageConfig {
  double bandwidth = 100 * kMBps;  // C, bytes/s
  Ns base_latency = 1 * kMs;
  double noise_sigma = 0;          // lognormal σ on service time (mean kept at 1)
  int depth_knee = 0;              // 0: rate independent of queue depth
  double depth_min_fraction = 0.5; // rate with one request queued, when depth_knee > 0
};

struct PageCacheConfig {
  bool enabled = false;
  std::uint64_t dirty_limit = 2 * kGiB;
  std::uint64_t background_bytes = 1 * kGiB;
  std::uint64_t writeback_inflight_max = 512 * kMiBytes;
  std::uint64_t writeback_io = 1 * kMiBytes;
  double memcpy_rate = 2000 * kMBps;
};

enum class GuestKind { SyncPeriodic, OpenLoop, Burst };

struct GuestConfig {
  GuestKind kind = GuestKind::SyncPeriodic;
  Ns start = 0;
  Ns end = INT64_MAX;
  std::uint64_t io_bytes = 4 * kKiB;
  Ns interval = 10 * kMs;        // SyncPeriodic/Burst period; OpenLoop: derived from rate
  double rate = 0;               // OpenLoop bytes/s
  int burst_count = 16;          // Burst
  int host = 0;                  // only jobs on this host see its samples
};

enum class PolicyKind { Controller, FixedRate, Unlimited };

struct JobConfig {
  PolicyKind policy = PolicyKind::Controller;
  ControllerConfig controller{};
  double fixed_rate = 0;                         // FixedRate bytes/s
  std::uint64_t fixed_max_inflight = 16 * kMiBytes;  // QEMU mirror: 16 × 1 MiB
  std::uint64_t total_bytes = 1 * kGiB;
  std::uint64_t max_io = 256 * kKiB;
  bool buffered = false;   // through the page cache (needs PageCacheConfig.enabled)
  int host = 0;            // the controller sees the guests of this host only
  // The controller gets the copy's own I/O latencies and the age of its oldest request (the
  // offline merge does its own I/O); false for a daemon that paces a hypervisor's job and sees
  // only its progress.
  bool copy_latency_visible = true;
  // The controller is told when its host's guests did no I/O for kHostIdleAfter (the daemon's
  // TickInput::foreground_idle).
  bool idle_signal = false;
  // The controller is told the copy's own bytes in the storage's queue (TickInput::
  // own_queue_bytes: its requests in flight and its pages under writeback), as
  // own_service_samples each of its requests' bytes and time at storage (a daemon knows them of
  // the writeback ranges it waits for, not of the job's I/O), and as foreground_own_bytes the
  // largest request of each guest of its host.
  bool own_queue_visible = false;
  std::optional<ProbeConfig> probe;  // shared-queue probe of the job's host
  Ns clock_offset = 0;               // added to the time the controller is given
  // The host's synchronised wall clock (TickInput::wall_clock) = virtual time + this error;
  // nullopt: the controller is given none.
  std::optional<Ns> wall_clock_error;
  Ns start = 0;
  std::optional<Ns> cancel_at;
  // > 0: the copy is QEMU's mirror at cache=none as qcommitd paces it: requests of exactly this
  // size, up to fixed_max_inflight bytes of them in flight whatever the window, the decision's
  // rate enforced as QEMU's block-job speed is (rate_slice: requests go out while the job is
  // within its slices' quota, an overshoot carried to the next slices), and no backlog told to
  // the controller (the daemon sees no page cache of such a job; copy_latency_visible false).
  std::uint64_t request_bytes = 0;
  Ns rate_slice = 100 * kMs;
  Ns tick_jitter_max = 0;   // added uniformly to every tick interval
  double sample_loss = 0;   // probability each latency sample is lost
  double tick_loss = 0;     // probability that a tick gets no samples at all
};

struct GuestSample {
  Ns submit;
  Ns complete;
  Ns latency;
  Ns added;   // latency − (base latency + nominal service time) at submission
  std::uint64_t bytes;
  int guest = 0;
};

struct TickTrace {
  Ns t;
  Decision d;
  std::uint64_t backlog;
  bool samples_delivered;
};

struct JobStats {
  std::vector<std::pair<Ns, std::uint64_t>> drained;  // (time, cumulative bytes drained)
  std::vector<Ns> submits;                            // time of every copy I/O submission
  std::vector<TickTrace> ticks;
  std::uint64_t max_backlog = 0;
  Ns finished_at = -1;
  Ns last_completion = -1;
  std::uint64_t drained_total = 0;
  std::uint64_t probes = 0;                            // probes completed
  std::uint64_t probe_bytes = 0;                       // bytes the probes wrote
  [[nodiscard]] std::uint64_t drained_at(Ns t) const;  // cumulative drained by time t
  [[nodiscard]] double throughput(Ns a, Ns b) const;    // bytes/s drained in [a, b)
};

class Simulator {
 public:
  Simulator(StorageConfig storage, PageCacheConfig cache, std::uint64_t seed);
  ~Simulator();
  Simulator(const Simulator&) = delete;
  Simulator& operator=(const Simulator&) = delete;

  int add_guest(const GuestConfig& g);
  int add_job(const JobConfig& j);
  void at_capacity(Ns t, double bandwidth);
  void at_base_latency(Ns t, Ns base_latency);
  void stall(Ns from, Ns to);

  // Run until all jobs finished or cancelled, or `until`.
  void run(Ns until);

  [[nodiscard]] Ns now() const { return now_; }
  [[nodiscard]] const std::vector<GuestSample>& guest_samples() const { return guest_samples_; }
  [[nodiscard]] const JobStats& job(int i) const;
  [[nodiscard]] std::uint64_t max_total_copy_backlog() const { return max_total_backlog_; }
  [[nodiscard]] double guest_throughput(Ns a, Ns b) const;  // bytes/s completed in [a, b)

 private:
  struct Req;
  struct Job;
  struct Guest;
  struct Event {
    Ns t;
    std::uint64_t seq;
    std::function<void()> fn;
    bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
  };

  void schedule(Ns t, std::function<void()> fn);
  void submit(Req r);
  void server_advance();
  void server_reschedule();
  void server_done(std::uint64_t gen);
  void on_complete(const Req& r);
  [[nodiscard]] double server_rate() const;
  void guest_issue(int gi);
  void probe_schedule(int ji);
  void probe_issue(int ji);
  [[nodiscard]] bool job_active(const Job& j) const;
  void job_tick(int ji);
  void job_try_issue(int ji);
  void job_issue_requests(int ji);  // JobConfig::request_bytes
  void job_submit(int ji, std::uint64_t bytes);
  void cache_pump();
  [[nodiscard]] std::uint64_t job_backlog(const Job& j) const;
  void note_backlog();
  [[nodiscard]] bool all_jobs_done() const;

  StorageConfig storage_;
  PageCacheConfig cache_;
  std::mt19937_64 rng_;
  Ns now_ = 0;
  std::uint64_t seq_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;

  // Server.
  std::vector<Req> fifo_;  // FIFO with a head index (compacted as it grows)
  std::size_t fifo_head_ = 0;
  double head_work_left_ = 0;
  double cur_rate_ = 0;  // server rate in force since server_last_
  Ns server_last_ = 0;
  std::uint64_t server_gen_ = 0;
  double bandwidth_;
  bool stalled_ = false;
  Ns base_latency_;
  std::uint64_t next_req_id_ = 1;

  // Page cache.
  std::vector<std::uint64_t> dirty_;      // per job
  std::vector<std::uint64_t> writeback_;  // per job
  std::vector<std::uint64_t> kicked_;     // per job: bytes asked to be written back
  std::uint64_t dirty_total_ = 0;
  std::uint64_t wb_total_ = 0;
  bool bg_active_ = false;

  std::vector<std::unique_ptr<Guest>> guests_;
  std::vector<std::unique_ptr<Job>> jobs_;
  std::vector<GuestSample> guest_samples_;
  struct Outstanding {
    Ns submit;
    int host;
  };
  std::map<std::uint64_t, Outstanding> guest_outstanding_;  // req id → submit time, host
  std::map<int, Ns> host_last_completion_;                  // host → last guest completion
  std::uint64_t max_total_backlog_ = 0;
};

}  // namespace qcommit::throttle::sim
