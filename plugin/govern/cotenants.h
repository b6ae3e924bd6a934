// SPDX-License-Identifier: GPL-2.0-or-later
// Co-tenants of an offline merge: the running guests with a disk on the same storage as the
// merge's target (BASE) — the same libvirt pool, or the same filesystem (st_dev).  Their block
// stats are the BudgetGovernor's foreground signals next to its probe (engine/foreground.h);
// the governor turns them into latency samples with throttle::IoCounterSampler, the same code
// qcommitd uses for the guests next to a block job.  Glue: no policy, no clock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/foreground.h"
#include "plugin/hypervisor/hypervisor.h"

namespace qcommit::plugin {

// The pool holding `path`: the pool of the volume with that path, else the active pool whose
// target directory contains it (longest prefix).  Throws HypervisorDisconnected.
[[nodiscard]] std::optional<PoolInfo> pool_holding(Hypervisor& hv, const std::vector<PoolInfo>& pools,
                                                   const std::string& path);

// The running domains and the list of co-tenant disks are re-read every kCotenantRescanSamples
// samples (1 s at the governor's 100 ms), and so is a lost connection retried.
inline constexpr unsigned kCotenantRescanSamples = 10;

class CotenantSource final : public engine::ForegroundSource {
 public:
  // `target`: BASE's path; `target_dev`: st_dev of its filesystem, when known.
  CotenantSource(std::unique_ptr<Hypervisor> hv, std::string target, std::optional<std::uint64_t> target_dev);

  // Connects when needed and re-reads pools and running domains.  false: unreachable (the
  // reason in last_error()).  Called once by the owner before the governor starts, then only
  // by sample(), on the governor's sampling thread.
  [[nodiscard]] bool scan();
  [[nodiscard]] std::vector<engine::ForegroundDisk> sample() override;

  [[nodiscard]] const std::optional<PoolInfo>& target_pool() const { return pool_; }
  // The co-tenant disks of the latest scan, as "domain/target".
  [[nodiscard]] std::vector<std::string> disks() const;
  [[nodiscard]] const std::string& last_error() const { return error_; }

 private:
  [[nodiscard]] bool same_storage(const DiskInfo& d);

  std::unique_ptr<Hypervisor> hv_;
  std::string target_;
  std::optional<std::uint64_t> dev_;
  std::optional<PoolInfo> pool_;
  bool pool_known_ = false;
  std::vector<PoolInfo> pools_;
  std::map<std::string, std::optional<PoolInfo>> pool_cache_;  // disk path → pool
  std::vector<std::pair<std::string, std::string>> disks_;     // (domain, target)
  unsigned since_scan_ = 0;
  std::string error_;
};

}  // namespace qcommit::plugin
