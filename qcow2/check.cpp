// SPDX-License-Identifier: GPL-2.0-or-later
#include "qcow2/check.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <span>

#include "qcow2/error.h"

namespace qcommit::qcow2 {

using boost::endian::load_big_u64;

namespace {
// Snapshot L1 tables are read in pieces of at most this many bytes.
inline constexpr uint64_t kSnapshotL1ChunkBytes = 1ull << 20;
// FNV-1a, 64 bits: the hash of the metadata a plan was computed from.
inline constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;
inline constexpr uint64_t kFnvPrime = 0x100000001b3ull;

// Folds the bytes [offset, offset + size) of `file` (the part inside the file) into `hash`.
uint64_t hash_region(BlockDevice& file, uint64_t offset, uint64_t size, uint64_t hash) {
  const uint64_t file_size = file.size();
  if (offset >= file_size) return hash;
  std::vector<uint8_t> buf(size_t(std::min(size, file_size - offset)));
  file.read(offset, buf);
  for (const uint8_t b : buf) hash = (hash ^ b) * kFnvPrime;
  return hash;
}
}  // namespace

PlannedState planned_state(Image& image) {
  const Header& h = image.header();
  BlockDevice& file = image.file();
  uint64_t hash = hash_region(file, 0, image.cluster_size(), kFnvOffsetBasis);
  hash = hash_region(file, h.l1_table_offset, uint64_t(h.l1_size) * 8, hash);
  hash = hash_region(file, h.refcount_table_offset,
                     uint64_t(h.refcount_table_clusters) * image.cluster_size(), hash);
  return {file.size(), hash};
}

// Step 1 of a check: counts every reference the metadata makes, compares the counts with the
// stored refcounts and lays out the repairs as a RepairPlan. Reads only.
class Checker {
 public:
  Checker(Image& img, Repair repair)
      : img_(img), geo_(img.geometry()), cs_(img.cluster_size()), repair_(repair) {
    nb_clusters_ = (img_.file().size() + cs_ - 1) / cs_;
    refs_.assign(nb_clusters_, 0);
  }

  RepairPlan run() {
    plan_.mode = repair_;
    plan_.state = planned_state(img_);
    count_references();
    compare();
    plan_repairs();
    plan_.clear_dirty_when_clean = repair_ != Repair::kNone && img_.dirty();
    plan_.findings = std::move(res_);
    return std::move(plan_);
  }

 private:
  // Every reference of the header, tables, bitmaps and encryption header, counted in refs_.
  void count_references() {
    const Header& h = img_.header();
    res_.total_clusters = guest_clusters(h.size);
    inc(0, cs_, "header");
    // Active L1 and everything below it, with COPIED checks.
    walk_l1(h.l1_table_offset, h.l1_size);
    snapshots();
    inc(h.refcount_table_offset, uint64_t(h.refcount_table_clusters) * cs_, "refcount table");
    const auto& rt = img_.refcount_table();
    for (size_t i = 0; i < rt.size(); ++i) {
      const uint64_t off = rt[i] & kRefTableOffsetMask;
      if (!off) continue;
      if (off % cs_ != 0) {
        problem(true, [&] {
          return "ERROR refcount block " + std::to_string(i) + " at " + hex(off) +
                 " is not cluster aligned";
        });
        continue;
      }
      if (off / cs_ >= nb_clusters_) {
        problem(true, [&] {
          return "ERROR refcount block " + std::to_string(i) + " at " + hex(off) +
                 " is outside the image";
        });
        bad_blocks_ = true;
        continue;
      }
      inc(off, cs_, "refcount block");
    }
    bitmaps();
    for (const auto& e : img_.extensions()) {
      if (e.type == kExtFullDiskEncryption && e.data.size() >= 16)
        inc(load_big_u64(e.data.data()), load_big_u64(e.data.data() + 8), "encryption header");
    }
  }

