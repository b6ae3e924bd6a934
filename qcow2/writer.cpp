// SPDX-License-Identifier: GPL-2.0-or-later
#include "qcow2/writer.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "qcow2/device.h"
#include "qcow2/error.h"

namespace qcommit::qcow2 {

using boost::endian::store_big_u64;

const char* to_string(WritePoint p) {
  switch (p) {
    case WritePoint::kDataFlush:
      return "data-flush";
    case WritePoint::kRefcountBlocks:
      return "refcount-blocks";
    case WritePoint::kRefcountTable:
      return "refcount-table";
    case WritePoint::kHeaderForRefcountTable:
      return "header-for-refcount-table";
    case WritePoint::kL2Tables:
      return "l2-tables";
    case WritePoint::kL1Table:
      return "l1-table";
    case WritePoint::kHeader:
      return "header";
    case WritePoint::kRefcountDecrements:
      return "refcount-decrements";
  }
  return "?";
}

namespace {
constexpr const char* kCorruptRefusal = "image is marked corrupt; refusing to write (run 'qcommit check')";
constexpr const char* kDataFileRefusal = "writing into an image with an external data file is not supported";
}  // namespace

std::optional<std::string> Writer::refusal(const Image& image) {
  if (image.corrupt()) return kCorruptRefusal;
  if (image.has_data_file()) return kDataFileRefusal;
  return std::nullopt;
}

std::optional<std::string> Writer::grow_refusal(const Image& image, uint64_t new_size) {
  if (new_size <= image.header().size) return std::nullopt;
  if (image.geometry().l1_entries_for(new_size) * 8 > kMaxL1TableBytes)
    return "cannot grow to " + std::to_string(new_size) + " bytes: L1 table would exceed 32 MiB";
  return std::nullopt;
}

Writer::Writer(Image& image)
    : image_(image), geo_(image.geometry()), cs_(image.cluster_size()), committed_(image.header()) {
  const std::string& nm = image_.name();
  if (!image_.file().writable()) throw Error(nm, "image is open read-only");
  if (image_.corrupt()) throw CorruptionError(nm, kCorruptRefusal);
  if (image_.dirty())
    throw Error(nm,
                "image is dirty (lazy refcounts were in use and it was not closed cleanly); "
                "run 'qcommit check --repair' first");
  if (image_.has_data_file()) throw UnsupportedError(nm, kDataFileRefusal);
  if (image_.header().nb_snapshots > 0 && image_.header().version == kVersion2) {
    // v2 with internal snapshots is handled like v3: refcounts tell what is shared.
  }
  file_end_cluster_ = (image_.file().size() + cs_ - 1) / cs_;
  const auto* file = dynamic_cast<const FileDevice*>(&image_.file());
  zeros_past_end_ = file && !file->is_block_device();
  find_refcounted_end();
}

// Clusters past the end of the file that still have a refcount (a file cut short after its
// tables were written; check reports the references to them) are not free: up to the last of
// them, the search for free clusters asks the refcounts, as it does inside the file, so nothing
// allocated here lands on a cluster that a table may still point to. (The file is not extended
// to cover them: one stray refcount far out must not make it huge.) A block named by several
// table entries is read once.
void Writer::find_refcounted_end() {
  const uint64_t per_block = geo_.refcount_block_entries();
  const auto& reftable = image_.reftable_;
  std::map<uint64_t, uint64_t> in_use_by_block;  // block offset -> entries in use
  for (uint64_t bi = reftable.size(); bi-- > file_end_cluster_ / per_block;) {
    const uint64_t off = reftable[bi] & kRefTableOffsetMask;
    if (!off) continue;
    auto [it, fresh] = in_use_by_block.try_emplace(off, 0);
    if (fresh) {
      const Image::RefcountBlock b = image_.refcount_block(bi);
      it->second = refcount_entries_in_use(*b.table, geo_.refcount_order, per_block);
    }
    if (it->second == 0) continue;
    refcounted_end_cluster_ = bi * per_block + it->second;
    return;  // the highest block in use decides
  }
}

bool Writer::has_staged_changes() const {
  return data_written_ || !dirty_refblocks_.empty() || !dirty_l2s_.empty() || !dirty_l1_.empty() ||
         !dirty_reftable_.empty() || l1_relocated_ || reftable_relocated_ || header_dirty_ ||
         !deferred_frees_.empty();
}

// ---------------------------------------------------------------------------------------------
// Refcounts and allocation

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

// ---------------------------------------------------------------------------------------------
// L2

Writer::ClusterState Writer::cluster_state(uint64_t guest) {
  ClusterState st;
  st.l1_index = geo_.l1_index(guest);
  st.l2_index = geo_.l2_index(guest);
  if (st.l1_index >= image_.l1_.size()) return st;
  st.l2_offset = image_.l1_[st.l1_index] & kL1OffsetMask;
  if (!st.l2_offset) return st;
  auto t = image_.l2_table(st.l2_offset, st.l1_index);
  const L2Entry e = load_l2_entry(t->data(), geo_, st.l2_index);
  st.entry = e.descriptor;
  st.bitmap = e.bitmap;
  return st;
}

std::shared_ptr<std::vector<uint8_t>> Writer::writable_l2(uint64_t guest, uint64_t& l2_offset) {
  const uint64_t l1i = geo_.l1_index(guest);
  if (l1i >= image_.l1_.size())
    throw Error(image_.name(), "write at " + hex(guest) + " beyond the L1 table");
  const uint64_t l1e = image_.l1_[l1i];
  const uint64_t old = l1e & kL1OffsetMask;
  if (old == 0) {
    l2_offset = allocate(1);
    auto t = std::make_shared<std::vector<uint8_t>>(cs_, 0);
    image_.cache_.put(l2_offset, t);
    dirty_l2(l2_offset, t);
    image_.l1_[l1i] = l2_offset | kOflagCopied;
    dirty_l1_.insert(l1i);
    return t;
  }
  auto cur = std::const_pointer_cast<std::vector<uint8_t>>(image_.l2_table(old, l1i));
  const uint64_t rc = get_refcount(old / cs_);
  if (rc == 0)
    throw CorruptionError(image_.name(),
                          "L2 table at " + hex(old) + " is in use but has refcount 0");
  if (rc == 1) {
    if (!(l1e & kOflagCopied)) {
      image_.l1_[l1i] = old | kOflagCopied;
      dirty_l1_.insert(l1i);
    }
    l2_offset = old;
    return cur;
  }
  // Shared with an internal snapshot: copy on write.
  auto copy = std::make_shared<std::vector<uint8_t>>(*cur);
  l2_offset = allocate(1);
  image_.cache_.put(l2_offset, copy);
  dirty_l2(l2_offset, copy);
  image_.l1_[l1i] = l2_offset | kOflagCopied;
  dirty_l1_.insert(l1i);
  deferred_frees_.push_back({old / cs_, 1});
  return copy;
}

void Writer::set_l2(uint64_t guest, uint64_t entry, uint64_t bitmap) {
  uint64_t l2off = 0;
  auto t = writable_l2(guest, l2off);
  store_l2_entry(t->data(), geo_, geo_.l2_index(guest), L2Entry{entry, bitmap});
  dirty_l2(l2off, t);
}

std::optional<uint64_t> Writer::private_host(const ClusterState& st) {
  if (st.entry & kOflagCompressed) return std::nullopt;
  const uint64_t host = st.entry & kL2OffsetMask;
  if (!host) return std::nullopt;
  if (get_refcount(host / cs_) != 1) return std::nullopt;
  return host;
}

void Writer::release_entry(const ClusterState& st) {
  if (st.entry & kOflagCompressed) {
    const CompressedDescriptor cd = parse_compressed_l2_entry(geo_, st.entry);
    const uint64_t first = cd.first_sector_offset();
    const uint64_t last = first + cd.sector_bytes() - 1;
    deferred_frees_.push_back({first / cs_, last / cs_ - first / cs_ + 1});
    return;
  }
  const uint64_t host = st.entry & kL2OffsetMask;
  if (host) deferred_frees_.push_back({host / cs_, 1});
}

// ---------------------------------------------------------------------------------------------
// Guest-level writes

void Writer::prepare_l2(uint64_t guest_offset) {
  uint64_t l2_offset = 0;
  (void)writable_l2(guest_offset, l2_offset);
}

std::vector<Writer::HostRun> Writer::prepare_full_write(uint64_t offset, uint64_t length) {
  const uint64_t vsize = image_.virtual_size();
  if (offset % cs_ != 0 || offset + length > vsize ||
      (length % cs_ != 0 && offset + length != vsize))
    throw Error(image_.name(), "internal: unaligned full-cluster write at " + hex(offset));
  std::vector<HostRun> runs;
  for (uint64_t c = offset; c < offset + length; c += cs_) {
    const uint64_t n = std::min(cs_, vsize - c);
    ClusterState st = cluster_state(c);
    uint64_t host;
    if (auto ph = private_host(st)) {
      host = *ph;
      const uint64_t want = host | kOflagCopied;
      const bool same = geo_.extended_l2
                            ? (st.entry == want && st.bitmap == kAllSubclustersAllocated)
                            : st.entry == want;
      if (!same) set_l2(c, want, kAllSubclustersAllocated);
    } else {
      host = allocate(1);
      set_l2(c, host | kOflagCopied, kAllSubclustersAllocated);
      release_entry(st);
    }
    if (!runs.empty() && runs.back().guest_offset + runs.back().length == c &&
        runs.back().host_offset + runs.back().length == host) {
      runs.back().length += n;
    } else {
      runs.push_back({c, n, host});
    }
  }
  data_written_ = true;
  return runs;
}

std::optional<uint64_t> Writer::prepare_in_place(uint64_t c) {
  const ClusterState st = cluster_state(c);
  const auto ph = private_host(st);
  const bool plain_normal = ph && !(st.entry & kOflagZero) &&
                            (!geo_.extended_l2 || st.bitmap == kAllSubclustersAllocated);
  if (!plain_normal) return std::nullopt;
  if (!(st.entry & kOflagCopied)) set_l2(c, st.entry | kOflagCopied, st.bitmap);
  data_written_ = true;
  return ph;
}

// A new cluster reads as zeros when it lies at or past file_end_cluster_ as it was before the
// allocation: that is past the file's end at opening and past every cluster handed out since
// (data, tables, refcount blocks: each raises it), so nothing of this run wrote there either.
// Everything the file holds past its end at opening reads as zeros once the file is extended
// (truncate, fallocate, a write further on), whatever an interrupted run did before: what such a
// run wrote is inside the file's end by the time this writer opens it.
Writer::ClusterRewrite Writer::prepare_cluster_rewrite(uint64_t c) {
  const ClusterState st = cluster_state(c);
  const auto ph = private_host(st);
  const uint64_t untouched_from = file_end_cluster_;
  const uint64_t host = ph ? *ph : allocate(1);
  set_l2(c, host | kOflagCopied, kAllSubclustersAllocated);
  if (!ph) release_entry(st);
  data_written_ = true;
  return {host, !ph && zeros_past_end_ && host / cs_ >= untouched_from};
}

void Writer::write(uint64_t offset, std::span<const uint8_t> data, const ViewReader& view) {
  const uint64_t vsize = image_.virtual_size();
  if (offset + data.size() > vsize)
    throw Error(image_.name(), "internal: write at " + hex(offset) + " beyond the virtual size");
  uint64_t pos = offset;
  const uint64_t end = offset + data.size();
  std::vector<uint8_t> buf;
  while (pos < end) {
    const uint64_t c = geo_.align_down(pos);
    const uint64_t cend = std::min(c + cs_, vsize);
    const uint64_t b = std::min(end, cend);
    auto piece = data.subspan(pos - offset, b - pos);
    if (const auto host = prepare_in_place(c)) {
      image_.data_device().write(*host + (pos - c), piece);
    } else {
      buf.assign(cend - c, 0);
      if (pos != c || b != cend) view(c, buf);  // before the cluster is staged
      std::memcpy(buf.data() + (pos - c), piece.data(), piece.size());
      image_.data_device().write(prepare_cluster_rewrite(c).host_offset, buf);
    }
    pos = b;
  }
}

void Writer::write_zeroes(uint64_t offset, uint64_t length, const ViewReader& view) {
  const uint64_t vsize = image_.virtual_size();
  const uint64_t end = std::min(vsize, offset + length);
  if (image_.header().version == kVersion2) {
    std::vector<uint8_t> zeros(std::min<uint64_t>(end - offset, 1u << 20), 0);
    for (uint64_t pos = offset; pos < end; pos += zeros.size()) {
      const uint64_t n = std::min<uint64_t>(zeros.size(), end - pos);
      write(pos, std::span<const uint8_t>(zeros.data(), n), view);
    }
    return;
  }
  const uint64_t sc = geo_.subcluster_size();
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t c = geo_.align_down(pos);
    const uint64_t cend = std::min(c + cs_, vsize);
    const uint64_t b = std::min(end, cend);
    ClusterState st = cluster_state(c);
    if (pos == c && b == cend) {
      auto ph = private_host(st);
      if (geo_.extended_l2) {
        if (ph) {
          set_l2(c, *ph | kOflagCopied, kAllSubclustersZero);
        } else {
          set_l2(c, 0, kAllSubclustersZero);
          release_entry(st);
        }
      } else if (ph) {
        set_l2(c, *ph | kOflagCopied | kOflagZero, 0);
      } else {
        set_l2(c, kOflagZero, 0);
        release_entry(st);
      }
    } else if (geo_.extended_l2 && !(st.entry & kOflagCompressed) && (pos - c) % sc == 0 &&
               ((b - c) % sc == 0 || b == cend)) {
      const uint32_t first = uint32_t((pos - c) / sc);
      const uint32_t last = uint32_t((b - c + sc - 1) / sc);  // exclusive
      uint32_t mask = 0;
      for (uint32_t i = first; i < last; ++i) mask |= 1u << i;
      SubclusterBitmap bitmap = SubclusterBitmap::parse(st.bitmap);
      bitmap.allocated &= ~mask;
      bitmap.zero |= mask;
      set_l2(c, st.entry, bitmap.encode());
    } else {
      std::vector<uint8_t> zeros(b - pos, 0);
      write(pos, zeros, view);
    }
    pos = b;
  }
}

