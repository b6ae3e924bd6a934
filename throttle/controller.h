// SPDX-License-Identifier: GPL-2.0-or-later
// Latency-budgeted rate controller for background copies (snapshot merges).
//
// Pure: the caller passes `now`, measured samples and counters; the controller never reads a
// clock and never does I/O.  Decisions are returned as values and durations; callers sleep.
//
// Physics.  A guest flush that arrives behind B bytes queued at storage draining at D bytes/s
// waits ≈ B / D.  So the copy must bound the bytes it has *queued* (its own in-flight I/O plus
// the page cache it dirtied that has not reached storage), not only its bytes per second.
//
// Control law (one tick every ~50–100 ms, jitter tolerated):
//  * Queueing delay q = latency − learned base latency.  Bases are min filters over "epochs"
//    (an epoch starts at every slowdown); the filter keeps the current and the previous epoch,
//    so a permanent base change is re-learned within two slowdown cycles and an idle signal
//    expires after one empty epoch.  Foreground samples (guest writes/flushes, or a probe's
//    4 KiB O_DSYNC write) and the age of the oldest outstanding foreground request (blk-wbt:
//    a request that has not completed is a latency sample of at least its age) both count.
//    "Foreground requests outstanding and no completion since the previous tick" is a stall of
//    at least the time between the two ticks, never good news.
//  * Drain rate D: BBR-style max filter (horizon kDrainFilterHorizon) over drain samples taken
//    while the copy was window-limited; app-limited samples only raise the estimate, unless no
//    window-limited sample is left in the horizon (then the max of all recent samples).
//    A slowdown before the first drain sample is not sampled (it would replace the initial
//    estimate by the floor rate).
//  * Window (hard cap on backlog bytes) = budget × D, never below
//    min_window_bytes (liveness: one small I/O at a time) and never above max_window_bytes.
//  * Pacing rate R: slow start (doubling) while q is small, then additive increase
//    (config.additive_increase, absolute bytes/s per second, so competing copies converge to a
//    fair share) and multiplicative decrease proportional to the overshoot when q exceeds
//    budget × kTargetFraction, at most once per kDecreaseHoldoff.
//    Increase only on ticks that brought fresh latency samples *and* where the copy used its
//    allowance (window-limited or drained ≥ kBusyFraction of the paced bytes).  Without fresh
//    samples neither rate nor window ever increase; a tick the caller reports idle (no
//    foreground I/O at all: TickInput::foreground_idle) counts as fresh.
//  * The guests' own queueing (where the caller bounds both the copy's bytes ahead of a foreground
//    request, TickInput::own_queue_bytes, and the foreground's own, foreground_own_bytes): the
//    delay charged is the larger of what the copy's own queue can explain (at most those bytes ÷
//    the storage's rate) and what the guests' own requests cannot (the delay less their bytes ÷
//    that rate).  The first is not less than the copy's share of the delay as long as the
//    caller's count of its bytes at storage is whole and the rate not above the storage's, so a
//    busy guest queueing behind its own writes and flushes does not hold the copy at its floor;
//    the second keeps the delay that neither explains -- another host's copy on the same
//    storage, which backs off for ours as ours for it -- charged.  The storage's rate: the best
//    of the drain estimate and of the copy's own requests' bytes ÷ their time at storage
//    (TickInput::own_service_samples, copy_samples: a request that waited behind others gives a
//    low figure, the max filter keeps the clean ones).  A charge from the copy's own queue is
//    steered to the whole budget (it is a worst case, not a sample); the window stays budget ×
//    drain whatever is charged, the bound on the copy's bytes should its count of them at storage
//    fall short.  A stall (requests outstanding: their age is a delay sample) is excused only up
//    to the guests' own bytes' time, so one longer than that still pauses the copy.
//  * Emergency stop: q > kEmergencyFactor × budget ⇒ paused (and R halved).  Resumes when fresh
//    samples show q ≤ target, or after kPauseProbeAfter when nothing at all is outstanding.
//  * Floor-limited (config.copy_request_bytes, kFloorLimitedDrainShare): where one indivisible
//    copy request takes the storage longer than the budget, the delay target is that request's
//    service time, the rate is never cut below a share of the storage's measured rate, slow
//    start measures that rate once (ending on its plateau, not on the delay), and only a delay
//    beyond all the copy's requests in flight is an emergency.  Decision::floor_limited says so.
//  * Slowdowns (LEDBAT++): every slowdown_interval, aligned to multiples of the interval on the
//    caller's monotonic clock so that several controllers on one host (CLOCK_MONOTONIC is
//    system-wide) drain the queue together, the copy drops to the floor rate and the minimum
//    window for slowdown_duration, a new base epoch starts, and the rate is then restored.
//    Hosts sharing a storage have unrelated monotonic clocks: a caller that knows a clock they
//    keep in sync (NTP-disciplined CLOCK_REALTIME) passes it (TickInput::wall_clock) and the
//    slowdowns are aligned on it instead, so that the copies of every host drain the queue
//    together; otherwise one host's base is learned behind the others' queues and its copy
//    steers to the budget on top of them.
//    A slowdown also starts as soon as foreground samples appear while no foreground base is
//    known (guest became active).
//  * Shared-queue probe (optional, throttle/probe.h): a small write + flush of the caller's own
//    on the copy's target storage stands for the guests the caller cannot see (on other hosts
//    sharing the storage).  Its latencies have a base of their own (another min filter with the
//    same epochs: a write + flush is not a guest's single request), its delay counts per storage
//    request (÷ probe_requests_per_sample) next to the foreground's, and a probe outstanding
//    counts as a sample of at least its age.  Probe samples make a tick fresh.
//
// Using it — the offline merge engine (own O_DIRECT or buffered I/O):
//    every tick: fill TickInput with the probe/guest latencies completed since the last tick,
//    its own per-I/O write latencies (CopySample), backlog = bytes in flight + dirty/writeback
//    pages of the target (cachestat(2) or /proc/meminfo), drained_bytes = bytes that reached
//    storage since the last tick (direct: completed writes; buffered: written − Δ(dirty+wb));
//    then: if decision.paused issue nothing; otherwise issue an I/O of n bytes only while
//    backlog + n ≤ decision.window_bytes (or nothing is in flight), sleeping
//    pacer.reserve(now, n) before each; call tick() again after decision.next_tick.
//    In buffered mode start writeback of what was written (sync_file_range) right away.
// Using it — the libvirt daemon (actuator: QEMU job speed, sync_file_range on the target):
//    foreground samples = per-op latency deltas of the guests' block stats (total_times delta
//    / ops delta, one sample per guest and tick; outstanding = ops issued without completion
//    as far as known), copy_samples empty, backlog = target dirty + writeback pages,
//    drained_bytes = job progress delta minus growth of the backlog.  Set the job speed to
//    decision.rate_bytes_per_s, or to the minimum speed while paused or while
//    backlog > decision.window_bytes.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace qcommit::throttle {

