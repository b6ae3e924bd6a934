// SPDX-License-Identifier: GPL-2.0-or-later
// Step 2 of a check: writes a RepairPlan (check.h) to the image it was computed from, in the
// persistence order, after making sure the image is still as the plan saw it.
#include <span>
#include <string>
#include <vector>

#include "qcow2/check.h"
#include "qcow2/error.h"

namespace qcommit::qcow2 {

// Writes one plan, each step durable (flushed) before the next:
//   1. the header without its stale bitmaps extension: the only reference to clusters step 2
//      frees (a reference goes before the refcount that counts it);
//   2. the refcount blocks: leaked refcounts lowered, low ones raised (a count goes up before
//      anything relies on it);
//   3. the COPIED flags, L2 entries then L1 entries, which follow the refcounts of step 2;
//   4. the header's dirty bit, cleared last, once the rest is on disk and the image is clean.
// Nothing is written when the image changed since the plan was computed: `qcommit check` does
// not lock the image, and a program could write it between the two steps.
class RepairApplier {
 public:
  RepairApplier(Image& img, const RepairPlan& plan)
      : img_(img), plan_(plan), geo_(img.geometry()), res_(plan.findings) {}

  CheckResult run() {
    if (plan_.mode == Repair::kNone) return res_;
    refuse_if_changed();
    if (plan_.drop_stale_bitmaps) drop_stale_bitmaps();
    write_refcounts();
    write_copied_flags(CopiedFlagFix::Table::kL2);
    write_copied_flags(CopiedFlagFix::Table::kL1);
    if (plan_.clear_dirty_when_clean && res_.clean()) clear_dirty();
    return res_;
  }

 private:
  // Reads everything the plan relies on (header, L1 and refcount tables, every entry it
  // rewrites) and throws, before any write, when something differs.
  void refuse_if_changed() {
    if (planned_state(img_) != plan_.state) changed("its header, L1 table or refcount table");
    std::vector<uint8_t> block(geo_.cluster_size());
    uint64_t loaded = 0;
    for (const RefcountFix& f : plan_.refcount_fixes) {
      if (f.block_offset != loaded) img_.file().read(loaded = f.block_offset, block);
      if (refcount_entry(block.data(), geo_.refcount_order, entry_index(f)) != f.from)
        changed("the refcount of cluster " + std::to_string(f.cluster));
    }
    for (const CopiedFlagFix& f : plan_.copied_fixes) {
      if (read_entry(f.at) != f.before) changed("the table entry at " + hex(f.at));
    }
  }

  [[noreturn]] void changed(const std::string& what) const {
    throw Error(img_.name(), "the image changed since its repair was planned (" + what +
                                 "); nothing was repaired");
  }

  [[nodiscard]] uint64_t entry_index(const RefcountFix& f) const {
    return f.cluster % geo_.refcount_block_entries();
  }

  [[nodiscard]] uint64_t read_entry(uint64_t at) {
    uint8_t b[8];
    img_.file().read(at, b);
    return boost::endian::load_big_u64(b);
  }

  // Step 1: the header as it is, less the stale extension (not among the image's extensions).
  void drop_stale_bitmaps() {
    const std::vector<uint8_t> h = img_.encode_header(img_.header_);
    img_.file().write(0, std::span<const uint8_t>(h.data(), h.size()));
    img_.file().flush();
    img_.stale_bitmaps_.reset();
    res_.stale_bitmaps_dropped = true;
  }

  // Step 2: each refcount block named by the fixes read, changed and written once per run of
  // fixes in it (the fixes ascend by cluster, so a block's fixes are consecutive).
  void write_refcounts() {
    const std::vector<RefcountFix>& fixes = plan_.refcount_fixes;
    if (fixes.empty()) return;
    std::vector<uint8_t> block(geo_.cluster_size());
    for (size_t i = 0; i < fixes.size();) {
      const uint64_t at = fixes[i].block_offset;
      img_.file().read(at, block);
      for (; i < fixes.size() && fixes[i].block_offset == at; ++i) set_refcount(block, fixes[i]);
      img_.file().write(at, block);
      img_.cache_.erase(at);
    }
    img_.file().flush();
  }

  void set_refcount(std::vector<uint8_t>& block, const RefcountFix& f) {
    const uint64_t old = refcount_entry(block.data(), geo_.refcount_order, entry_index(f));
    set_refcount_entry(block.data(), geo_.refcount_order, entry_index(f), f.to);
    if (old > f.to)
      ++res_.leaks_fixed;
    else
      ++res_.corruptions_fixed;
  }

  // Step 3: the planned entries of one kind of table.
  void write_copied_flags(CopiedFlagFix::Table table) {
    bool wrote = false;
    for (const CopiedFlagFix& f : plan_.copied_fixes) {
      if (f.table != table) continue;
      uint8_t b[8];
      boost::endian::store_big_u64(b, f.after);
      img_.file().write(f.at, b);
      if (table == CopiedFlagFix::Table::kL2)
        img_.cache_.erase(f.table_offset);
      else if (f.index < img_.l1_.size())
        img_.l1_[f.index] = f.after;
      ++res_.corruptions_fixed;
      wrote = true;
    }
    if (wrote) img_.file().flush();
  }

  // Step 4: only the feature bits change; the rest of the header stays as it is on disk.
  void clear_dirty() {
    Header hd = img_.header_;
    hd.incompatible_features &= ~kIncompatDirty;
    const big_uint64_buf_t features(hd.incompatible_features);
    img_.file().write(offsetof(RawHeader, incompatible_features),
                      std::span<const uint8_t>(features.data(), sizeof features));
    img_.file().flush();
    img_.header_ = hd;
    res_.dirty_cleared = true;
  }

  Image& img_;
  const RepairPlan& plan_;
  const Geometry geo_;
  CheckResult res_;
};

CheckResult apply_repair(Image& image, const RepairPlan& plan) {
  RepairApplier a(image, plan);
  return a.run();
}

CheckResult check(Image& image, Repair repair) {
  return apply_repair(image, plan_repair(image, repair));
}

}  // namespace qcommit::qcow2
