// SPDX-License-Identifier: GPL-2.0-or-later
// Device nodes that appear late: udev creates /dev/VG/LV (and a loop device's node) a moment
// after the logical volume is activated or the device attached. A backing file named under /dev/
// that does not exist yet is waited for, within the merge's --wait budget; any other missing file
// is no race and fails at once.
#pragma once

#include <string>

#include "engine/image_lock.h"

namespace qcommit::engine {

// A waiting lookup looks again this often, so it starts soon after the node appears.
inline constexpr std::chrono::milliseconds kNodeRecheckInterval{20};

// Whether a missing `path` may be a device node still being created: it lies under /dev/.
[[nodiscard]] bool may_appear_late(const std::string& path);

// Waits for a missing file under /dev/ until `deadline`: true once `path` exists and has a device
// behind it (opening it no longer fails with ENXIO), false when it is not under /dev/ or the
// deadline passed first. `on_wait` (may be empty) is told once, when the wait begins, with a
// WaitFor::kDeviceNode notice: how long it may last (`deadline` less the clock's time then).
[[nodiscard]] bool wait_for_node(const std::string& path, LockClock::time_point deadline,
                                 const LockWaitNotice& on_wait,
                                 const LockWaitClock& clock = LockWaitClock{});

}  // namespace qcommit::engine