using Duration = std::chrono::nanoseconds;

// The caller's monotonic clock.  It has no now(): time is always a parameter.
struct CallerClock {
  using rep = std::int64_t;
  using period = std::nano;
  using duration = Duration;
  using time_point = std::chrono::time_point<CallerClock, Duration>;
  static constexpr bool is_steady = true;
};
using TimePoint = CallerClock::time_point;

inline constexpr double kMiB = 1024.0 * 1024.0;

// --- Named constants (units in the name or comment) ---------------------------------------
inline constexpr double kEmergencyFactor = 2.0;       // pause when q > 2 × budget
inline constexpr double kTargetFraction = 0.5;        // steer q to budget × 0.5
inline constexpr double kFullIncreaseFraction = 0.5;  // full additive step while q < target × 0.5
inline constexpr double kMildDecreaseFactor = 0.9;    // rate × 0.9 when q just above target
inline constexpr double kStrongDecreaseFactor = 0.7;  // rate × 0.7 when q ≥ budget
inline constexpr double kEmergencyRateFactor = 0.5;   // rate × 0.5 on entering emergency stop
inline constexpr double kBusyFraction = 0.5;          // backlog ≥ ½ window ⇒ window-limited
inline constexpr double kRateHeadroomOverDrain = 1.25;  // steady: rate ≤ 1.25 × drain estimate
inline constexpr double kSlowStartHeadroomOverDrain = 2.0;  // slow start: rate ≤ 2 × drain
inline constexpr std::uint64_t kMinWindowBytes = 64 * 1024;
inline constexpr Duration kDrainSampleInterval = std::chrono::milliseconds(200);
inline constexpr Duration kDrainFilterHorizon = std::chrono::milliseconds(1500);
inline constexpr Duration kDecreaseHoldoff = std::chrono::milliseconds(150);
inline constexpr Duration kSlowStartDoublingTime = std::chrono::milliseconds(250);
inline constexpr Duration kPauseProbeAfter = std::chrono::milliseconds(250);
inline constexpr Duration kMaxTickGap = std::chrono::seconds(1);  // longer gaps count as 1 s
inline constexpr Duration kMinNextTick = std::chrono::milliseconds(1);

