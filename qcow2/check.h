// SPDX-License-Identifier: GPL-2.0-or-later
// Consistency check of one qcow2 image, in the manner of `qemu-img check`: every reference from
// the header, L1/L2 tables (active and internal snapshots), refcount structures and bitmaps is
// counted and compared with the stored refcounts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qcow2/image.h"

namespace qcommit::qcow2 {

enum class Repair : uint8_t { kNone, kLeaks, kAll };

struct CheckResult {
  uint64_t corruptions = 0;         // refcount lower than references, bad offsets, COPIED errors
  uint64_t leaks = 0;               // clusters with refcount higher than their references
  uint64_t corruptions_fixed = 0;
  uint64_t leaks_fixed = 0;
  // Statistics of the active L1/L2 tables, as qemu-img check reports them: guest clusters
  // allocated (data, compressed, zero with an allocation), those compressed, and those fragmented
  // (compressed, or not next in the file to the previous allocated cluster of their L2 table).
  uint64_t allocated_clusters = 0;
  uint64_t fragmented_clusters = 0;
  uint64_t compressed_clusters = 0;
  uint64_t total_clusters = 0;      // clusters of the virtual disk
  uint64_t image_end_offset = 0;    // end of the last cluster referenced or with a refcount
  std::vector<std::string> messages;  // first kMaxCheckMessages problems
  bool dirty_cleared = false;
  uint32_t stale_bitmaps = 0;          // bitmaps of a stale extension (ignored, see Image::bitmaps())
  bool stale_bitmaps_dropped = false;  // repair removed that extension from the header
  [[nodiscard]] bool clean() const { return corruptions == corruptions_fixed && leaks == leaks_fixed; }
};

inline constexpr size_t kMaxCheckMessages = 100;

// Checks `image` (opened writable when repair != kNone). Repair lowers leaked refcounts
// (kLeaks) and also raises refcounts that are too low and fixes COPIED flags (kAll); a dirty
// (lazy refcounts) image is repaired and its dirty bit cleared; a stale bitmaps extension is
// dropped from the header before its clusters are freed as leaks.
[[nodiscard]] CheckResult check(Image& image, Repair repair = Repair::kNone);

}  // namespace qcommit::qcow2
