// SPDX-License-Identifier: GPL-2.0-or-later
// The budget, rate bounds and co-tenants of a governed offline merge (`qcommit merge`, `qcommit
// plan`), decided from the same configuration as qcommitd's per-pool policy
// (/etc/qcommit/qcommitd.conf, the domain's <qcommit:policy/> metadata) and from libvirt (the
// pool holding BASE, the running guests on BASE's storage).  Glue: the policy is
// plugin::resolve_merge_policy's (plugin/policy/command_policy.h), the co-tenant choice
// plugin::CotenantSource's.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/defaults.h"
#include "engine/budget_governor.h"
#include "plugin/policy/command_policy.h"
#include "plugin/govern/cotenants.h"
#include "plugin/host/json.h"

namespace qcommit::cli {

struct MergePolicyOptions {
  std::optional<std::chrono::nanoseconds> budget;  // --budget DURATION
  std::string config_path = defaults::kConfigPath;
  bool config_given = false;  // --config: the file must exist (the default path may be missing)
  std::string uri = defaults::kUri;
  // The user named the connection (-c) or asked for co-tenants (--cotenants on): a connection
  // that fails is an error, not co-tenant pacing silently off.
  bool libvirt_required = false;
  std::string domain;     // --domain: its metadata may override the pool's policy
  bool cotenants = true;  // --cotenants on|off
  std::optional<double> max_rate_bytes_per_s;  // --max-rate: caps the policy's floor and ceiling
};

struct MergePolicy {
  plugin::PolicyResolution resolution;
  std::string base;  // canonical
  std::string config_path;
  std::optional<plugin::PoolInfo> pool;  // the pool holding BASE
  bool libvirt_reachable = false;
  std::string libvirt_error;
  std::string cotenant_state;  // "on", "off" (--cotenants off), "unavailable" (libvirt unreachable)
  std::vector<std::string> cotenant_disks;            // at the start, "domain/target"
  std::shared_ptr<plugin::CotenantSource> cotenants;  // handed to the governor when "on"
  std::vector<std::string> notes;                     // e.g. bad domain metadata (ignored)
  std::optional<double> max_rate_bytes_per_s;         // --max-rate (the ceiling is at most it)

  // "budget 7 ms from pool policy [pool:images] in /etc/qcommit/qcommitd.conf; rate 1 MiB/s .. 1
  // GiB/s"
  [[nodiscard]] std::string budget_line() const;
  // "co-tenants: vm1/vda, vm2/vdb (block stats every 100 ms)", or why there are none.
  [[nodiscard]] std::string cotenant_line() const;
  // The same as a JSON object: {"budget-ms": 7, "budget-source": "pool-policy", ...}.
  [[nodiscard]] json::Ordered json_fields() const;
};

// The policy members of a merge without a budget (--budget off): {"budget-ms": null,
// "budget-source": "off"}.
[[nodiscard]] json::Ordered off_policy_json();

// Resolves the policy of a merge into `base`.  Throws std::runtime_error naming the
// configuration file when it is unreadable or invalid (a missing file at the default path is
// the built-in default), and naming the URI when libvirt is unreachable and o.libvirt_required.
[[nodiscard]] MergePolicy resolve_merge_policy(const MergePolicyOptions& o,
                                               const std::string& base);

// The governor of a merge into p.base: p's budget and rate bounds, the probe beside BASE, the
// co-tenants when on; its trace (if any) records TOP (when known, else not), BASE and the budget.
// Throws UsageError on an unusable configuration.
[[nodiscard]] std::shared_ptr<engine::BudgetGovernor> make_budget_governor(
    const MergePolicy& p, const std::string& trace_path, bool probe, const std::string& top = {});

// --max-rate's value: a rate (common/units.h: "50M", "1.5G", "50M/s"); at least the smallest
// floor a policy allows (4K).  Throws UsageError.
[[nodiscard]] double parse_max_rate(const std::string& s);

// The governor of a merge without a budget (--budget off) but with --max-rate: no controller,
// the copy's writes paced at that rate.
[[nodiscard]] std::shared_ptr<engine::CopyGovernor> make_rate_cap_governor(double bytes_per_s);

// The image a merge of TOP writes into: `base` when given, else TOP's backing file.
[[nodiscard]] std::string merge_base_of(const std::string& top,
                                        const std::optional<std::string>& base,
                                        const std::vector<std::string>& allowed_backing_dirs);

}  // namespace qcommit::cli
