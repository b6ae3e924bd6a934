// SPDX-License-Identifier: GPL-2.0-or-later
// How much room a merge still needs on BASE's storage, estimated from BASE's own tables before
// anything is written (`qcommit plan`) and again when the storage runs out (`qcommit merge`
// then says how much more it needs; the same command resumes from its checkpoint).
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "qcow2/chain.h"

namespace qcommit::engine {

struct SpaceNeed {
  uint64_t data_bytes = 0;      // clusters (raw: bytes) BASE does not hold yet for the data copied
  uint64_t metadata_bytes = 0;  // new L2 tables, refcount blocks, a larger L1 or refcount table
  // Room BASE's file already holds that the merge writes into without growing the file: clusters
  // an interrupted run left behind (its leaks and the unreferenced end of the file).
  uint64_t reusable_bytes = 0;
  // Available to the merge on BASE's filesystem (statvfs f_bavail); none for a block device.
  std::optional<uint64_t> free_bytes;

  // What the merge still has to take from the filesystem.
  [[nodiscard]] uint64_t needed() const {
    const uint64_t n = data_bytes + metadata_bytes;
    return n > reusable_bytes ? n - reusable_bytes : 0;
  }
  // How much more than is free: 0 when enough is free (or nothing is known of it).
  [[nodiscard]] uint64_t shortfall() const {
    return free_bytes && needed() > *free_bytes ? needed() - *free_bytes : 0;
  }
};

// BASE's (layer base_depth of `chain`) need for a copy of `extents` (what the layers above it
// provide, from the offset the copy starts at), BASE grown to the chain's size. With
// `count_reusable`, BASE is checked (read-only) for what an interrupted run left in its file.
[[nodiscard]] SpaceNeed space_need(qcow2::Chain& chain, size_t base_depth,
                                   const std::vector<qcow2::MapEntry>& extents,
                                   bool count_reusable);

// The same with BASE's file opened afresh, read-only: its tables as they are on disk, not as a
// writer that failed holds them.
[[nodiscard]] SpaceNeed space_need_on_disk(qcow2::Chain& chain, size_t base_depth,
                                           const std::vector<qcow2::MapEntry>& extents);

// The filesystem is full or the quota spent (ENOSPC, EDQUOT), whoever reported it.
[[nodiscard]] bool out_of_space(const std::exception& e);

}  // namespace qcommit::engine
