// SPDX-License-Identifier: GPL-2.0-or-later
// Retry spacing for a connection that went away (qcommitd's governor, `qcommit live` under
// qcommitd): the first attempt at once, then after `min`, doubling each failure up to `max`; a
// success starts the spacing over. Pure: time is a parameter.
#pragma once

#include <algorithm>

#include "throttle/controller.h"

namespace qcommit::throttle {

class Backoff {
 public:
  // Needs 0 < min <= max (GovernorOptions::validate checks its own).
  constexpr Backoff(Duration min, Duration max) : min_(min), max_(max), delay_(min) {}

  // Whether an attempt is due at `now`.
  [[nodiscard]] constexpr bool due(TimePoint now) const { return now >= next_; }
  // When the next attempt is due.
  [[nodiscard]] constexpr TimePoint next() const { return next_; }

  // The attempt at `now` failed: the next one after the current delay, which then doubles.
  constexpr void failed(TimePoint now) {
    next_ = now + delay_;
    delay_ = std::min(delay_ * 2, max_);
  }
  // Connected: the next loss is retried after `min` again.
  constexpr void succeeded() { delay_ = min_; }
  // Just lost: attempt at once (the delay is kept until an attempt succeeds).
  constexpr void retry_now(TimePoint now) { next_ = now; }

 private:
  Duration min_, max_, delay_;
  TimePoint next_{};
};

}  // namespace qcommit::throttle
