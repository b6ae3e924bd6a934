// SPDX-License-Identifier: GPL-2.0-or-later
#include "throttle/pacer.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace qcommit::throttle {
namespace {
constexpr double kMinRateBytesPerS = 1.0;  // guards the division in wait computations
}

Pacer::Pacer(double rate_bytes_per_s, std::uint64_t burst_bytes)
    : rate_(std::max(rate_bytes_per_s, kMinRateBytesPerS)),
      burst_(std::max<std::uint64_t>(burst_bytes, 1)),
      tokens_(static_cast<double>(burst_)) {}

void Pacer::refill(TimePoint now) {
  if (!started_) {
    started_ = true;
    last_ = now;
    return;
  }
  if (now <= last_) return;
  const double dt = std::chrono::duration<double>(now - last_).count();
  tokens_ = std::min(static_cast<double>(burst_), tokens_ + dt * rate_);
  last_ = now;
}

void Pacer::set_rate(TimePoint now, double rate_bytes_per_s) {
  refill(now);
  rate_ = std::max(rate_bytes_per_s, kMinRateBytesPerS);
}

Duration Pacer::wait_for(TimePoint now, std::uint64_t bytes) const {
  double tokens = tokens_;
  if (started_ && now > last_) {
    const double dt = std::chrono::duration<double>(now - last_).count();
    tokens = std::min(static_cast<double>(burst_), tokens + dt * rate_);
  }
  // Requests larger than the burst are allowed when the bucket is full (no starvation).
  const double need = std::min(static_cast<double>(bytes), static_cast<double>(burst_));
  if (tokens >= need) return Duration::zero();
  const double secs = (need - tokens) / rate_;
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(secs)) +
         Duration(1);  // round up: waking early would find the bucket still short
}

Duration Pacer::reserve(TimePoint now, std::uint64_t bytes) {
  refill(now);
  const Duration wait = wait_for(now, bytes);
  tokens_ -= static_cast<double>(bytes);
  return wait;
}

}  // namespace qcommit::throttle
