// SPDX-License-Identifier: GPL-2.0-or-later
#include "throttle/probe.h"

#include <algorithm>

namespace qcommit::throttle {

std::optional<std::string> ProbeConfig::validate() const {
  if (!enabled) return std::nullopt;
  if (period < kMinProbePeriod || period > kMaxProbePeriod)
    return "probe period must be within [10ms, 10s]";
  if (bytes == 0) return "probe size must be > 0";
  if (!(max_load_fraction > 0 && max_load_fraction <= 1))
    return "probe load fraction must be within (0, 1]";
  return std::nullopt;
}

ProbeSchedule::ProbeSchedule(ProbeConfig cfg) : cfg_(cfg) {
  cfg_.period = std::clamp(cfg_.period, kMinProbePeriod, kMaxProbePeriod);
  if (!(cfg_.max_load_fraction > 0 && cfg_.max_load_fraction <= 1))
    cfg_.max_load_fraction = kMaxProbeLoadFraction;
}

Duration ProbeSchedule::effective_period(double storage_bytes_per_s) const {
  if (!(storage_bytes_per_s > 0)) return kMaxProbePeriod;
  const double load_floor_s =
      static_cast<double>(cfg_.bytes) / (cfg_.max_load_fraction * storage_bytes_per_s);
  const auto load_floor = std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>(std::min(load_floor_s, 1e6)));
  return std::clamp(std::max(cfg_.period, load_floor), kMinProbePeriod, kMaxProbePeriod);
}

std::optional<Duration> ProbeSchedule::until_next(TimePoint now, double storage_bytes_per_s) const {
  if (!cfg_.enabled || outstanding_) return std::nullopt;
  if (!last_start_) return Duration::zero();
  const TimePoint due = *last_start_ + effective_period(storage_bytes_per_s);
  return due > now ? due - now : Duration::zero();
}

void ProbeSchedule::started(TimePoint now) {
  last_start_ = now;
  outstanding_ = true;
}

Duration ProbeSchedule::completed(TimePoint now) {
  if (!outstanding_ || !last_start_) return Duration::zero();
  outstanding_ = false;
  ++completed_;
  return std::max(Duration::zero(), now - *last_start_);
}

std::optional<Duration> ProbeSchedule::outstanding_age(TimePoint now) const {
  if (!outstanding_ || !last_start_) return std::nullopt;
  return std::max(Duration::zero(), now - *last_start_);
}

}  // namespace qcommit::throttle
