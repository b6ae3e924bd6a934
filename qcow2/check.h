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

// One refcount a repair writes: cluster `cluster`, an entry of the refcount block at host offset
// `block_offset`, from `from` (stored when the plan was made) to `to` (the references counted).
struct RefcountFix {
  uint64_t cluster = 0;
  uint64_t block_offset = 0;
  uint64_t from = 0;
  uint64_t to = 0;
  [[nodiscard]] bool frees_leak() const { return to < from; }
};

// One L1 or L2 entry whose COPIED flag a repair rewrites: the 8 bytes at host offset `at`
// (entry `index` of the table at `table_offset`), from `before` to `after`, `after` following
// the refcount the entry's cluster has once the plan's refcount fixes are written.
struct CopiedFlagFix {
  enum class Table : uint8_t { kL1, kL2 };
  Table table = Table::kL2;
  uint64_t table_offset = 0;
  uint64_t index = 0;
  uint64_t at = 0;
  uint64_t before = 0;
  uint64_t after = 0;
};

// Consecutive clusters whose wrong refcount a repair cannot set, and why.
struct UnrepairableRun {
  enum class Why : uint8_t {
    kRefcountBlockMissing,  // no usable refcount block describes them
    kAboveRefcountWidth,    // more references than the refcount width can count
  };
  uint64_t first_cluster = 0;
  uint64_t clusters = 0;
  Why why = Why::kRefcountBlockMissing;
};

// The metadata a plan was computed from: apply_repair refuses an image whose state differs.
struct PlannedState {
  uint64_t file_size = 0;
  uint64_t metadata_hash = 0;  // header cluster, active L1 table and refcount table as on disk
  friend bool operator==(const PlannedState&, const PlannedState&) = default;
};

// What a repair of an image changes, computed by plan_repair without writing anything. The
// writes apply_repair makes are exactly these, nothing else.
struct RepairPlan {
  Repair mode = Repair::kNone;
  CheckResult findings;  // what the check found; the *_fixed counts and flags stay unset
  std::vector<RefcountFix> refcount_fixes;  // ascending by cluster: leaks freed, low counts raised
  std::vector<CopiedFlagFix> copied_fixes;  // kAll only
  std::vector<UnrepairableRun> unrepairable;
  // References past the end of the file went uncounted, so no refcount or flag is repaired
  // (clusters that look leaked may still be named by the uncounted table).
  bool refused_unreliable = false;
  bool drop_stale_bitmaps = false;      // rewrite the header without its stale bitmaps extension
  bool clear_dirty_when_clean = false;  // clear the dirty bit when the repairs leave it clean
  PlannedState state;
};

// The state of `image`'s metadata as a plan records it, read from the file.
[[nodiscard]] PlannedState planned_state(Image& image);

// Step 1 of a check: reads the metadata of `image` and returns what it found and, for `repair`
// other than kNone, what a repair would write. Never writes. Repair lowers leaked refcounts
// (kLeaks) and also raises refcounts that are too low and fixes COPIED flags (kAll); a dirty
// (lazy refcounts) image gets its dirty bit cleared once clean; a stale bitmaps extension is
// dropped from the header before its clusters are freed as leaks. Throws CorruptionError when a
// kAll repair needs a refcount that cannot be read.
[[nodiscard]] RepairPlan plan_repair(Image& image, Repair repair = Repair::kNone);

// Step 2: writes `plan` to `image` (opened writable when the plan has anything to write) in the
// persistence order, and returns the findings with what was fixed. First re-reads what the plan
// was computed from (header, L1 and refcount tables, every entry it rewrites) and throws Error,
// having written nothing, when any of it changed.
[[nodiscard]] CheckResult apply_repair(Image& image, const RepairPlan& plan);

// plan_repair then apply_repair, as `qemu-img check [-r leaks|all]`.
[[nodiscard]] CheckResult check(Image& image, Repair repair = Repair::kNone);

}  // namespace qcommit::qcow2