// Floor-limited copies: one indivisible copy request (ControllerConfig::copy_request_bytes) takes
// the storage longer than the budget lets a guest's request wait, once the storage's rate is
// measured.  A guest's request that finds one ahead of it waits that long whatever the rate: a
// lower rate makes it rarer, not shorter, and cutting the rate only stretches the copy (lab,
// QEMU 10's mirror at cache=none on a raw base, 50 MB/s storage, 1.5 GiB: 3.65x its ungoverned
// time, guests' p99 41.7 ms -- about two requests of 1 MiB).  There the rate is never cut below
// this share of the storage's measured rate S.  N bytes then take N / (0.7 S) = 1.43 x N / S;
// the periodic slowdowns (200 ms at the floor rate every 10 s) add 2 % (1.46x), and the ramp
// that measures S (from 4 MiB/s, doubling every 250 ms: ~1 s to 50 MiB/s, plus the plateau's
// 0.6 s) adds about 1.6 s: 1.51x for 1.5 GiB at 50 MiB/s (31 s), under the 1.6x a merge may take.
inline constexpr double kFloorLimitedDrainShare = 0.7;
// The first time a copy is floor-limited, slow start runs (again) and the delay does not end it,
// as the delay says nothing of the rate there: it ends once the storage's measured rate has not
// grown by kFloorLimitedGrowth over kFloorLimitedPlateauSamples drain samples taken while it was
// paced that much above it (the storage, not the pacing, limits the copy), or on a stall (BBR's
// "full bandwidth reached"); what the ramp queued then drains in a slowdown.
inline constexpr double kFloorLimitedGrowth = 1.25;
inline constexpr int kFloorLimitedPlateauSamples = 2;
// The ramp also ends once it is paced at this fraction of the policy's ceiling: a ceiling (or
// --max-rate) below the storage's rate is all the copy may have, and the plateau test above
// could never pass under it.
inline constexpr double kFloorRampCeilingFraction = 0.99;
// Only copies with several requests in flight are floor-limited (QEMU's mirror: 16 x 1 MiB):
// theirs is the crawl the share prevents.  A copy with one request in flight (QEMU's commit and
// stream, 512 KiB) has its delay target widened to one request's service time and is otherwise
// paced as any copy, so that a busy guest keeps what it needs of the storage.
inline constexpr std::uint32_t kFloorLimitedMinRequestsInFlight = 2;
// A floor-limited copy follows storage that gives less than it is asked for (the storage slowed
// down, another copy shares it): kFloorShortfallSamples drain samples in a row below
// kFloorShortfall of the rate it was paced at make the best of them the storage's measured rate,
// and the share follows it down.  A sample at the paced rate never lowers it: a copy held at 70 %
// of the storage cannot tell how much more there is.  0.75: QEMU's mirror achieves about its
// speed; two copies at 70 % each of one storage get about 50 % each.
inline constexpr double kFloorShortfall = 0.75;
inline constexpr int kFloorShortfallSamples = 5;

// The storage's rate as the copy's own requests show it (bytes / time from submission to
// completion): requests below kMinServiceSampleBytes are left out (their time is mostly the
// storage's fixed latency, not its rate), and the best figure of kServiceRateHorizon is kept (a
// request that did not wait behind a busy guest's is rare while the guest is busy).
inline constexpr std::uint64_t kMinServiceSampleBytes = 64 * 1024;
inline constexpr Duration kServiceRateHorizon = std::chrono::seconds(2);

// The budget users give is the latency a guest's durable write may gain.  That write is a chain
// of storage requests -- the data write, then the flush (FUA or a cache flush) -- and each one
// waits behind what the copy has queued, so the guest sees the queueing delay about twice.
// Measured in the lab (tests/lab/results/bench-stall-cpu-control.txt): with the controller
// steering the per-request delay to the whole budget, the guest's added p99 was ~2.5x the
// storage FIFO delay the merge caused (p99 28.4 ms at 20 ms; at half of it: 19.0-20.1 ms,
// bench-stall-governed-runs.txt).  Callers holding a user's budget hand the controller
// request_budget(budget).
inline constexpr double kStorageRequestsPerGuestSyncWrite = 2.0;

