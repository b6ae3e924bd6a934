// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/policy/command_policy.h"

#include <algorithm>

#include "common/log_field.h"
#include "common/units.h"

namespace qcommit::plugin {

namespace {

// A --max-rate a policy can take: units::kMinRateBytesPerS to units::kMaxRateBytesPerS.
std::optional<std::string> max_rate_problem(std::optional<double> max_rate_bytes_per_s) {
  if (!max_rate_bytes_per_s) return std::nullopt;
  if (!(*max_rate_bytes_per_s >= units::kMinRateBytesPerS))
    return "max-rate must be >= 4K (bytes/s)";
  if (!(*max_rate_bytes_per_s <= units::kMaxRateBytesPerS))
    return "max-rate must be <= 1T (bytes/s)";
  return std::nullopt;
}

}  // namespace

Policy cap_rate(Policy p, std::optional<double> max_rate_bytes_per_s) {
  if (max_rate_bytes_per_s) {
    p.ceiling_bytes_per_s = std::min(p.ceiling_bytes_per_s, *max_rate_bytes_per_s);
    p.floor_bytes_per_s = std::min(p.floor_bytes_per_s, p.ceiling_bytes_per_s);
  }
  return p;
}

std::optional<std::string> MergePolicyInputs::validate() const {
  if (budget)
    if (auto e = units::budget_problem(*budget)) return "budget " + *e;
  return max_rate_problem(max_rate_bytes_per_s);
}

MergePolicyDecision resolve_merge_policy(const DaemonConfig& cfg, const MergePolicyInputs& in) {
  PolicyQuery q;
  q.budget_option = in.budget;
  q.domain_policy_xml = in.domain_policy_xml;
  q.pool_name = in.pool_name;
  q.pool_uuid = in.pool_uuid;
  MergePolicyDecision d;
  d.resolution = resolve_policy(cfg, q);
  d.resolution.policy = cap_rate(d.resolution.policy, in.max_rate_bytes_per_s);
  d.max_rate_bytes_per_s = in.max_rate_bytes_per_s;
  if (d.resolution.source == PolicySource::DomainMetadata)
    d.resolution.detail = "domain " + in.domain;
  if (d.resolution.metadata_error)
    d.notes.push_back("domain " + in.domain + ": " + *d.resolution.metadata_error + " (ignored)");
  return d;
}

std::optional<std::string> LivePolicyInputs::validate() const {
  if (auto e = units::budget_problem(budget)) return "budget " + *e;
  return max_rate_problem(max_rate_bytes_per_s);
}

namespace {

// --probe onto `p`; throws ConfigError "--probe VALUE: problem".
void apply_probe_option(const std::string& value, Policy& p) {
  try {
    read_probe(value, "--probe", p);
  } catch (const ConfigError&) {
    throw ConfigError("--probe " + value + ": not auto, off or a period such as 50ms");
  }
  if (auto e = p.probe_config().validate()) throw ConfigError("--probe " + value + ": " + *e);
}

}  // namespace

LivePolicy live_policy(const LivePolicyInputs& in) {
  LivePolicy lp;
  lp.config.uri = in.uri;
  Policy& p = lp.config.defaults;
  p.budget = in.budget;
  if (in.probe) apply_probe_option(*in.probe, p);
  p = cap_rate(p, in.max_rate_bytes_per_s);  // also the job's starting speed
  if (auto e = p.validate()) throw ConfigError(*e);
  lp.initial_speed_bytes_per_s = p.controller_config().initial_rate_bytes_per_s;
  return lp;
}

DaemonConfig with_overrides(DaemonConfig file, const DaemonOverrides& o) {
  if (!o.uri.empty()) file.uri = o.uri;
  if (!o.socket_path.empty()) file.socket_path = o.socket_path;
  if (auto e = file.validate()) throw ConfigError(log_field(o.config_path) + ": " + *e);
  return file;
}

}  // namespace qcommit::plugin