  // Counts a problem and keeps its message among the first kMaxCheckMessages. `msg` builds the
  // message and runs only while messages are kept: a hostile image (thousands of snapshots
  // sharing broken tables) yields millions of problems, and building each message cost most of
  // the check's time.
  // `weight`: how many references the problem stands for (snapshots sharing tables, see
  // snapshots()).
  template <typename Msg>
  void problem(bool corruption, Msg&& msg, uint64_t weight = 1) {
    if (corruption) res_.corruptions += weight;
    if (res_.messages.size() < kMaxCheckMessages) res_.messages.emplace_back(msg());
  }

  // Counts `weight` references to every cluster of [offset, offset + size).
  void inc(uint64_t offset, uint64_t size, const char* what, uint64_t weight = 1) {
    if (size == 0) return;
    if (reaches_past_file(offset, size)) {
      references_past_file_ = true;
      // The last cluster of a file may be cut short, so a region may end up to one cluster past
      // the end; one reaching further references space nobody owns (a truncated file, a forged
      // table): a corruption, as QEMU counts it, and its clusters are not counted. Were they
      // counted, refcounts that cover them would pass, and a writer trusting "past the end is
      // free" would hand them out again while a table still points at them.
      problem(
          true,
          [&] {
            return std::string("ERROR ") + what + " at " + hex(offset) + " (" + hex(size) +
                   " bytes) lies beyond end of file";
          },
          weight);
      return;
    }
    const uint64_t first = offset / cs_, last = (offset + size - 1) / cs_;
    if (last >= refs_.size()) refs_.resize(last + 1, 0);  // the cut-short cluster's rest
    for (uint64_t c = first; c <= last; ++c)
      // Saturating: a count that does not fit is wrong anyway and must not wrap to a match.
      refs_[c] = uint32_t(std::min<uint64_t>(UINT32_MAX, refs_[c] + weight));
  }

  // Whether [offset, offset + size) ends one cluster or more past the end of the file.
  [[nodiscard]] bool reaches_past_file(uint64_t offset, uint64_t size) const {
    const uint64_t file_size = img_.file().size();
    if (offset > UINT64_MAX - size) return true;
    const uint64_t end = offset + size;
    return end > file_size && end - file_size >= cs_;
  }

  // How many of `entries` 8-byte table entries at `offset` lie inside the file (the rest read as
  // zeros: they reference nothing).
  uint64_t entries_in_file(uint64_t offset, uint64_t entries) const {
    const uint64_t size = img_.file().size();
    return offset < size ? std::min(entries, (size - offset + 7) / 8) : 0;
  }

  // Counts the L2 table an L1 entry points to; false when it lies beyond the end of the file
  // (reported by inc, once, as QEMU does).
  bool count_l2_table(uint64_t l2, uint64_t weight) {
    inc(l2, cs_, "L2 table", weight);
    return !reaches_past_file(l2, cs_);
  }

  // Clusters of a virtual disk of `size` bytes, as qemu-img check counts them (QEMU keeps the size
  // in whole 512-byte sectors, a partial last sector dropped).
  [[nodiscard]] uint64_t guest_clusters(uint64_t size) const {
    return (size / 512 * 512 + cs_ - 1) / cs_;
  }

  // Whether a standard (not compressed) L2 entry allocates its guest cluster, as QEMU reads it: a
  // host offset (a zero cluster's too), or with an external data file, where offset 0 is valid,
  // the COPIED flag; a zero cluster without an offset allocates nothing.
  [[nodiscard]] bool allocates(uint64_t e) const {
    if (e & kL2OffsetMask) return true;
    return img_.has_data_file() && (e & kOflagCopied) && (geo_.extended_l2 || !(e & kOflagZero));
  }

  // One allocated guest cluster of the active tables in qemu-img check's statistics: compressed
  // clusters are all fragmented; another is when it does not follow the previous allocated
  // cluster of its L2 table in the file (`next_contiguous`, 0 at the start of each table).
  void count_guest_cluster(uint64_t host, bool compressed, uint64_t& next_contiguous) {
    ++res_.allocated_clusters;
    if (compressed) {
      ++res_.compressed_clusters;
      ++res_.fragmented_clusters;
      return;
    }
    if (next_contiguous && host != next_contiguous) ++res_.fragmented_clusters;
    next_contiguous = host + cs_;
  }

