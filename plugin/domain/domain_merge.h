// SPDX-License-Identifier: GPL-2.0-or-later
// Offline merges addressed through libvirt: a shut-off domain's disk, or a volume of a storage
// pool. A domain that is shutting down is waited for (up to merge.lock_wait, said once through
// merge.on_lock_wait); a running one is refused. The data work is engine::merge; this file resolves
// names, keeps libvirt's view true (domain definition, external snapshot metadata, pool volumes)
// and makes the whole operation re-runnable after a crash.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/merge.h"

namespace qcommit::plugin {

struct DomainMergeRequest {
  std::string uri = "qemu:///system";
  std::string domain;            // with disk: merge in a shut-off domain's chain
  std::string disk;              // target dev, e.g. vda
  std::string pool, volume;      // or: a volume of a storage pool as TOP
  std::optional<std::string> top, base;
  engine::MergeOptions merge;    // budget/governor, progress, policy (top/base/rebase filled in here)
  bool dry_run = false;
  // Builds the pacing governor once TOP is known, with BASE where it is known here (a domain's
  // chain; empty for a pool's volume: BASE then follows from TOP's chain); null: keep
  // merge.governor.
  std::function<std::shared_ptr<engine::CopyGovernor>(const std::string& top,
                                                      const std::string& base)>
      make_governor;
};

struct DomainMergeResult {
  engine::MergeResult merge;
  std::string top, base;
  bool definition_updated = false;
  std::vector<std::string> snapshot_metadata_removed;
  std::vector<std::string> pools_refreshed;
  bool finished_earlier_run = false;
  // dry_run: what the merge would do (none of it done).
  std::optional<engine::MergePlan> plan;  // the copy, when it is still to be made
  bool would_update_definition = false;   // the disk would move to BASE
  bool would_delete = false;              // the merged files would be deleted
};

// Throws qcow2::Error (one line naming the domain/file) on refusal or failure; nothing is written
// when a refusal is raised before the merge starts.
DomainMergeResult merge_domain(DomainMergeRequest req, const std::function<void(const std::string&)>& note);

}  // namespace qcommit::plugin