// The per-request latency budget the controller steers to for a guest-visible budget.
[[nodiscard]] inline Duration request_budget(Duration guest_budget) {
  return std::chrono::duration_cast<Duration>(guest_budget / kStorageRequestsPerGuestSyncWrite);
}

struct ControllerConfig {
  // T: max added latency per storage request (see request_budget for a user's budget).
  Duration latency_budget = std::chrono::milliseconds(20);
  double floor_rate_bytes_per_s = 1.0 * kMiB;           // copy never paced below this unless paused
  double ceiling_rate_bytes_per_s = 16384.0 * kMiB;     // never above
  double initial_rate_bytes_per_s = 4.0 * kMiB;         // start of slow start
  double additive_increase_bytes_per_s2 = 16.0 * kMiB;  // AI slope (bytes/s per second)
  std::uint64_t min_window_bytes = kMinWindowBytes;
  std::uint64_t max_window_bytes = 1024ull * 1024 * 1024;
  Duration tick_interval = std::chrono::milliseconds(50);
  Duration slowdown_interval = std::chrono::seconds(10);
  Duration slowdown_duration = std::chrono::milliseconds(200);
  // The copy's smallest write, which it cannot split (0: none).  QEMU's commit and stream jobs
  // write 512 KiB at a time; written past the page cache, one of them ahead of a foreground
  // request delays it by bytes / drain rate at any speed.  A lower rate makes that rarer but not
  // shorter, so the delay target and the emergency threshold are never set below it (once a
  // drain rate has been measured).
  std::uint64_t copy_request_bytes = 0;
  // The most of those requests the copy keeps in flight at once (QEMU's mirror: 16).  Where one
  // of them exceeds the budget (floor-limited, kFloorLimitedDrainShare), a guest's request may
  // wait behind that many of them at any rate: only a longer delay is a stall that pauses the copy.
  std::uint32_t copy_requests_in_flight = 1;
  // Storage requests one probe sample spans: a write and a flush (the probe's delay is compared
  // per request, as the guests' per-request block stats are).  1 where the probe is one request.
  double probe_requests_per_sample = kStorageRequestsPerGuestSyncWrite;

  // nullopt when valid, else one line naming the problem.
  [[nodiscard]] std::optional<std::string> validate() const;
};

// One latency sample of the copy's own I/O.
struct CopySample {
  Duration latency{};
  std::uint64_t bytes = 0;
};

struct TickInput {
  TimePoint now{};
  // Completed foreground (guest or probe) write/flush latencies since the previous tick.
  std::span<const Duration> foreground_latencies{};
  // Age of the oldest foreground request still outstanding, when the caller knows it.
  std::optional<Duration> foreground_oldest_outstanding{};
  // Foreground requests issued and not completed (0 when unknown).
  std::uint32_t foreground_outstanding = 0;
  // The caller read every foreground source on the storage and none did any I/O since the
  // previous tick (none completed, none outstanding): nobody to protect.  Such a tick counts as
  // fresh with no queueing delay seen, so that a copy on idle storage is not held at its last rate
  // (or at the floor after a slowdown) until some guest happens to do I/O; what it may queue is
  // still bounded by the window.
  bool foreground_idle = false;
  // Shared-queue probe (throttle/probe.h): latencies of the probes completed since the previous
  // tick, and the age of the one outstanding, if any.
  std::span<const Duration> probe_latencies{};
  std::optional<Duration> probe_outstanding{};
  // Time since the epoch on a clock the hosts sharing the storage keep in sync (NTP), when
  // known: periodic slowdowns are slotted on it instead of `now`.
  std::optional<Duration> wall_clock{};
  // The copy's own completed I/O since the previous tick.
  std::span<const CopySample> copy_samples{};
  // Age of the copy's oldest outstanding I/O, when known.
  std::optional<Duration> copy_oldest_outstanding{};
  // Bytes the copy has queued: own in flight + dirty/writeback pages of the target.
  std::uint64_t backlog_bytes = 0;
  // Bytes of the copy that reached storage since the previous tick.
  std::uint64_t drained_bytes = 0;
  // The most bytes of the copy's own that can be ahead of a foreground request at the storage,
  // when the caller can bound them: what it has submitted and not seen completed -- its writes in
  // flight (with direct I/O, as many as it may have at once) and the target's pages under
  // writeback (dirty pages not yet submitted are behind the request, not ahead of it).  Then the
  // delay charged to the copy is at most the time the storage takes to clear them at its measured
  // rate: a foreground request that waited longer waited behind the foreground's own requests (a
  // busy guest's writer, its flushes), which no cut of the copy's rate would shorten.
  // nullopt: every delay is charged.
  std::optional<std::uint64_t> own_queue_bytes{};
  // The most bytes of the foreground's own requests that one of its requests can wait behind
  // with no copy running, when the caller can tell: per guest doing I/O at least its largest
  // request (a write's bytes or, under a writeback cache, the data a flush writes); qcommitd
  // passes what the guests wrote in the last throttle::kForegroundOwnWindow, which can be more.
  // A delay beyond what those bytes take at the storage's rate is not the guests' own doing.
  // nullopt: unknown.
  std::optional<std::uint64_t> foreground_own_bytes{};
  // Requests of the copy's own whose bytes and time from submission to completion are known
  // without being copy latencies the delay is computed from (a daemon's writeback ranges, waited
  // for): each bounds the storage's rate from below (bytes / time), which own_queue_bytes is
  // divided by.  copy_samples count as such too.
  std::span<const CopySample> own_service_samples{};
};