  // The active L1 table.
  void walk_l1(uint64_t l1_offset, uint64_t l1_size) {
    inc(l1_offset, l1_size * 8, "L1 table");
    if (l1_size == 0) return;
    if (l1_size * 8 > kMaxL1TableBytes || l1_offset % cs_ != 0) {
      problem(true, [&] { return "ERROR active L1 at " + hex(l1_offset) + " is invalid"; });
      return;
    }
    const uint64_t n = entries_in_file(l1_offset, l1_size);
    std::vector<uint8_t> buf(n * 8);
    img_.file().read(l1_offset, buf);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t e = load_big_u64(buf.data() + 8 * i);
      const uint64_t l2 = e & kL1OffsetMask;
      if (!l2) continue;
      if (l2 % cs_ != 0) {
        problem(true, [&] {
          return "ERROR active L1 entry " + std::to_string(i) + ": L2 table offset " + hex(l2) +
                 " is not cluster aligned";
        });
        continue;
      }
      const uint64_t rc = safe_refcount(l2 / cs_);
      if ((rc == 1) != ((e & kOflagCopied) != 0)) {
        problem(true, [&] {
          return "ERROR OFLAG_COPIED L2 cluster: l1_index=" + std::to_string(i) +
                 " l1_entry=" + hex(e) + " refcount=" + std::to_string(rc);
        });
        copied_fix_l1_.push_back({i, e});
      }
      if (count_l2_table(l2, 1)) walk_l2(l2, true, 1);
    }
  }

  // An L2 table referenced `weight` times (active: once, with the COPIED checks and the
  // statistics of allocated guest clusters).
  void walk_l2(uint64_t l2, bool active, uint64_t weight) {
    std::vector<uint8_t>& t = l2_buf_;  // one buffer for every table walked
    uint64_t next_contiguous = 0;
    t.resize(cs_);
    img_.file().read(l2, t);
    const uint64_t n = geo_.l2_entries();
    const uint64_t eb = geo_.l2_entry_bytes();
    for (uint64_t i = 0; i < n; ++i) {
      // Unused entries (all bytes zero, bitmap included) reference nothing: skip them a 64-byte
      // block at a time (a sparse 1 TiB layer has 16 M entries, nearly all zero).
      if (i % (kL2ZeroScanBytes / eb) == 0) {
        while (i + kL2ZeroScanBytes / eb <= n &&
               l2_bytes_unused(t.data() + i * eb, kL2ZeroScanBytes))
          i += kL2ZeroScanBytes / eb;
        if (i >= n) break;
      }
      const L2Entry entry = load_l2_entry(t.data(), geo_, i);
      const uint64_t e = entry.descriptor;
      if (e & kOflagCompressed) {
        const CompressedDescriptor cd = parse_compressed_l2_entry(geo_, e);
        if (e & kOflagCopied)
          problem(
              true,
              [&] {
                return "ERROR: coffset=" + hex(cd.host_offset) +
                       ": copied flag must never be set for compressed clusters";
              },
              weight);
        if (active && !img_.has_data_file() && !entry.bitmap)
          count_guest_cluster(cd.host_offset, true, next_contiguous);
        inc(cd.first_sector_offset(), cd.sector_bytes(), "compressed data", weight);
        continue;
      }
      const uint64_t host = e & kL2OffsetMask;
      if (geo_.extended_l2) {
        const SubclusterBitmap bm = SubclusterBitmap::parse(entry.bitmap);
        if (bm.contradictory() || (!host && bm.allocated))
          problem(
              true,
              [&] {
                return "ERROR invalid subcluster bitmap in L2 table at " + hex(l2) + " entry " +
                       std::to_string(i);
              },
              weight);
      }
      if (active && allocates(e)) count_guest_cluster(host, false, next_contiguous);
      if (!host || img_.has_data_file()) continue;
      if (host % cs_ != 0) {
        problem(
            true,
            [&] {
              return "ERROR offset=" + hex(host) +
                     ": Cluster is not properly aligned; L2 entry corrupted.";
            },
            weight);
        continue;
      }
      if (active) {
        const uint64_t rc = safe_refcount(host / cs_);
        if ((rc == 1) != ((e & kOflagCopied) != 0)) {
          problem(true, [&] {
            return "ERROR OFLAG_COPIED data cluster: l2_entry=" + hex(e) +
                   " refcount=" + std::to_string(rc);
          });
          copied_fix_l2_.push_back({l2, i, e});
        }
      }
      inc(host, cs_, "data cluster", weight);
    }
  }

