// SPDX-License-Identifier: GPL-2.0-or-later
// What the governor knows of a job's speed in QEMU beside its controller: how and when the job
// was found, the speed last asked for, the speed QEMU was read to have right after the call
// (virDomainGetBlockJobInfo's bandwidth, query-block-jobs' speed), and the time from the job's
// discovery to the first speed QEMU was seen to have as asked (time to govern).  A call that the
// hypervisor accepted is no evidence that QEMU runs the job at that speed: only the read back
// is.  Pure: times are parameters.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "plugin/policy/config.h"
#include "throttle/controller.h"

namespace qcommit::plugin {

// A job whose progress was beyond this when its first speed was seen in QEMU was adopted late:
// more than two of QEMU's mirror bursts (16 requests x 1 MiB) went out unpaced.
inline constexpr std::uint64_t kLateAdoptionBytes = 32ull * 1024 * 1024;

// How a job was found: QEMU's JOB_STATUS_CHANGE event (created/running), or a poll.
enum class FoundBy { kEvent, kPoll };
[[nodiscard]] const char* to_string(FoundBy f);  // "event", "poll"

// Where a job's time to govern went, each on the governor's clock: the scan that found it began
// (after QEMU's event came through libvirtd to the daemon), libvirt listed the job on its disk
// (neither for a job a poll found, which was discovered when listed), the hypervisor took the
// first speed call.  nullopt: not reached (or not known).
struct GovernStages {
  std::optional<throttle::TimePoint> scan_began;
  std::optional<throttle::TimePoint> job_listed;
  std::optional<throttle::TimePoint> speed_taken;
};

struct SpeedCheck {
  throttle::TimePoint found_at{};  // the event's timestamp, or the poll that listed the job
  GovernStages stages;             // found_at to the first speed, step by step
  FoundBy found_by = FoundBy::kPoll;
  std::uint64_t wanted = 0;                       // the speed last asked for (0: none yet)
  std::optional<std::uint64_t> actual;            // QEMU's speed at the last read back
  std::optional<throttle::Duration> time_to_govern;  // found_at to the first actual == wanted
  std::uint64_t copied_when_governed = 0;         // the job's progress then
  // The (wanted, actual) pair of the mismatch logged last; nullopt while none is outstanding.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> mismatch;

  // Whether the job had copied more than kLateAdoptionBytes when it was first governed.
  [[nodiscard]] bool late() const {
    return time_to_govern && copied_when_governed > kLateAdoptionBytes;
  }
  // Takes a read back: QEMU runs the job at `actual` (progress `cur`) at `at`, after the governor
  // asked for `wanted` (`accepted`: whether the hypervisor took the call).  Returns the line to
  // log (without the job's name): a mismatch not logged yet, or the end of one that was.
  [[nodiscard]] std::optional<std::string> read_back(std::uint64_t wanted_speed, bool accepted,
                                                     std::uint64_t actual_speed, std::uint64_t cur,
                                                     throttle::TimePoint at);
};

// `p` under a cap on every job's speed (`qcommit live --max-rate`): its ceiling (and a higher
// floor) come down to it.
[[nodiscard]] Policy capped_policy(Policy p, std::optional<double> max_rate_bytes_per_s);

// The speed a job found on a domain whose metadata is `policy_xml` can be held at before its
// pool is known: the least initial (slow-start) speed of the policy without a pool and of every
// pool's policy in `cfg`, under the cap.
[[nodiscard]] double safe_initial_speed(const DaemonConfig& cfg,
                                        const std::optional<std::string>& policy_xml,
                                        std::optional<double> max_rate_bytes_per_s);

}  // namespace qcommit::plugin
