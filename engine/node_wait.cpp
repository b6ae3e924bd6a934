// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/node_wait.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

namespace qcommit::engine {

namespace {

// The node exists and has a device behind it: a loop device's or a device-mapper node appears
// a moment before its device is set up, and opening it then fails with ENXIO.
bool ready(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  return errno != ENOENT && errno != ENXIO;  // another error is for the open after to report
}

// To the nearest 100 ms: what is left of the budget when the wait begins is a few milliseconds
// short of the --wait given.
LockClock::duration nearest_100ms(LockClock::duration d) {
  return std::chrono::milliseconds(
      (std::chrono::duration_cast<std::chrono::milliseconds>(d).count() + 50) / 100 * 100);
}

}  // namespace

bool may_appear_late(const std::string& path) {
  const std::string normal = std::filesystem::absolute(path).lexically_normal().string();
  return normal.starts_with("/dev/") && normal.size() > 5;
}

bool wait_for_node(const std::string& path, LockClock::time_point deadline,
                   const LockWaitNotice& on_wait, const LockWaitClock& clock) {
  if (!may_appear_late(path)) return false;
  const LockClock::time_point start = clock.now();
  if (start >= deadline) return ready(path);
  if (on_wait) {
    WaitNotice n;
    n.what = WaitFor::kDeviceNode;
    n.timeout = nearest_100ms(deadline - start);
    n.message = "waiting up to " + wait_duration_text(*n.timeout) + " for " + path +
                " to appear (a device node udev may still be creating)";
    n.path = notice_path(path);
    on_wait(n);
  }
  for (;;) {
    if (ready(path)) return true;
    const LockClock::time_point now = clock.now();
    if (now >= deadline) return false;
    clock.sleep_for(std::min<LockClock::duration>(kNodeRecheckInterval, deadline - now));
  }
}

}  // namespace qcommit::engine