  // Snapshots' L1 tables, walked as one: every L1 entry inside the file is read once, weighted
  // by the number of snapshot tables covering it, and every L2 table once, weighted by the
  // entries pointing at it. The counts are those of walking each table in turn, but the cost is
  // bounded by the file, not by snapshots x table size (a 1 MiB image can list 26000 snapshots
  // sharing one 1 MiB L1 table: 3e9 entries; fuzz_image found 2560 sharing broken tables).
  void snapshots() {
    const Header& h = img_.header();
    if (h.nb_snapshots == 0) return;
    std::map<std::pair<uint64_t, uint64_t>, uint64_t> tables;  // (offset, entries) -> snapshots
    uint64_t pos = h.snapshots_offset;
    for (uint32_t s = 0; s < h.nb_snapshots; ++s) {
      RawSnapshotHeader sh{};
      img_.file().read(pos, std::span<uint8_t>(reinterpret_cast<uint8_t*>(&sh), sizeof sh));
      ++tables[{sh.l1_table_offset.value(), sh.l1_size.value()}];
      uint64_t len =
          sizeof sh + sh.extra_data_size.value() + sh.id_str_size.value() + sh.name_size.value();
      pos += (len + 7) & ~uint64_t(7);
    }
    inc(h.snapshots_offset, pos - h.snapshots_offset, "snapshot table");
    std::map<uint64_t, int64_t> edges;  // file offset -> change of the number of covering tables
    for (const auto& [t, count] : tables) {
      const uint64_t offset = t.first, entries = t.second;
      inc(offset, entries * 8, "L1 table", count);
      if (entries == 0) continue;
      if (entries * 8 > kMaxL1TableBytes || offset % cs_ != 0) {
        problem(
            true, [&] { return "ERROR snapshot L1 at " + hex(offset) + " is invalid"; }, count);
        continue;
      }
      const uint64_t n = entries_in_file(offset, entries);
      if (n == 0) continue;
      edges[offset] += int64_t(count);
      edges[offset + n * 8] -= int64_t(count);
    }
    std::map<uint64_t, uint64_t> l2_weight;
    int64_t covering = 0;
    uint64_t from = 0;
    std::vector<uint8_t> buf;
    for (const auto& [at, change] : edges) {
      for (uint64_t off = from; covering > 0 && off < at;) {
        buf.resize(size_t(std::min<uint64_t>(at - off, kSnapshotL1ChunkBytes)));
        img_.file().read(off, buf);
        for (size_t k = 0; k < buf.size(); k += 8) {
          const uint64_t l2 = load_big_u64(buf.data() + k) & kL1OffsetMask;
          if (!l2) continue;
          const auto weight = uint64_t(covering);
          if (l2 % cs_ != 0) {
            problem(
                true,
                [&] {
                  return "ERROR snapshot L1 entry at " + hex(off + k) + ": L2 table offset " +
                         hex(l2) + " is not cluster aligned";
                },
                weight);
            continue;
          }
          if (count_l2_table(l2, weight)) l2_weight[l2] += weight;
        }
        off += buf.size();
      }
      covering += change;
      from = at;
    }
    for (const auto& [l2, weight] : l2_weight) walk_l2(l2, false, weight);
  }

