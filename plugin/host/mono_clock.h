// SPDX-License-Identifier: GPL-2.0-or-later
// The monotonic clock as the controller's TimePoint: the clock qcommitd's main loop and
// `qcommit live`'s read, once a step, and pass down as `now` (throttle/ and the governor read
// no clock).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "throttle/controller.h"

namespace qcommit::plugin {

[[nodiscard]] inline throttle::TimePoint mono_now() {
  return throttle::TimePoint(std::chrono::duration_cast<throttle::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

// An event's timestamp from QEMU (host CLOCK_REALTIME, microseconds since the epoch) on the
// monotonic clock: now less the event's age.  The age is clamped to [0, kMaxEventAge]: a step of
// the realtime clock in between would put it anywhere.
inline constexpr throttle::Duration kMaxEventAge = std::chrono::seconds(10);
[[nodiscard]] inline throttle::TimePoint mono_of_realtime_us(std::int64_t realtime_us) {
  const auto wall = std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch());
  const throttle::Duration age = std::clamp<throttle::Duration>(
      wall - std::chrono::microseconds(realtime_us), throttle::Duration::zero(), kMaxEventAge);
  return mono_now() - age;
}

}  // namespace qcommit::plugin
