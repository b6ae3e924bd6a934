// SPDX-License-Identifier: GPL-2.0-or-later
// The Writer's persistence: flushes and the commit of staged changes in their order
// (data, flush, refcounts, L2, L1/header), and marking an image corrupt.
#include <algorithm>
#include <cstring>
#include <map>

#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/writer.h"

namespace qcommit::qcow2 {

using boost::endian::store_big_u64;

void Writer::point(WritePoint p) {
  if (on_write_point) on_write_point(p);
}

void Writer::flush() {
  image_.file().flush();
}

void Writer::write_tables(std::set<uint64_t>& offsets) {
  for (uint64_t off : offsets) {
    auto t =
        image_.cache_.get(off, cs_, [&](std::vector<uint8_t>& b) { image_.file().read(off, b); });
    image_.file().write(off, *t);
  }
}

void Writer::write_header(const Header& h) {
  const std::vector<uint8_t> buf = image_.encode_header(h);
  image_.file().write(0, std::span<const uint8_t>(buf.data(), buf.size()));
  committed_ = h;
}

void Writer::apply_frees() {
  for (auto [first, count] : deferred_frees_) {
    for (uint64_t c = first; c < first + count; ++c) {
      const uint64_t rc = get_refcount(c);
      if (rc == 0)
        throw CorruptionError(
            image_.name(), "freeing cluster at " + hex(c * cs_) + " whose refcount is already 0");
      set_refcount(c, rc - 1);
      if (rc == 1) free_hint_ = std::min(free_hint_, c);
    }
  }
  deferred_frees_.clear();
}

void Writer::commit() {
  if (!has_staged_changes()) return;
  BlockDevice& f = image_.file();
  // Cover every allocated cluster with file bytes (the last data cluster may be partial).
  if (f.size() < file_end_cluster_ * cs_) f.truncate(file_end_cluster_ * cs_);

  // 1. Data reaches the disk before anything points at it.
  point(WritePoint::kDataFlush);
  if (&image_.data_device() != &f) image_.data_device().flush();
  flush();

  // 2. Refcount increments: blocks (new ones describe themselves), then the table.
  point(WritePoint::kRefcountBlocks);
  write_tables(dirty_refblocks_);
  flush();
  for (uint64_t off : dirty_refblocks_) image_.cache_.mark_clean(off);
  dirty_refblocks_.clear();
  if (reftable_relocated_) {
    point(WritePoint::kRefcountTable);
    std::vector<uint8_t> t(image_.reftable_.size() * 8);
    for (size_t i = 0; i < image_.reftable_.size(); ++i)
      store_big_u64(t.data() + 8 * i, image_.reftable_[i]);
    f.write(image_.header_.refcount_table_offset, t);
    flush();
    point(WritePoint::kHeaderForRefcountTable);
    Header h = committed_;
    h.refcount_table_offset = image_.header_.refcount_table_offset;
    h.refcount_table_clusters = image_.header_.refcount_table_clusters;
    write_header(h);
    flush();
  } else if (!dirty_reftable_.empty()) {
    point(WritePoint::kRefcountTable);
    for (uint64_t i : dirty_reftable_) {
      uint8_t e[8];
      store_big_u64(e, image_.reftable_[i]);
      f.write(committed_.refcount_table_offset + 8 * i, e);
    }
    flush();
  }

  // 3. L2 tables (new ones are unreferenced until the L1 points at them).
  point(WritePoint::kL2Tables);
  write_tables(dirty_l2s_);
  flush();

  // 4. L1 table and header.
  point(WritePoint::kL1Table);
  if (l1_relocated_) {
    std::vector<uint8_t> t(image_.l1_.size() * 8);
    for (size_t i = 0; i < image_.l1_.size(); ++i) store_big_u64(t.data() + 8 * i, image_.l1_[i]);
    f.write(image_.header_.l1_table_offset, t);
    flush();
    header_dirty_ = true;
  } else {
    for (uint64_t i : dirty_l1_) {
      uint8_t e[8];
      store_big_u64(e, image_.l1_[i]);
      f.write(image_.header_.l1_table_offset + 8 * i, e);
    }
    // A header that changes what the image shows (a new backing file, a larger size) must not
    // reach the disk before the L1 entries of the tables that keep its view (the zeros a rebased
    // child or a grown BASE is given).
    if (header_dirty_ && !dirty_l1_.empty()) flush();
  }
  if (header_dirty_) {
    point(WritePoint::kHeader);
    write_header(image_.header_);
  }
  flush();

  // 5. Refcount decrements of what is no longer referenced.
  if (!deferred_frees_.empty()) {
    point(WritePoint::kRefcountDecrements);
    apply_frees();
    write_tables(dirty_refblocks_);
    flush();
  }

  for (uint64_t off : dirty_refblocks_) image_.cache_.mark_clean(off);
  for (uint64_t off : dirty_l2s_) image_.cache_.mark_clean(off);
  dirty_refblocks_.clear();
  dirty_l2s_.clear();
  dirty_l1_.clear();
  dirty_reftable_.clear();
  l1_relocated_ = reftable_relocated_ = header_dirty_ = data_written_ = false;
}

void Writer::mark_corrupt() noexcept {
  try {
    Header h = committed_;
    h.incompatible_features |= kIncompatCorrupt;
    write_header(h);
    flush();
  } catch (...) {
  }
}

}  // namespace qcommit::qcow2
