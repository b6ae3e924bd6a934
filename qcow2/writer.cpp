// SPDX-License-Identifier: GPL-2.0-or-later
// The Writer's guest-level changes: refusals, L2 entries, guest writes and zeroes, growing, the
// backing file name, bitmaps. Refcounts and allocation are writer_alloc.cpp's, persistence (the
// commit in its order) writer_commit.cpp's.
#include "qcow2/writer.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "qcow2/device.h"
#include "qcow2/error.h"

namespace qcommit::qcow2 {

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

}  // namespace qcommit::qcow2
