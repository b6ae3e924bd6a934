// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/cotenants.h"

namespace qcommit::plugin {

std::optional<PoolInfo> pool_holding(Hypervisor& hv, const std::vector<PoolInfo>& pools,
                                     const std::string& path) {
  std::optional<PoolInfo> found = hv.pool_of_volume(path);
  if (found) return found;
  size_t best = 0;
  for (const auto& p : pools) {
    if (p.target_path.empty()) continue;
    std::string prefix = p.target_path;
    if (prefix.back() != '/') prefix += '/';
    if (path.rfind(prefix, 0) == 0 && prefix.size() > best) {
      best = prefix.size();
      found = p;
    }
  }
  return found;
}

CotenantSource::CotenantSource(std::unique_ptr<Hypervisor> hv, std::string target,
                               std::optional<std::uint64_t> target_dev)
    : hv_(std::move(hv)), target_(std::move(target)), dev_(target_dev) {}

bool CotenantSource::same_storage(const DiskInfo& d) {
  if (dev_ && d.device && *dev_ == *d.device) return true;
  if (!pool_) return false;
  auto it = pool_cache_.find(d.source);
  if (it == pool_cache_.end()) it = pool_cache_.emplace(d.source, pool_holding(*hv_, pools_, d.source)).first;
  const std::optional<PoolInfo>& p = it->second;
  return p && (p->uuid.empty() || pool_->uuid.empty() ? p->name == pool_->name : p->uuid == pool_->uuid);
}

bool CotenantSource::scan() {
  since_scan_ = 0;
  try {
    if (!hv_->connected() && !hv_->connect()) {
      error_ = "cannot connect";
      disks_.clear();
      return false;
    }
    pools_ = hv_->pools();
    if (!pool_known_) {
      pool_ = pool_holding(*hv_, pools_, target_);
      pool_known_ = true;
    }
    std::vector<std::pair<std::string, std::string>> found;
    for (const auto& dom : hv_->running_domains())
      for (const auto& d : dom.disks)
        if (same_storage(d)) found.emplace_back(dom.name, d.target);
    disks_ = std::move(found);
    error_.clear();
    return true;
  } catch (const HypervisorDisconnected& e) {
    error_ = e.what();
    disks_.clear();
    return false;
  }
}

std::vector<engine::ForegroundDisk> CotenantSource::sample() {
  if (++since_scan_ >= kCotenantRescanSamples) (void)scan();
  std::vector<engine::ForegroundDisk> out;
  try {
    for (const auto& [dom, disk] : disks_) {
      if (std::optional<BlockStats> st = hv_->block_stats(dom, disk)) out.push_back({dom + "/" + disk, *st});
    }
  } catch (const HypervisorDisconnected& e) {
    error_ = e.what();
    disks_.clear();
    return {};
  }
  return out;
}

std::vector<std::string> CotenantSource::disks() const {
  std::vector<std::string> out;
  for (const auto& [dom, disk] : disks_) out.push_back(dom + "/" + disk);
  return out;
}

}  // namespace qcommit::plugin
