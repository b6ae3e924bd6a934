// SPDX-License-Identifier: GPL-2.0-or-later
// What a merge checks before it writes (engine/merge.cpp, MergeJob): the layers it reads and BASE
// are consistent, BASE can take the copy, and an interrupted run's checkpoint still fits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "qcow2/chain.h"

namespace qcommit::engine {

// The layers merged must be consistent: with overlapping metadata (an L2 entry pointing into a
// metadata cluster, a cluster shared beyond its refcount, the L1 table used as an L2 table) the
// bytes they show are not guest data and would be copied into BASE. Leaks are harmless. A dirty
// (lazy refcounts) layer's refcounts are stale, so it is not judged by them here. BASE too,
// unless the merge repairs it anyway (dirty, or an interrupted run's leaks: `have_checkpoint`):
// its allocator trusts its refcounts, and a cluster in use with refcount 0 would be handed out
// again.
[[nodiscard]] std::vector<std::string> layers_to_check(qcow2::Chain& chain, size_t base_depth,
                                                       bool have_checkpoint);

// Checks each layer as `qemu-img check` does, on its own read-only opening; throws
// CorruptionError for the first one with corruptions.
void check_layers(const std::vector<std::string>& to_check, const std::string& base_path);

// Every reason to refuse that the merge can know before it writes, checked before its first
// write (so a refused merge leaves every file byte for byte as it was, bitmaps included, and no
// checkpoint) and by plan_merge (a dry run refuses as the merge would, with the same error):
// BASE marked corrupt or with an external data file, its bitmaps' metadata inconsistent (the merge
// removes them), BASE unable to grow to TOP's size (the qcow2 L1 table limit; a raw block device
// smaller than TOP).
void refuse_before_writing(qcow2::Layer& base, uint64_t top_size);

// A BASE whose only copy of TOP's data the remaining deletions would leave must be consistent
// (as `qemu-img check` judges it: no corruption; leaks are harmless). A raw BASE has no metadata;
// a dirty one's refcounts are stale by design and not judged by them.
void check_base_consistent(const std::string& base_path);

// Each name left to delete that is a file (not a symlink, whose removal loses no data) must be
// the layer the merge began with: its identity (real path, device, inode, size, mtime) one the
// checkpoint recorded. A file created at that name since, or written since, is not deleted.
void check_left_are_merged_layers(const Checkpoint& cp, const std::vector<std::string>& left);

}  // namespace qcommit::engine
