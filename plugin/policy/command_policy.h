// SPDX-License-Identifier: GPL-2.0-or-later
// The policy a qcommit command runs under, decided from its parsed options and what the command
// learnt from libvirt: an offline merge's (qcommit merge, qcommit plan: resolve_merge_policy) and
// the in-process governor's of qcommit live (live_policy), qcommitd's configuration with its
// command line's overrides (with_overrides).  Pure: no libvirt, no files, no
// clock; the commands gather the inputs (the configuration file, the domain's metadata, the pool
// holding BASE) and print the result.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "common/defaults.h"
#include "plugin/policy/config.h"

namespace qcommit::plugin {

// --max-rate onto a policy: the ceiling at most `max_rate_bytes_per_s`, the floor at most the
// ceiling.  Without a cap, `p` unchanged.
[[nodiscard]] Policy cap_rate(Policy p, std::optional<double> max_rate_bytes_per_s);

// What an offline merge's policy is decided from: the command line and libvirt's answers.
struct MergePolicyInputs {
  std::optional<std::chrono::nanoseconds> budget;   // --budget: beats every policy
  std::optional<double> max_rate_bytes_per_s;       // --max-rate: caps floor and ceiling
  std::string domain;                               // --domain ("" when none): names its metadata
  std::optional<std::string> domain_policy_xml;     // that domain's <qcommit:policy/>, when read
  std::optional<std::string> pool_name, pool_uuid;  // the pool holding BASE, when known

  [[nodiscard]] std::optional<std::string> validate() const;
};

// An offline merge's policy: the budget and where it came from (domain metadata, then the pool's
// section, then [default], then the built-in default; --budget beats them all), the floor and the
// ceiling from the same chain, both capped by --max-rate.
struct MergePolicyDecision {
  PolicyResolution resolution;  // detail names the domain when its metadata set the budget
  std::optional<double> max_rate_bytes_per_s;
  std::vector<std::string> notes;  // "domain vm1: <problem> (ignored)": bad metadata
};

[[nodiscard]] MergePolicyDecision resolve_merge_policy(const DaemonConfig& cfg,
                                                       const MergePolicyInputs& in);

// What qcommit live's in-process governor is configured from: its one connection and the
// built-in policy with the command line's budget, probe and rate cap.
struct LivePolicyInputs {
  std::string uri = defaults::kUri;
  std::chrono::nanoseconds budget = defaults::kBudget;  // --budget
  std::optional<std::string> probe;                     // --probe: auto, off or a period
  std::optional<double> max_rate_bytes_per_s;           // --max-rate

  [[nodiscard]] std::optional<std::string> validate() const;
};

struct LivePolicy {
  DaemonConfig config;
  double initial_speed_bytes_per_s = 0;  // the job's starting speed (within floor and ceiling)
};

// Throws ConfigError with the line to show: "--probe 5: not auto, off or a period such as 50ms",
// "--probe 1h: <the probe's bound>", or the policy's own problem ("ceiling must be >= floor").
[[nodiscard]] LivePolicy live_policy(const LivePolicyInputs& in);

// qcommitd's command line over its configuration file: -c/--connect and --socket ("": the
// file's).
struct DaemonOverrides {
  std::string config_path;  // the file, named in errors
  std::string uri, socket_path;
};

// `file` with the overrides, validated.  Throws ConfigError "<config path>: <problem>".
[[nodiscard]] DaemonConfig with_overrides(DaemonConfig file, const DaemonOverrides& o);

}  // namespace qcommit::plugin
