// SPDX-License-Identifier: GPL-2.0-or-later
// The throttle filter under the target of an active commit into a cache=none target
// (target_throttle.h, GovernorOptions::target_throttle): put in once the job is quiet, its rate
// following the job's speed, taken out when the mirror is ready, ends or the daemon stops; and
// those a dead qcommit process left in QEMU.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include "common/log_field.h"
#include "plugin/govern/governor_job.h"

namespace qcommit::plugin {

// QMP commands to `domain`'s QEMU through the hypervisor.
QmpCall Governor::qmp_for(const std::string& domain) {
  return [this, domain](std::string_view command, const json::Value& args, std::string* error) {
    return hv_.qmp_command(domain, command, args, error);
  };
}

// The filter goes in at the controller's initial rate.  The job's requests (1 MiB each) are what
// a guest's request may find ahead of it: the controller's delay target is never below one.
void Governor::insert_target_throttle(Job& j) {
  j.throttle_pending_since.reset();
  const auto initial = static_cast<std::uint64_t>(j.pacing.config().initial_rate_bytes_per_s);
  const std::uint64_t rate = throttle_rate_for(initial);
  const QmpCall qmp = qmp_for(j.key.domain);
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(j.id);
  auto r = plugin::insert_target_throttle(qmp, j.target, j.throttle_options, tag, rate);
  if (auto* e = std::get_if<std::string>(&r)) {
    j.throttle_off = *e;
    return;
  }
  j.throttle = std::get<TargetThrottle>(std::move(r));
  throttle::ControllerConfig c = j.pacing.config();
  c.copy_request_bytes = kQemuMirrorRequestBytes;
  j.pacing.reconfigure(c);
  set_speed(j, initial);
}

// The filter's rate for a job paced at `speed`: the job's bursts leave the filter at this rate.
std::uint64_t Governor::throttle_rate_for(std::uint64_t speed) const {
  return std::max(kMinThrottleRateBytesPerS,
                  static_cast<std::uint64_t>(kThrottleRateFactor * static_cast<double>(speed)));
}

// A new rate only when the job's speed has moved it by more than kThrottleRateHysteresis either
// way: QEMU restarts the group's buckets empty on every change, which lets out up to a tenth of a
// second's worth of requests at once.
void Governor::follow_target_throttle(Job& j) {
  const std::uint64_t want = throttle_rate_for(j.speed_set);
  const auto have = static_cast<double>(j.throttle->bytes_per_s);
  if (static_cast<double>(want) <= have * kThrottleRateHysteresis &&
      static_cast<double>(want) * kThrottleRateHysteresis >= have)
    return;
  const QmpCall qmp = qmp_for(j.key.domain);
  (void)plugin::set_target_throttle(qmp, *j.throttle, want);
}

// At ready and at the job's end QEMU's mirror has nothing in flight, so nothing waits in the
// filter when the reopen drains it.  Failures are not retried: the filter stays (at its last
// rate) until the domain stops; status says so.
void Governor::remove_target_throttle(Job& j) {
  if (!j.throttle) return;
  const QmpCall qmp = qmp_for(j.key.domain);
  try {
    if (auto e = plugin::remove_target_throttle(qmp, *j.throttle, j.throttle_options))
      j.throttle_off = "could not take the filter " + j.throttle->filter_node + " out: " + *e;
  } catch (const HypervisorDisconnected&) {
    j.throttle_off =
        "could not take the filter " + j.throttle->filter_node + " out: the connection was lost";
  }
  j.throttle.reset();
}

// Once per connection, before any job is adopted: a qcommit process killed while its filter was
// in left it there, and after the job's pivot it would keep metering the guest's own writes.
// Only domains with a cache=none/directsync disk whose node options are known can have one.
void Governor::sweep_orphan_throttles(const std::vector<DomainInfo>& doms) {
  sweep_orphans_ = false;
  for (const DomainInfo& dom : doms) {
    const auto direct = [](const DiskInfo& d) {
      return Job::direct_cache(d.cache) && d.format_options_known;
    };
    if (std::none_of(dom.disks.begin(), dom.disks.end(), direct)) continue;
    const QmpCall qmp = qmp_for(dom.name);
    const auto alive = [](long pid) {
      return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    };
    const auto options_for = [&dom](const std::string& file) -> std::optional<FormatNodeOptions> {
      for (const DiskInfo& d : dom.disks) {
        if (!d.format_options_known) continue;
        if (d.source == file || std::find(d.backing_chain.begin(), d.backing_chain.end(), file) !=
                                    d.backing_chain.end())
          return FormatNodeOptions{d.discard == "unmap" ? "unmap" : "ignore"};
      }
      return std::nullopt;
    };
    for (const std::string& line : remove_orphan_throttles(qmp, alive, options_for))
      if (opt_.notice) opt_.notice("domain " + dom.name + ": throttle filter " + line);
  }
}

}  // namespace qcommit::plugin