  // Valid bitmaps: what they keep in use, by the definition the writer frees them by. A stale
  // extension (autoclear bit clear) keeps nothing in use: its clusters are leaks, as in QEMU, and
  // a repair drops the extension before freeing them.
  void bitmaps() {
    if (const auto& stale = img_.stale_bitmaps()) {
      res_.stale_bitmaps = stale->nb_bitmaps;
      if (res_.messages.size() < kMaxCheckMessages)
        res_.messages.push_back(
            "Warning: the bitmaps extension is stale (the autoclear bitmaps bit is clear: a "
            "program "
            "without bitmap support wrote the image); its " +
            std::to_string(stale->nb_bitmaps) +
            " bitmaps are ignored and their clusters are not in use");
      plan_.drop_stale_bitmaps = repair_ != Repair::kNone;
      return;
    }
    const auto bad =
        img_.visit_bitmap_extents([&](const BitmapExtent& e) { inc(e.offset, e.length, e.what); });
    if (bad) problem(true, [&] { return "ERROR " + *bad; });
  }

  // Refcount block `bi`, or none (no table) when the image has none there or it is unusable (not
  // cluster aligned, beyond the end of the file): the check reports those clusters, it does not
  // stop at them.
  Image::RefcountBlock readable_refcount_block(uint64_t bi) {
    try {
      return img_.refcount_block(bi);
    } catch (const CorruptionError&) {
      return {};
    }
  }

  uint64_t safe_refcount(uint64_t c) {
    try {
      return img_.refcount(c);
    } catch (const CorruptionError&) {
      return 0;
    }
  }

  // Compares every cluster's references with its stored refcount. Clusters of a refcount block
  // that is missing or unreadable all have refcount 0: decided once per block. (Per cluster,
  // references far beyond the end of the file cost one CorruptionError each, millions for a
  // few-KiB image: seconds of check and of merge.)
  void compare() {
    const uint64_t n = std::max<uint64_t>(refs_.size(), nb_clusters_);
    const uint64_t block_entries = geo_.refcount_block_entries();
    uint64_t seen_block = ~0ull;
    uint64_t block_offset = 0;  // of the block describing cluster c; 0: none usable
    for (uint64_t c = 0; c < n; ++c) {
      const uint64_t want = c < refs_.size() ? refs_[c] : 0;
      if (c / block_entries != seen_block) {
        seen_block = c / block_entries;
        const Image::RefcountBlock b = readable_refcount_block(seen_block);
        block_offset = b.table ? b.offset : 0;
      }
      const uint64_t have = block_offset ? safe_refcount(c) : 0;
      // As qemu-img check: the end of the last cluster referenced or with a refcount (a leak).
      if (want || have) res_.image_end_offset = (c + 1) * cs_;
      if (have != want) mismatch(c, have, want, block_offset);
    }
  }

  // Cluster `c` stores refcount `have` but has `want` references: reported, and a fix planned
  // as the repair mode allows, in the refcount block at `block_offset` (0: none usable).
  void mismatch(uint64_t c, uint64_t have, uint64_t want, uint64_t block_offset) {
    if (have > want) {
      ++res_.leaks;
      if (res_.messages.size() < kMaxCheckMessages)
        res_.messages.push_back("Leaked cluster " + std::to_string(c) + " refcount=" +
                                std::to_string(have) + " reference=" + std::to_string(want));
      if (repair_ != Repair::kNone) plan_.refcount_fixes.push_back({c, block_offset, have, want});
      return;
    }
    problem(true, [&] {
      return "ERROR cluster " + std::to_string(c) + " refcount=" + std::to_string(have) +
             " reference=" + std::to_string(want);
    });
    if (repair_ != Repair::kAll) return;
    if (want > geo_.refcount_max())
      unrepairable(c, UnrepairableRun::Why::kAboveRefcountWidth);
    else if (!block_offset)
      unrepairable(c, UnrepairableRun::Why::kRefcountBlockMissing);
    else
      plan_.refcount_fixes.push_back({c, block_offset, have, want});
  }

  // Records cluster `c` as not repairable, joined to the run of the cluster before it (clusters
  // without a refcount block can be millions: one entry each took >256 MiB).
  void unrepairable(uint64_t c, UnrepairableRun::Why why) {
    auto& runs = plan_.unrepairable;
    if (!runs.empty() && runs.back().why == why &&
        runs.back().first_cluster + runs.back().clusters == c)
      ++runs.back().clusters;
    else
      runs.push_back({c, 1, why});
  }