enum class Phase { SlowStart, Steady, Slowdown, Paused };

[[nodiscard]] const char* to_string(Phase p);

struct Decision {
  std::uint64_t window_bytes = 0;  // max backlog bytes (in flight + dirty) allowed
  double rate_bytes_per_s = 0;     // pacing rate
  bool paused = false;             // issue no new copy I/O
  Duration next_tick{};            // call tick() again after this long
  // Diagnostics.
  Phase phase = Phase::SlowStart;
  Duration queue_delay{};     // q this tick: the delay charged to the copy, steered to the target
  Duration measured_delay{};  // the max of all signals, before the own-queue bound
  // The delay measured exceeded what the copy's own queue can explain (TickInput::own_queue_bytes)
  // and the guests' own requests explain the rest: queue_delay is that bound.
  bool own_queue_bounded = false;
  std::optional<Duration> foreground_base{};
  std::optional<Duration> copy_base{};
  std::optional<Duration> probe_base{};
  Duration probe_delay{};  // the probe's delay per storage request this tick (part of q)
  double drain_estimate_bytes_per_s = 0;
  bool fresh = false;      // this tick brought latency samples
  bool emergency = false;  // this tick entered the emergency stop
  // Floor-limited (kFloorLimitedDrainShare): the delay accepted, one copy request's service time
  // at the storage's measured rate (zero when not floor-limited).
  bool floor_limited = false;
  Duration floor_latency{};
  // The best drain rate measured: the storage's rate, as service times are computed from it.
  double storage_rate_bytes_per_s = 0;
  // The rate own_queue_bytes is divided by: the best of that and of the copy's own requests'
  // service rates (0 while neither is known).
  double own_queue_rate_bytes_per_s = 0;
};

struct ControllerStats {
  std::uint64_t ticks = 0;
  std::uint64_t emergencies = 0;
  std::uint64_t decreases = 0;
  std::uint64_t slowdowns = 0;
};

// Min filter over the current and the previous epoch.
class EpochMinFilter {
 public:
  void add(Duration d) {
    if (!cur_ || d < *cur_) cur_ = d;
  }
  void new_epoch() {
    prev_ = cur_;
    cur_.reset();
  }
  void reset() {
    prev_.reset();
    cur_.reset();
  }
  [[nodiscard]] std::optional<Duration> value() const {
    if (prev_ && cur_) return std::min(*prev_, *cur_);
    return prev_ ? prev_ : cur_;
  }

 private:
  std::optional<Duration> prev_;
  std::optional<Duration> cur_;
};

class Controller {
 public:
  // The config must be valid (check validate() first); an invalid one is clamped to sanity.
  explicit Controller(ControllerConfig cfg);

  [[nodiscard]] Decision tick(const TickInput& in);
  // The caller held the copy for reasons of its own (not a decision of ours) until `now` and did
  // not tick meanwhile: the time since the last tick carries no drain or latency information.
  // The next tick's interval starts at `now`, and the drain sample being accumulated is dropped.
  void skip_until(TimePoint now);