void Writer::grow(uint64_t new_size) {
  Header& h = image_.header_;
  if (new_size <= h.size) return;
  const uint64_t need = geo_.l1_entries_for(new_size);
  if (need > image_.l1_.size()) {
    if (auto why = grow_refusal(image_, new_size)) throw Error(image_.name(), *why);
    const uint64_t clusters = (need * 8 + cs_ - 1) / cs_;
    const uint64_t old_off = h.l1_table_offset;
    const uint64_t old_clusters = (uint64_t(h.l1_size) * 8 + cs_ - 1) / cs_;
    const uint64_t t = allocate(clusters);
    image_.l1_.resize(need, 0);
    h.l1_table_offset = t;
    h.l1_size = uint32_t(need);
    l1_relocated_ = true;
    dirty_l1_.clear();
    if (old_off && old_clusters) deferred_frees_.push_back({old_off / cs_, old_clusters});
  }
  h.size = new_size;
  header_dirty_ = true;
}

void Writer::check_header_fits() {
  (void)image_.encode_header(image_.header_);
}

void Writer::set_backing(const std::optional<std::string>& name,
                         const std::optional<std::string>& format) {
  if (name && name->size() > kMaxBackingNameBytes)
    throw Error(image_.name(), "backing file name longer than 1023 bytes");
  image_.backing_name_ = name;
  image_.backing_format_ = name ? format : std::nullopt;
  auto& ex = image_.extensions_;
  ex.erase(std::remove_if(ex.begin(), ex.end(),
                          [](const Extension& e) { return e.type == kExtBackingFormat; }),
           ex.end());
  if (image_.backing_format_)
    ex.insert(ex.begin(),
              Extension{kExtBackingFormat, std::vector<uint8_t>(image_.backing_format_->begin(),
                                                                image_.backing_format_->end())});
  header_dirty_ = true;
}

