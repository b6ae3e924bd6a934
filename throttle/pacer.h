// SPDX-License-Identifier: GPL-2.0-or-later
// Token-bucket pacer (in the spirit of QEMU util/throttle.c and seastar's shares/token bucket):
// reserve(now, bytes) debits the bucket immediately and returns how long the caller must wait
// before issuing those bytes.  Pure: `now` is a parameter; the caller sleeps.
#pragma once

#include <cstdint>

#include "throttle/controller.h"

namespace qcommit::throttle {

inline constexpr std::uint64_t kDefaultBurstBytes = 256 * 1024;

class Pacer {
 public:
  // rate_bytes_per_s > 0; burst = bytes that may go out back-to-back after an idle period.
  Pacer(double rate_bytes_per_s, std::uint64_t burst_bytes = kDefaultBurstBytes);

  // Change the rate from `now` on.  Tokens accrued so far at the old rate are kept; a debt
  // (negative balance) is repaid at the new rate.
  void set_rate(TimePoint now, double rate_bytes_per_s);

  // Reserve `bytes`: returns the wait before they may be issued (zero if they may go now).
  [[nodiscard]] Duration reserve(TimePoint now, std::uint64_t bytes);

  // How long until `bytes` could be issued, without reserving.
  [[nodiscard]] Duration wait_for(TimePoint now, std::uint64_t bytes) const;

  [[nodiscard]] double rate() const { return rate_; }
  [[nodiscard]] std::uint64_t burst() const { return burst_; }

 private:
  void refill(TimePoint now);
  double rate_;
  std::uint64_t burst_;
  double tokens_;   // bytes; negative = debt
  TimePoint last_{};
  bool started_ = false;
};

}  // namespace qcommit::throttle
