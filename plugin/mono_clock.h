// SPDX-License-Identifier: GPL-2.0-or-later
// The monotonic clock as the controller's TimePoint: the clock qcommitd's main loop and
// `qcommit live`'s read, once a step, and pass down as `now` (throttle/ and the governor read
// no clock).
#pragma once

#include <chrono>

#include "throttle/controller.h"

namespace qcommit::plugin {

[[nodiscard]] inline throttle::TimePoint mono_now() {
  return throttle::TimePoint(std::chrono::duration_cast<throttle::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

}  // namespace qcommit::plugin
