// SPDX-License-Identifier: GPL-2.0-or-later
// The Writer's refcounts and cluster allocation: refcount blocks and table, free space, growth.
#include <algorithm>
#include <cstring>
#include <map>

#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/writer.h"

namespace qcommit::qcow2 {

void Writer::dirty_refblock(uint64_t off, const std::shared_ptr<std::vector<uint8_t>>& table) {
  image_.cache_.mark_dirty(off, table);
  dirty_refblocks_.insert(off);
}

void Writer::dirty_l2(uint64_t off, const std::shared_ptr<std::vector<uint8_t>>& table) {
  image_.cache_.mark_dirty(off, table);
  dirty_l2s_.insert(off);
}

uint64_t Writer::get_refcount(uint64_t cluster) {
  return image_.refcount(cluster);
}

void Writer::set_refcount(uint64_t cluster, uint64_t value) {
  if (value > geo_.refcount_max())
    throw CorruptionError(image_.name(), "refcount overflow for cluster at " + hex(cluster * cs_));
  const uint64_t per_block = geo_.refcount_block_entries();
  const uint64_t bi = cluster / per_block;
  ensure_refblock(bi);
  const Image::RefcountBlock b = image_.refcount_block(bi);
  set_refcount_entry(b.table->data(), geo_.refcount_order, cluster % per_block, value);
  dirty_refblock(b.offset, b.table);
}

void Writer::ensure_refblock(uint64_t bi) {
  if (bi >= image_.reftable_.size()) grow_reftable(bi + 1);
  if (image_.reftable_[bi] & kRefTableOffsetMask) return;
  const uint64_t c = find_free(1);
  reserved_.insert(c);
  const uint64_t off = c * cs_;
  auto fresh = std::make_shared<std::vector<uint8_t>>(cs_, 0);
  image_.cache_.put(off, fresh);
  dirty_refblock(off, fresh);
  image_.reftable_[bi] = off;
  if (!reftable_relocated_) dirty_reftable_.insert(bi);
  file_end_cluster_ = std::max(file_end_cluster_, c + 1);
  set_refcount(c, 1);  // describes itself when c lies in block bi, else recurses once
  reserved_.erase(c);
  ++allocated_clusters_;
}

void Writer::grow_reftable(uint64_t min_entries) {
  const uint64_t per_cluster = cs_ / 8;
  const uint64_t old_entries = image_.reftable_.size();
  uint64_t want = std::max(min_entries, old_entries + old_entries / 2 + 1);
  want = (want + per_cluster - 1) / per_cluster * per_cluster;
  const uint64_t clusters = want / per_cluster;
  if (clusters * cs_ > kMaxRefcountTableBytes)
    throw Error(image_.name(),
                "refcount table would exceed 8 MiB; image too large for this cluster size");
  const uint64_t t = find_free(clusters);
  for (uint64_t i = 0; i < clusters; ++i) reserved_.insert(t + i);
  file_end_cluster_ = std::max(file_end_cluster_, t + clusters);
  const uint64_t old_off = image_.header_.refcount_table_offset;
  const uint64_t old_clusters = image_.header_.refcount_table_clusters;
  image_.reftable_.resize(want, 0);
  image_.header_.refcount_table_offset = t * cs_;
  image_.header_.refcount_table_clusters = uint32_t(clusters);
  reftable_relocated_ = true;
  dirty_reftable_.clear();
  for (uint64_t i = 0; i < clusters; ++i) set_refcount(t + i, 1);
  for (uint64_t i = 0; i < clusters; ++i) reserved_.erase(t + i);
  allocated_clusters_ += clusters;
  deferred_frees_.push_back({old_off / cs_, old_clusters});
}

uint64_t Writer::find_free(uint64_t clusters) {
  uint64_t run = 0, start = 0;
  for (uint64_t c = std::max<uint64_t>(free_hint_, 1);; ++c) {
    if (c >= std::max(file_end_cluster_, refcounted_end_cluster_)) {
      // Everything past the end (and past every refcount) is free: extend the current run or
      // start one here.
      return run > 0 ? start : c;
    }
    const bool free = !reserved_.count(c) && get_refcount(c) == 0;
    if (!free) {
      run = 0;
      continue;
    }
    if (run == 0) start = c;
    if (++run == clusters) return start;
  }
}

uint64_t Writer::allocate(uint64_t clusters) {
  const uint64_t c = find_free(clusters);
  for (uint64_t i = 0; i < clusters; ++i) reserved_.insert(c + i);
  file_end_cluster_ = std::max(file_end_cluster_, c + clusters);
  for (uint64_t i = 0; i < clusters; ++i) set_refcount(c + i, 1);
  for (uint64_t i = 0; i < clusters; ++i) reserved_.erase(c + i);
  free_hint_ = c + clusters;
  allocated_clusters_ += clusters;
  return c * cs_;
}

}  // namespace qcommit::qcow2
