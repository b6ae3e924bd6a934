// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/merge_policy.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>

#include "cli/json.h"
#include "cli/options.h"
#include "cli/units.h"
#include "plugin/hypervisor/libvirt_hypervisor.h"
#include "qcow2/chain.h"
#include "throttle/pacer.h"

namespace qcommit::cli {

namespace fs = std::filesystem;

namespace {

std::string ms_text(std::chrono::nanoseconds d) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", std::chrono::duration<double, std::milli>(d).count());
  return b;
}

std::string source_text(const plugin::PolicyResolution& r) {
  switch (r.source) {
    case plugin::PolicySource::Option:
      return "from --budget";
    case plugin::PolicySource::DomainMetadata:
      return "from the metadata of " + r.detail;
    case plugin::PolicySource::PoolPolicy:
      return "from pool policy " + r.detail;
    case plugin::PolicySource::DefaultPolicy:
      return "from the default policy " + r.detail;
    case plugin::PolicySource::BuiltIn:
      return "(" + r.detail + ")";
  }
  return "";
}

}  // namespace

std::string merge_base_of(const std::string& top, const std::optional<std::string>& base,
                          const std::vector<std::string>& allowed_backing_dirs) {
  if (base) return *base;
  qcow2::ChainOptions o;
  o.allowed_backing_dirs = allowed_backing_dirs;
  const qcow2::Chain chain = qcow2::Chain::open(top, o);
  // A TOP without a backing file: the merge itself refuses it with its own message.
  return chain.depth() > 1 ? chain.layer(1).path : top;
}

MergePolicy resolve_merge_policy(const MergePolicyOptions& o, const std::string& base) {
  MergePolicy p;
  std::error_code ec;
  const fs::path canon = fs::weakly_canonical(fs::absolute(base), ec);
  p.base = ec ? base : canon.string();
  p.config_path = o.config_path;
  plugin::DaemonConfig cfg;
  try {
    cfg = plugin::load_config(o.config_path, !o.config_given);
  } catch (const plugin::ConfigError& e) {
    throw std::runtime_error(e.what());
  }

  plugin::MergePolicyInputs in;
  in.budget = o.budget;
  in.max_rate_bytes_per_s = o.max_rate_bytes_per_s;
  in.domain = o.domain;
  auto hv = std::make_unique<plugin::LibvirtHypervisor>(o.uri);
  p.libvirt_reachable = hv->connect();
  if (!p.libvirt_reachable) p.libvirt_error = hv->last_error();
  if (p.libvirt_reachable && !o.domain.empty()) {
    try {
      if (auto dom = hv->domain(o.domain)) in.domain_policy_xml = dom->policy_xml;
    } catch (const plugin::HypervisorDisconnected& e) {
      p.libvirt_reachable = false;
      p.libvirt_error = e.what();
    }
  }
  std::optional<std::uint64_t> dev;
  struct stat sb {};
  if (::stat(p.base.c_str(), &sb) == 0) dev = static_cast<std::uint64_t>(sb.st_dev);
  auto src = std::make_shared<plugin::CotenantSource>(std::move(hv), p.base, dev);
  if (p.libvirt_reachable && !src->scan()) {
    p.libvirt_reachable = false;
    p.libvirt_error = src->last_error();
  }
  if (!p.libvirt_reachable && o.libvirt_required && o.cotenants)
    throw std::runtime_error("libvirt " + o.uri + ": " +
                             (p.libvirt_error.empty() ? "cannot connect" : p.libvirt_error) +
                             " (the co-tenants' block stats need it; --cotenants off goes without)");
  if (p.libvirt_reachable) {
    p.pool = src->target_pool();
    if (p.pool) {
      in.pool_name = p.pool->name;
      if (!p.pool->uuid.empty()) in.pool_uuid = p.pool->uuid;
    }
  }
  if (auto e = in.validate()) throw UsageError(*e);
  plugin::MergePolicyDecision d = plugin::resolve_merge_policy(cfg, in);
  p.resolution = std::move(d.resolution);
  p.max_rate_bytes_per_s = d.max_rate_bytes_per_s;
  p.notes = std::move(d.notes);
  if (!o.cotenants) {
    p.cotenant_state = "off";
  } else if (!p.libvirt_reachable) {
    p.cotenant_state = "unavailable";
  } else {
    p.cotenant_state = "on";
    p.cotenant_disks = src->disks();
    p.cotenants = src;
  }
  return p;
}

