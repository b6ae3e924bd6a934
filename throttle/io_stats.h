// SPDX-License-Identifier: GPL-2.0-or-later
// Foreground latency signals from cumulative I/O counters, such as libvirt's block stats of a
// guest's disk (virDomainBlockStatsFlags: requests and total times, counted on completion).
// Used by qcommitd's governor for the guests next to a block job and by the offline merge's
// BudgetGovernor for the guests next to BASE (co-tenants), so both read the counters the same way.
//
// Pure: `now` is a parameter, no clock reads, no I/O.
//
// Per disk and sample (one IoCounterSampler per disk):
//  * Δwr_total_times / Δwr_reqs and Δflush_total_times / Δflush_reqs are latency samples (the
//    mean per-request latency of what completed since the previous sample);
//  * the counters move only when requests complete, so a disk that was completing requests and
//    has gone silent for longer than kStallFactor × its usual interval between completions is
//    reported as outstanding, with the silence beyond one usual interval as its age — a stuck
//    request is never good news — for at most kMaxSuspectedStall (after that the guest has
//    more likely gone idle);
//  * counters that go backwards (the domain restarted) give no sample, only a new baseline;
//  * where the counters carry the bytes written (wr_bytes >= 0), the bytes the disk wrote in the
//    last kForegroundOwnWindow are what its own requests can hold at storage ahead of another of
//    its requests (a flush writes what was written since the previous one; a guest that flushes
//    less often than that window is counted short): ForegroundSignals::own_bytes, the
//    controller's TickInput::foreground_own_bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "throttle/controller.h"

namespace qcommit::throttle {

inline constexpr double kStallFactor = 3.0;  // silence > 3 × usual interval ⇒ stall
inline constexpr Duration kMaxSuspectedStall = std::chrono::seconds(3);
inline constexpr Duration kForegroundOwnWindow = std::chrono::milliseconds(250);

// Cumulative counters of one disk (times in ns).
struct IoCounters {
  std::int64_t wr_reqs = 0;
  std::int64_t wr_total_times_ns = 0;
  std::int64_t flush_reqs = 0;
  std::int64_t flush_total_times_ns = 0;
  std::int64_t wr_bytes = -1;  // bytes written; -1: not reported
};

// What the foreground did since the previous sample, in TickInput's terms.
struct ForegroundSignals {
  std::vector<Duration> latencies;
  std::uint32_t outstanding = 0;
  std::optional<Duration> oldest_outstanding;
  // The bytes the disks wrote in the last kForegroundOwnWindow; nullopt when one of them does
  // not report its bytes.
  std::optional<std::uint64_t> own_bytes = 0;

  void add(const ForegroundSignals& o);
};

class IoCounterSampler {
 public:
  // Adds what the disk did since the previous call to `out`.  `interval` is how often the caller
  // samples: the shortest "usual interval" between completions it can observe.
  void sample(TimePoint now, const IoCounters& c, Duration interval, ForegroundSignals& out);
  // Whether a previous sample exists (the first one only sets the baseline: it says nothing).
  [[nodiscard]] bool primed() const { return has_prev_; }
  // No completion seen for at least `d` (or none since sampling began).
  [[nodiscard]] bool quiet_for(TimePoint now, Duration d) const {
    return !last_completion_ || now - *last_completion_ >= d;
  }

 private:
  void note_written(TimePoint now, const IoCounters& c, ForegroundSignals& out);

  IoCounters prev_{};
  bool has_prev_ = false;
  std::vector<std::pair<TimePoint, std::uint64_t>> written_;  // bytes written per sample, recent
  std::optional<TimePoint> last_completion_;
  std::optional<Duration> usual_;  // EWMA of the time between samples with completions
};

}  // namespace qcommit::throttle