  // What the repair writes, once every refcount has been compared: nothing when references past
  // the end of the file went uncounted, else the refcount fixes and (kAll) the COPIED flags.
  void plan_repairs() {
    uint64_t missing = 0;
    for (const UnrepairableRun& r : plan_.unrepairable)
      if (r.why == UnrepairableRun::Why::kRefcountBlockMissing) missing += r.clusters;
    if (missing && res_.messages.size() < kMaxCheckMessages)
      res_.messages.push_back("cannot repair " + std::to_string(missing) +
                              " clusters: their refcount blocks are missing");
    if (plan_.refcount_fixes.empty() &&
        (repair_ != Repair::kAll || (copied_fix_l1_.empty() && copied_fix_l2_.empty())))
      return;
    if (references_past_file_) {
      // A table reaching past the end of the file was not counted, so the clusters it has
      // inside the file look leaked while it still names them: "repairing" them would hand
      // out clusters in use. Nothing is repaired; the corruption stays reported.
      if (res_.messages.size() < kMaxCheckMessages)
        res_.messages.push_back(
            "nothing repaired: references past the end of the file make the refcounts "
            "unreliable");
      plan_.refcount_fixes.clear();
      plan_.refused_unreliable = true;
      return;
    }
    if (repair_ == Repair::kAll) plan_copied_flags();
  }

  // The COPIED flags of the entries found wrong, as the refcounts will be once the plan's
  // refcount fixes are written: set exactly when the refcount is 1.
  void plan_copied_flags() {
    const uint64_t l1 = img_.header().l1_table_offset;
    for (const auto& [i, e] : copied_fix_l1_)
      plan_.copied_fixes.push_back({CopiedFlagFix::Table::kL1, l1, i, l1 + 8 * i, e,
                                    with_copied(e, (e & kL1OffsetMask) / cs_)});
    for (const L2Candidate& f : copied_fix_l2_)
      plan_.copied_fixes.push_back({CopiedFlagFix::Table::kL2, f.table, f.index,
                                    f.table + f.index * geo_.l2_entry_bytes(), f.entry,
                                    with_copied(f.entry, (f.entry & kL2OffsetMask) / cs_)});
  }

  [[nodiscard]] uint64_t with_copied(uint64_t entry, uint64_t cluster) {
    return refcount_after_repair(cluster) == 1 ? (entry | kOflagCopied) : (entry & ~kOflagCopied);
  }

  // The refcount of cluster `c` once the plan's refcount fixes are written (throws
  // CorruptionError when it has no readable refcount block).
  [[nodiscard]] uint64_t refcount_after_repair(uint64_t c) {
    const auto& fixes = plan_.refcount_fixes;
    const auto it =
        std::lower_bound(fixes.begin(), fixes.end(), c,
                         [](const RefcountFix& f, uint64_t v) { return f.cluster < v; });
    if (it != fixes.end() && it->cluster == c) return it->to;
    return img_.refcount(c);
  }

  // An active L2 entry whose COPIED flag disagrees with its cluster's refcount.
  struct L2Candidate {
    uint64_t table = 0;
    uint64_t index = 0;
    uint64_t entry = 0;
  };

  Image& img_;
  const Geometry geo_;
  const uint64_t cs_;
  Repair repair_;
  uint64_t nb_clusters_ = 0;
  std::vector<uint32_t> refs_;
  bool bad_blocks_ = false;
  bool references_past_file_ = false;  // some reference was not counted (see inc)
  std::vector<std::pair<uint64_t, uint64_t>> copied_fix_l1_;  // (L1 index, entry)
  std::vector<L2Candidate> copied_fix_l2_;
  std::vector<uint8_t> l2_buf_;
  CheckResult res_;
  RepairPlan plan_;
};

RepairPlan plan_repair(Image& image, Repair repair) {
  Checker c(image, repair);
  return c.run();
}

}  // namespace qcommit::qcow2