std::string MergePolicy::budget_line() const {
  const plugin::Policy& pol = resolution.policy;
  std::string s = "budget " + ms_text(pol.budget) + " ms " + source_text(resolution);
  s += "; rate " + format_size(static_cast<uint64_t>(pol.floor_bytes_per_s)) + "/s .. " +
       format_size(static_cast<uint64_t>(pol.ceiling_bytes_per_s)) + "/s";
  if (max_rate_bytes_per_s) s += " (--max-rate)";
  if (pool) s += "; BASE in pool " + pool->name;
  return s;
}

std::string MergePolicy::cotenant_line() const {
  if (cotenant_state == "off") return "co-tenants: off (--cotenants off)";
  if (cotenant_state == "unavailable")
    return "co-tenants: off, libvirt unreachable (" +
           (libvirt_error.empty() ? "cannot connect" : libvirt_error) + ")";
  if (cotenant_disks.empty())
    return "co-tenants: none running on BASE's storage now (a merge re-checks every second)";
  std::string s = "co-tenants:";
  for (size_t i = 0; i < cotenant_disks.size(); ++i) s += (i ? ", " : " ") + cotenant_disks[i];
  return s + " (their block stats join the probe)";
}

json::Ordered MergePolicy::json_fields() const {
  const plugin::Policy& pol = resolution.policy;
  const std::string libvirt = libvirt_reachable       ? "connected"
                              : libvirt_error.empty() ? "unreachable"
                                                      : libvirt_error;
  return json::Ordered{
      {"budget-ms", quantity(std::chrono::duration<double, std::milli>(pol.budget).count())},
      {"budget-source", plugin::to_string(resolution.source)},
      {"budget-detail", resolution.detail},
      {"floor", whole(pol.floor_bytes_per_s)},
      {"ceiling", whole(pol.ceiling_bytes_per_s)},
      {"max-rate", max_rate_bytes_per_s ? json::Ordered(whole(*max_rate_bytes_per_s))
                                        : json::Ordered(nullptr)},
      {"pool", pool ? json::Ordered(pool->name) : json::Ordered(nullptr)},
      {"config", config_path},
      {"libvirt", libvirt},
      {"cotenants", cotenant_state},
      {"cotenant-disks", cotenant_disks}};
}

json::Ordered off_policy_json() {
  return json::Ordered{{"budget-ms", nullptr}, {"budget-source", "off"}};
}

std::shared_ptr<engine::BudgetGovernor> make_budget_governor(const MergePolicy& p,
                                                             const std::string& trace_path,
                                                             bool probe, const std::string& top) {
  const plugin::Policy& pol = p.resolution.policy;
  engine::BudgetGovernorConfig cfg;
  cfg.budget = pol.budget;
  cfg.controller.floor_rate_bytes_per_s = pol.floor_bytes_per_s;
  cfg.controller.ceiling_rate_bytes_per_s = pol.ceiling_bytes_per_s;
  cfg.controller.initial_rate_bytes_per_s =
      std::clamp(engine::kInitialRateBytesPerS, pol.floor_bytes_per_s, pol.ceiling_bytes_per_s);
  if (probe) cfg.probe_dir = fs::path(p.base).parent_path().string();
  cfg.trace_path = trace_path;
  if (!top.empty()) cfg.trace_params.emplace_back("top", top);
  cfg.trace_params.emplace_back("base", p.base);
  if (p.cotenant_state == "on") cfg.cotenants = p.cotenants;
  if (auto err = cfg.validate(); !err.empty()) throw UsageError(err);
  return std::make_shared<engine::BudgetGovernor>(cfg);
}

double parse_max_rate(const std::string& s) { return parse_rate(s, "--max-rate"); }

namespace {

// A fixed rate: each write waits for its bytes' turn (throttle::Pacer), whatever the latency.
class RateCapGovernor final : public engine::CopyGovernor {
 public:
  explicit RateCapGovernor(double bytes_per_s) : pacer_(bytes_per_s) {}
  engine::Duration admit(engine::Clock::time_point now, uint64_t bytes, uint64_t) override {
    std::lock_guard lk(mu_);
    const throttle::TimePoint t(std::chrono::duration_cast<throttle::Duration>(now - epoch_));
    const throttle::Duration wait = pacer_.wait_for(t, bytes);  // the engine asks again after it
    if (wait > throttle::Duration::zero()) return wait;
    (void)pacer_.reserve(t, bytes);
    return engine::Duration::zero();
  }
  void completed(engine::Clock::time_point, uint64_t, engine::Duration) override {}

 private:
  std::mutex mu_;
  const engine::Clock::time_point epoch_ = engine::Clock::now();
  throttle::Pacer pacer_;
};

}  // namespace

std::shared_ptr<engine::CopyGovernor> make_rate_cap_governor(double bytes_per_s) {
  return std::make_shared<RateCapGovernor>(bytes_per_s);
}

}  // namespace qcommit::cli
