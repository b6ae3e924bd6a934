// SPDX-License-Identifier: GPL-2.0-or-later
// Shared-queue probe: when to issue a small synchronous write (4 KiB write + flush) on the copy's
// target storage, and what it measured.
//
// Why.  A copy's daemon sees only the guests on its own host.  Guests on other hosts that share
// the storage (an NFS export, a SAN LUN) wait in the same queue, but their latency never reaches
// this host.  The probe is a guest of our own on that storage: it waits behind whatever every
// host has queued, so its latency over its unloaded base is the delay a guest the daemon cannot
// see would get.  The controller uses it next to the local guests' samples
// (TickInput::probe_latencies, TickInput::probe_outstanding).
//
// Load.  One probe at a time (it is synchronous: the next starts only after the previous one
// completed), at most one per `period`, and never more than `max_load_fraction` of the storage's
// throughput in bytes: the period is stretched to bytes / (fraction × throughput) when the
// throughput known to the caller (the controller's drain estimate, a lower bound on it) is low.
// A flush of a file with nothing else dirty adds a round trip, not service time.
//
// Pure: `now` is a parameter; until_next() says how long the caller waits, the caller issues the
// write and reports started() and completed().
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "throttle/controller.h"

namespace qcommit::throttle {

// One probe per controller tick or so: 4 KiB every 50 ms is 80 kB/s, 0.16 % of 50 MB/s.
inline constexpr Duration kDefaultProbePeriod = std::chrono::milliseconds(50);
inline constexpr std::uint64_t kDefaultProbeBytes = 4 * 1024;
inline constexpr double kMaxProbeLoadFraction = 0.01;  // ≤ 1 % of the storage's throughput
inline constexpr Duration kMinProbePeriod = std::chrono::milliseconds(10);
inline constexpr Duration kMaxProbePeriod = std::chrono::seconds(10);

struct ProbeConfig {
  bool enabled = true;
  Duration period = kDefaultProbePeriod;  // between two probe starts, at least
  std::uint64_t bytes = kDefaultProbeBytes;
  double max_load_fraction = kMaxProbeLoadFraction;
  // nullopt when valid, else one line naming the problem.
  [[nodiscard]] std::optional<std::string> validate() const;
};

class ProbeSchedule {
 public:
  explicit ProbeSchedule(ProbeConfig cfg);

  // How long until the next probe may start at `now` (zero: now), given the storage throughput
  // known to the caller in bytes/s.  nullopt: no probe to start (off, or one is outstanding).
  [[nodiscard]] std::optional<Duration> until_next(TimePoint now, double storage_bytes_per_s) const;
  // The period in force at `storage_bytes_per_s`: the configured one, stretched by the load cap.
  [[nodiscard]] Duration effective_period(double storage_bytes_per_s) const;

  void started(TimePoint now);
  // The outstanding probe completed at `now`; returns its latency (zero if none was outstanding).
  [[nodiscard]] Duration completed(TimePoint now);
  // Age of the outstanding probe, if one is.
  [[nodiscard]] std::optional<Duration> outstanding_age(TimePoint now) const;

  [[nodiscard]] const ProbeConfig& config() const { return cfg_; }
  [[nodiscard]] std::uint64_t completed_count() const { return completed_; }

 private:
  ProbeConfig cfg_;
  std::optional<TimePoint> last_start_;
  bool outstanding_ = false;
  std::uint64_t completed_ = 0;
};

}  // namespace qcommit::throttle