  [[nodiscard]] const ControllerConfig& config() const { return cfg_; }
  [[nodiscard]] const ControllerStats& stats() const { return stats_; }

 private:
  struct DrainSample {
    TimePoint at;
    double bytes_per_s;
    bool window_limited;  // or above the estimate at the time
  };
  struct TickTiming {
    Duration dt{};  // since the previous tick, at most kMaxTickGap
    double dt_s = 0;
    double budget_s = 0;  // the budget, or one copy request's service time if longer
    Duration target{};    // the delay steered to
    double unit_s = 0;    // one copy request's service time (0 before a drain is measured)
    bool floor_limited = false;  // unit_s exceeds the configured budget
    Duration stall{};            // a delay beyond this pauses the copy
  };
  [[nodiscard]] TickTiming timing(TimePoint now) const;
  [[nodiscard]] bool measure_drain(const TickInput& in, const TickTiming& t);
  void update_drain(const TickInput& in, Duration dt, bool window_limited);
  void start_periodic_slowdown(const TickInput& in);
  [[nodiscard]] std::vector<Duration> learn_base_latencies(const TickInput& in);
  [[nodiscard]] static bool is_fresh(const TickInput& in);
  [[nodiscard]] Duration foreground_delay(const TickInput& in, TimePoint now);
  [[nodiscard]] Duration probe_delay(const TickInput& in) const;
  [[nodiscard]] Duration copy_delay(const TickInput& in, TimePoint now,
                                    std::vector<Duration>& copy_norm);
  void learn_service_rate(const TickInput& in);
  [[nodiscard]] double own_queue_rate() const;
  struct Charge {
    Duration delay{};
    bool own_queue_bound = false;  // the delay is the copy's own queue's time, less than measured
  };
  [[nodiscard]] Charge charged_delay(const TickInput& in, Duration measured) const;
  void update_slowdown(const TickInput& in, bool had_fg_base, bool fresh);
  void update_floor_ramp(const TickTiming& t, bool new_drain_sample, TimePoint now);
  void follow_slower_storage();
  [[nodiscard]] bool enter_pause(TimePoint now);
  void maybe_resume(const TickInput& in, Duration q, Duration target, bool fresh);
  void decrease_rate(TimePoint now, Duration q, Duration target);
  void increase_rate(Duration q, Duration target, double dt_s, bool floor_limited);
  void clamp_rate(bool floor_limited);
  [[nodiscard]] Decision decide(TimePoint now, Duration q, Duration target, bool fresh) const;
  [[nodiscard]] std::uint64_t compute_window() const;
  void start_slowdown(TimePoint now);

  ControllerConfig cfg_;
  ControllerStats stats_;
  bool started_ = false;
  TimePoint last_now_{};
  double rate_;
  double drain_est_;
  double drain_max_seen_;  // best drain ever measured: storage speed for service times
  std::uint64_t prev_window_ = 0;
  double prev_rate_ = 0;
  std::uint64_t prev_backlog_ = 0;
  bool slow_start_ = true;
  bool paused_ = false;
  TimePoint paused_since_{};
  bool in_slowdown_ = false;
  TimePoint slowdown_end_{};
  double saved_rate_ = 0;
  std::int64_t last_slowdown_slot_ = 0;
  std::optional<TimePoint> last_decrease_;
  std::optional<TimePoint> fg_quiet_since_;
  std::optional<TimePoint> copy_quiet_since_;
  EpochMinFilter fg_base_;
  EpochMinFilter copy_base_;
  EpochMinFilter probe_base_;
  // Drain accumulation and max filter.
  std::uint64_t acc_bytes_ = 0;
  Duration acc_time_{};
  bool acc_window_limited_ = true;
  std::deque<DrainSample> drain_samples_;
  bool drain_sampled_ = false;  // a drain sample has been taken
  std::uint64_t drain_sample_count_ = 0;
  // Floor-limited: entered once (its ramp started), and the ramp's plateau detection.
  bool floor_entered_ = false;
  double ramp_best_ = 0;
  int shortfall_samples_ = 0;   // floor-limited: drain samples in a row short of the paced rate
  double shortfall_best_ = 0;   // the best of them
  int ramp_flat_samples_ = 0;
  // The copy's own requests' service rates (learn_service_rate), for kServiceRateHorizon.
  std::deque<DrainSample> service_rates_;
};

}  // namespace qcommit::throttle
