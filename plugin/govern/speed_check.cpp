// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/speed_check.h"

#include <algorithm>

namespace qcommit::plugin {

const char* to_string(FoundBy f) {
  return f == FoundBy::kEvent ? "event" : "poll";
}

std::optional<std::string> SpeedCheck::read_back(std::uint64_t wanted_speed, bool accepted,
                                                 std::uint64_t actual_speed, std::uint64_t cur,
                                                 throttle::TimePoint at) {
  wanted = wanted_speed;
  actual = actual_speed;
  if (actual_speed == wanted_speed) {
    if (!time_to_govern) {
      time_to_govern = std::max(throttle::Duration::zero(), at - found_at);
      copied_when_governed = cur;
    }
    if (!mismatch) return std::nullopt;
    mismatch.reset();
    return "job speed now " + std::to_string(actual_speed) + " B/s in QEMU, as set";
  }
  const std::pair<std::uint64_t, std::uint64_t> m{wanted_speed, actual_speed};
  if (mismatch == m) return std::nullopt;  // the same mismatch again: logged once
  mismatch = m;
  return "job speed set to " + std::to_string(wanted_speed) + " B/s, read back as " +
         std::to_string(actual_speed) + " B/s" + (actual_speed == 0 ? " (unlimited)" : "") +
         (accepted ? " although the call succeeded" : ": the call failed") +
         "; set again at the next tick";
}

Policy capped_policy(Policy p, std::optional<double> max_rate_bytes_per_s) {
  if (max_rate_bytes_per_s) {
    p.ceiling_bytes_per_s = std::min(p.ceiling_bytes_per_s, *max_rate_bytes_per_s);
    p.floor_bytes_per_s = std::min(p.floor_bytes_per_s, p.ceiling_bytes_per_s);
  }
  return p;
}

double safe_initial_speed(const DaemonConfig& cfg, const std::optional<std::string>& policy_xml,
                          std::optional<double> max_rate_bytes_per_s) {
  const auto initial = [&](const Policy& p) {
    return capped_policy(p, max_rate_bytes_per_s).controller_config().initial_rate_bytes_per_s;
  };
  PolicyQuery q;
  q.domain_policy_xml = policy_xml;
  double least = initial(resolve_policy(cfg, q).policy);
  for (const auto& [key, p] : cfg.pools) least = std::min(least, initial(p));
  return least;
}

}  // namespace qcommit::plugin
