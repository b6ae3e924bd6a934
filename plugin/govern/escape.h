// SPDX-License-Identifier: GPL-2.0-or-later
// A job that escaped governance: its target holds far more dirty and writeback pages than its
// latency budget allows.  That happens when the governor could not slow it in time -- adopted
// late (it started while the daemon was down, or before its first speed reached QEMU), after a
// daemon restart, or a job whose speed QEMU did not take -- and at page-cache speed a mirror
// dirties hundreds of MiB in a fraction of a second.  What is dirty then is a stall waiting to
// happen: QEMU flushes the target when the mirror becomes ready, and the switch-over (pivot)
// waits for it, with the guests' requests behind it (lab: 1.5 GB queued, the guest frozen
// 27.5 s).  The governor (governor.h) holds such a job at the minimum speed until the pacer has
// written the target out to within its window -- a mirror that is never ready cannot be
// pivoted -- and from then on bounds the storage's dirty pages in the kernel (bdi_limit.h) until
// the job ends, so that it cannot escape again (a speed QEMU keeps not taking).  Not before: a
// strict bound of a few tens of MiB on a device with hundreds of MiB dirty makes the kernel
// (balance_dirty_pages) throttle every buffered writer of that storage -- the guests' own
// cache=writeback writes through QEMU too, up to 200 ms a call -- until all of it is written
// back, and makes the flusher write it all out at once: the stall the paced drain avoids.
// Pure: time is a parameter.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "throttle/controller.h"

namespace qcommit::plugin {

// A job has escaped when its target's dirty + writeback bytes exceed both of these.  A governed
// job keeps at most its window under writeback plus one QEMU burst dirty (16 MiB: the mirror's
// 16 x 1 MiB requests) and one more in flight, so 4 windows and 64 MiB (four such bursts) is
// never reached by a job governed from its start, and at 50 MB/s 64 MiB is already 1.3 s of
// storage queued ahead of the guests: far beyond any budget.
inline constexpr std::uint64_t kEscapeWindowFactor = 4;
inline constexpr std::uint64_t kEscapeFloorBytes = 64ull * 1024 * 1024;

// The dirty + writeback bytes above which a job with `window_bytes` has escaped.
[[nodiscard]] std::uint64_t escape_threshold(std::uint64_t window_bytes);

struct EscapeState {
  bool escaped = false;
  std::uint64_t peak_bytes = 0;  // the most dirty + writeback seen in its target since
  double drain_bytes_per_s = 0;  // the storage's drain rate as the job knows it, latest
  std::optional<throttle::TimePoint> hold_since;  // held at the floor since (until within window)
  std::optional<throttle::Duration> held_for;     // how long the hold lasted, once over
  // The peak over the drain rate: the stall it would have been if flushed at once.
  [[nodiscard]] std::optional<throttle::Duration> cost() const;
};

// The kernel bound on an escaped job's storage (bdi_limit.h) is this many times what a governed
// job may have there (its window queued plus one QEMU burst dirty): the kernel throttles a
// strict-limited bdi's writers from about half its bound on, so the bound stops what escapes the
// governor, not what the governor allows.
inline constexpr std::uint64_t kBdiLimitHeadroom = 2;

// The kernel limit's state at the escape, where limits are configured: it goes on once the
// target is written out to its window (not before, see above).
inline constexpr char kBdiLimitPending[] = "pending: set once the target is within its window";

enum class EscapeNews { kNone, kEscaped, kBackWithinWindow };

// One exact reading of the target (`target_bytes`: dirty + writeback), the job's window and the
// storage's drain estimate at `now`: whether the job escaped at this reading, or its hold ended
// (the target is within the window again).  Escapes once per job.
[[nodiscard]] EscapeNews observe_escape(EscapeState& st, std::uint64_t target_bytes,
                                        std::uint64_t window_bytes, double drain_bytes_per_s,
                                        throttle::TimePoint now);

// The log line for `news` (after "domain D disk K: "): how much of `target` (a log field) was
// dirty, the storage time it stands for, what the governor does; the kernel limit's state
// (`bdi_limit`: kBdiLimitPending at the escape, "on: ..." or "off: why" once the target is back
// within its window; "" when none is configured).
[[nodiscard]] std::string escape_line(EscapeNews news, const EscapeState& st,
                                      const std::string& target, std::uint64_t window_bytes,
                                      const std::string& bdi_limit);

}  // namespace qcommit::plugin
