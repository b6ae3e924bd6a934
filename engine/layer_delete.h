// SPDX-License-Identifier: GPL-2.0-or-later
// What `merge --delete` checks and does once the data is merged: that BASE holds TOP's view on
// every range the merged layers provide (before anything is removed, whatever a checkpoint
// says), which names a layer's removal unlinks, and each unlink's outcome with its reason.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qcow2/chain.h"

namespace qcommit::engine {

// Guest bytes compared per read of each view.
inline constexpr uint64_t kViewCompareChunkBytes = 8ull << 20;

// The first guest offset in `extents` (what the layers above BASE provide, zero extents too)
// where BASE's view (the chain read from `base_depth`) differs from TOP's (from depth 0);
// nullopt when BASE holds TOP's view on all of them.
// `prefetch(offset, length)`, when given, is told each guest range about to be read next, while the
// one before it is compared: BASE's data, just written O_DIRECT, is read from the storage, and
// a read ahead keeps more than one request in flight.
[[nodiscard]] std::optional<uint64_t> first_view_difference(
    qcow2::Chain& chain, size_t base_depth, const std::vector<qcow2::MapEntry>& extents,
    const std::function<void(uint64_t, uint64_t)>& prefetch = nullptr);

// The names that removing the layer the chain opened at `path` unlinks, as absolute paths: the
// layer is the file the chain resolved (`real_path`); a symlink that named it is removed first
// (left behind it would dangle, and a re-run finding it gone knows TOP is done).
[[nodiscard]] std::vector<std::string> names_to_delete(const std::string& path,
                                                       const std::string& real_path);

struct NotDeleted {
  std::string path;
  std::string reason;  // strerror, or why it was left (its users)
};

// Unlinks each of `names` in order; one already gone is passed over (a re-run after a stop between
// two unlinks). `before_each` runs before each unlink (the write-point seam).
void unlink_names(const std::vector<std::string>& names, std::vector<std::string>& deleted,
                  std::vector<NotDeleted>& not_deleted,
                  const std::function<void(std::string_view)>& before_each);

}  // namespace qcommit::engine
