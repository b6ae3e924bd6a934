// SPDX-License-Identifier: GPL-2.0-or-later
// A job's target where the kernel has no cachestat(2) (or --page-cache no-cachestat): the page
// cache as the pacer needs it, from what the daemon knows by construction and from QEMU's memory
// cgroup.
//   writeback: the bytes the pacer issued whose writeback has not completed (completion_clock.h);
//   dirty:     the dirty pages of QEMU's memory cgroup (memcg.h), an upper bound of the target's
//              (the guest's cached writes count too) that lags the truth by at most the kernel's
//              per-cpu stat batching (kMemcgLagPagesPerCpu pages per CPU);
//   per range: pages resident in the page cache (mincore over a read-only shared mapping, less
//              what is in flight), an upper bound of the range's dirty pages, since ranges whose
//              writeback completed are evicted (drop_cached).
// The readings count as per-file for the governor: it paces in pieces, not with fdatasync, and
// settles (one fdatasync, which restarts the kernel's expiry clock of the inode) only after a
// sweep of the whole target found nothing resident to write back.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "plugin/govern/writeback.h"

namespace qcommit::plugin {

// Pages by which a memory cgroup's dirty and writeback counts may lag per CPU (the per-cpu stat
// batch, twice: update and flush thresholds).
inline constexpr std::uint64_t kMemcgLagPagesPerCpu = 2 * 64;

// The bound by which a memcg reading may be below the truth on this host (bytes).
[[nodiscard]] std::uint64_t memcg_lag_bytes();

// Estimate and cachestat(2) truth of one whole-file reading (shadow mode).
using ShadowLog = std::function<void(const PageCacheState& estimate, const PageCacheState& truth)>;

// A TargetFile over `fd` (the target, open read-only) with QEMU's memory cgroup `memcg`.  The
// target's cached pages are dropped once at the start (pages cached earlier by other processes are
// charged to their cgroups, not QEMU's).  With `shadow`, each whole-file reading also reads
// cachestat(2) and passes both to it.
[[nodiscard]] std::unique_ptr<TargetFile> open_memcg_target(int fd, std::filesystem::path memcg,
                                                            ShadowLog shadow = {});

}  // namespace qcommit::plugin
