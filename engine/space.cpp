// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/space.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "qcow2/check.h"
#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/format.h"
#include "qcow2/image.h"

namespace qcommit::engine {

namespace {

bool holds_cluster(qcow2::SubclusterType t) {
  return t == qcow2::SubclusterType::kNormal || t == qcow2::SubclusterType::kZeroAlloc ||
         t == qcow2::SubclusterType::kUnallocatedAlloc;
}

uint64_t clusters_for(uint64_t bytes, uint64_t cluster) {
  return bytes / cluster + (bytes % cluster != 0);
}

// A qcow2 BASE: a new cluster for each cluster of data it holds no cluster for yet (compressed
// ones are rewritten), an L2 table for each L1 entry without one that data or zero flags land in
// (the grown range that BASE's backing file covers gets zero flags), a larger L1 table when BASE
// grows past its span, and the refcount blocks (and refcount table) that cover the new clusters
// at the end of the file.
SpaceNeed qcow2_need(qcow2::Image& img, const std::vector<qcow2::MapEntry>& extents,
                     uint64_t new_size, uint64_t zero_grown_end) {
  const qcow2::Geometry& g = img.geometry();
  const uint64_t cs = g.cluster_size(), span = g.l1_entry_span(), vsize = img.virtual_size();
  const std::vector<uint64_t>& l1 = img.l1_table();
  std::vector<bool> l2_new(g.l1_entries_for(std::max(new_size, vsize)), false);
  auto touch = [&](uint64_t guest) {
    const uint64_t i = guest / span;
    if (i < l2_new.size() && (i >= l1.size() || (l1[i] & qcow2::kL1OffsetMask) == 0))
      l2_new[i] = true;
  };
  SpaceNeed need;
  uint64_t last = ~0ull;  // the last cluster counted (adjacent extents share clusters)
  for (const qcow2::MapEntry& e : extents) {
    if (e.zero) {
      for (uint64_t o = g.align_down(e.start); o < e.start + e.length; o += span - o % span)
        touch(o);
      continue;
    }
    const uint64_t end = g.align_up(e.start + e.length);
    for (uint64_t c = g.align_down(e.start); c < end;) {
      const uint64_t ci = c / cs;
      if (ci == last) {
        c += cs;
        continue;
      }
      uint64_t run_end = end;
      bool held = false;
      if (c < vsize) {
        const qcow2::Run r = img.lookup(c, std::min(end, vsize) - c);
        held = holds_cluster(r.type);
        run_end = std::min(end, g.align_up(c + std::max<uint64_t>(r.length, 1)));
      }
      if (!held) {
        need.data_bytes += run_end - c;
        for (uint64_t o = c; o < run_end; o += span - o % span) touch(o);
      }
      last = (run_end - 1) / cs;
      c = run_end;
    }
  }
  for (uint64_t o = vsize; o < std::min(new_size, zero_grown_end); o += span - o % span) touch(o);
  uint64_t meta_clusters = uint64_t(std::count(l2_new.begin(), l2_new.end(), true));
  if (g.l1_entries_for(new_size) > l1.size())
    meta_clusters += clusters_for(g.l1_entries_for(new_size) * 8, cs);
  // Refcount blocks for the clusters appended past the file's end, and the table that lists them.
  const uint64_t appended = need.data_bytes / cs + meta_clusters;
  const uint64_t per_block = g.refcount_block_entries() * cs;
  const uint64_t file_end = img.file().size();
  const std::vector<uint64_t>& reftable = img.refcount_table();
  uint64_t blocks = 0, last_block = 0;
  for (uint64_t b = file_end / per_block; b <= (file_end + (appended + 1) * cs) / per_block; ++b) {
    if (b >= reftable.size() || reftable[b] == 0) ++blocks;
    last_block = b;
  }
  if (appended > 0 && last_block >= reftable.size())
    meta_clusters += clusters_for((last_block + 1) * 8, cs);
  need.metadata_bytes = (meta_clusters + blocks) * cs;
  return need;
}

// A raw BASE file: the data bytes that land in its holes or past its end.
SpaceNeed raw_need(qcow2::BlockDevice& dev, const std::vector<qcow2::MapEntry>& extents) {
  SpaceNeed need;
  for (const qcow2::MapEntry& e : extents) {
    if (e.zero) continue;
    for (uint64_t o = e.start; o < e.start + e.length;) {
      const uint64_t len = e.start + e.length - o;
      if (o >= dev.size()) {
        need.data_bytes += len;
        break;
      }
      const qcow2::AllocationRun a = dev.allocation(o, std::min(len, dev.size() - o));
      const uint64_t n = std::max<uint64_t>(1, std::min(a.length, len));
      if (!a.data) need.data_bytes += n;
      o += n;
    }
  }
  return need;
}

// What an interrupted run left in BASE's file: leaked clusters, and what is allocated of the end
// of the file past the last cluster in use (written, never referenced). The merge reuses both
// before it grows the file.
uint64_t reusable_in(qcow2::Image& img) {
  const qcow2::CheckResult r = qcow2::check(img, qcow2::Repair::kNone);
  uint64_t tail = 0;
  qcow2::BlockDevice& file = img.file();
  for (uint64_t o = r.image_end_offset; o < file.size();) {
    const qcow2::AllocationRun a = file.allocation(o, file.size() - o);
    const uint64_t n = std::max<uint64_t>(1, std::min(a.length, file.size() - o));
    if (a.data) tail += n;
    o += n;
  }
  return r.leaks * img.cluster_size() + tail;
}

std::optional<uint64_t> free_for(const std::string& base_path) {
  struct stat st {};
  if (::stat(base_path.c_str(), &st) == 0 && S_ISBLK(st.st_mode)) return std::nullopt;
  struct statvfs vfs {};
  const std::string dir = std::filesystem::absolute(base_path).parent_path().string();
  if (::statvfs(dir.c_str(), &vfs) != 0) return std::nullopt;
  return uint64_t(vfs.f_bavail) * vfs.f_frsize;
}

SpaceNeed need_for(qcow2::Image* img, qcow2::BlockDevice* raw, qcow2::Chain& chain,
                   size_t base_depth, const std::vector<qcow2::MapEntry>& extents,
                   bool count_reusable, const std::string& base_path) {
  const uint64_t new_size = chain.virtual_size();
  // Where the grown range reads BASE's backing file: it gets zero flags (merge.cpp, grow_base).
  const uint64_t below =
      chain.depth() > base_depth + 1 ? chain.layer(base_depth + 1).virtual_size() : 0;
  SpaceNeed need;
  if (img) {
    need = qcow2_need(*img, extents, new_size, below);
    if (count_reusable) need.reusable_bytes = reusable_in(*img);
  } else if (raw) {
    need = raw_need(*raw, extents);
  }
  need.free_bytes = free_for(base_path);
  if (!need.free_bytes) need = SpaceNeed{};  // a block device: nothing to allocate
  return need;
}

}  // namespace

SpaceNeed space_need(qcow2::Chain& chain, size_t base_depth,
                     const std::vector<qcow2::MapEntry>& extents, bool count_reusable) {
  qcow2::Layer& base = chain.layer(base_depth);
  if (base.qcow2 && base.qcow2->has_data_file())
    return SpaceNeed{.free_bytes = free_for(base.path)};
  return need_for(base.qcow2.get(), base.raw.get(), chain, base_depth, extents, count_reusable,
                  base.path);
}

SpaceNeed space_need_on_disk(qcow2::Chain& chain, size_t base_depth,
                             const std::vector<qcow2::MapEntry>& extents) {
  qcow2::Layer& base = chain.layer(base_depth);
  if (!base.qcow2) return space_need(chain, base_depth, extents, false);
  if (base.qcow2->has_data_file()) return SpaceNeed{.free_bytes = free_for(base.path)};
  auto img = qcow2::Image::open(qcow2::FileDevice::open(base.path));
  return need_for(img.get(), nullptr, chain, base_depth, extents, true, base.path);
}

bool out_of_space(const std::exception& e) {
  if (const auto* io = dynamic_cast<const qcow2::IoError*>(&e))
    if (io->error_number() == ENOSPC || io->error_number() == EDQUOT) return true;
  const std::string what = e.what();
  return what.find(std::strerror(ENOSPC)) != std::string::npos ||
         what.find(std::strerror(EDQUOT)) != std::string::npos;
}

}  // namespace qcommit::engine