size_t Writer::remove_bitmaps() {
  if (image_.stale_bitmaps_) {
    // Describes nothing (the autoclear bit is clear): nothing of it is freed, its clusters are
    // leaks at most, and some may be in use again since a check repaired them. The header
    // rewrite drops it (it is not among the extensions written back).
    image_.stale_bitmaps_.reset();
    header_dirty_ = true;
  }
  if (!image_.bitmaps_) return 0;
  std::vector<std::pair<uint64_t, uint64_t>> frees;  // (first cluster, count)
  const auto problem = image_.visit_bitmap_extents([&](const BitmapExtent& e) {
    if (e.length == 0) return;
    const uint64_t first = e.offset / cs_, last = (e.offset + e.length - 1) / cs_;
    frees.push_back({first, last - first + 1});
  });
  if (problem) throw CorruptionError(image_.name(), *problem);
  const size_t count = image_.bitmaps_->nb_bitmaps;
  // Extension and autoclear bit go with the header (step 4 of commit), the clusters after it.
  deferred_frees_.insert(deferred_frees_.end(), frees.begin(), frees.end());
  auto& ex = image_.extensions_;
  ex.erase(std::remove_if(ex.begin(), ex.end(),
                          [](const Extension& e) { return e.type == kExtBitmaps; }),
           ex.end());
  image_.bitmaps_.reset();
  image_.header_.autoclear_features &= ~kAutoclearBitmaps;
  header_dirty_ = true;
  return count;
}

// ---------------------------------------------------------------------------------------------
// Persistence

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
