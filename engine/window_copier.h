// SPDX-License-Identifier: GPL-2.0-or-later
// Step 6 of a merge (engine/merge.cpp): the copy of what the layers above BASE provide into BASE,
// window by window, each window committed (data, flush, refcounts, L2, L1/header) and then
// checkpointed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/merge.h"
#include "qcow2/chain.h"
#include "qcow2/writer.h"

namespace qcommit::engine {

// Copies `extents` (in guest order) from `chain` into its layer `base_layer` through
// `base_writer` (null: a raw BASE), checkpointing at `checkpoint` under `merge_identity`;
// progress counts against `total_bytes` from `started`.  Returns the bytes done (those of
// `extents`); fills the copy's figures of `result`.
[[nodiscard]] uint64_t copy_windows(const MergeOptions& options, MergeResult& result,
                                    qcow2::Chain& chain, size_t base_layer,
                                    qcow2::Writer* base_writer, const std::string& checkpoint,
                                    const std::string& merge_identity, uint64_t total_bytes,
                                    Clock::time_point started,
                                    const std::vector<qcow2::MapEntry>& extents);

}  // namespace qcommit::engine
