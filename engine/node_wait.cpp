#include "engine/node_wait.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

namespace qcommit::engine {

namespace {

bool exists(const std::string& path) {
  return ::access(path.c_str(), F_OK) == 0;
}

// "10 s", or "1500 ms" when not whole seconds; to the nearest 100 ms (what is left of the budget
// when the wait begins is a few milliseconds short of the --wait given).
std::string wait_text(LockClock::duration d) {
  const auto ms =
      (std::chrono::duration_cast<std::chrono::milliseconds>(d).count() + 50) / 100 * 100;
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
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
  if (start >= deadline) return exists(path);
  if (on_wait)
    on_wait("waiting up to " + wait_text(deadline - start) + " for " + path +
            " to appear (a device node udev may still be creating)");
  for (;;) {
    if (exists(path)) return true;
    const LockClock::time_point now = clock.now();
    if (now >= deadline) return false;
    clock.sleep_for(std::min<LockClock::duration>(kNodeRecheckInterval, deadline - now));
  }
}

}  // namespace qcommit::engine
