// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/merge_checks.h"

#include <sys/stat.h>

#include <algorithm>
#include <string>
#include <vector>

#include "qcow2/check.h"
#include "qcow2/error.h"
#include "qcow2/image.h"
#include "qcow2/writer.h"

namespace qcommit::engine {

using qcow2::Chain;
using qcow2::Error;
using qcow2::Format;

// The layers merged must be consistent: with overlapping metadata (an L2 entry pointing into a
// metadata cluster, a cluster shared beyond its refcount, the L1 table used as an L2 table) the
// bytes they show are not guest data and would be copied into BASE. Leaks are harmless. A dirty
// (lazy refcounts) layer's refcounts are stale, so it is not judged by them here. BASE too,
// unless the merge repairs it anyway (dirty, or an interrupted run's leaks: `have_checkpoint`):
// its allocator trusts its refcounts, and a cluster in use with refcount 0 would be handed out
// again.
std::vector<std::string> layers_to_check(Chain& chain, size_t base_depth, bool have_checkpoint) {
  std::vector<std::string> to_check;
  for (size_t i = 0; i < base_depth; ++i) {
    qcow2::Layer& layer = chain.layer(i);
    if (layer.qcow2 && !layer.qcow2->dirty()) to_check.push_back(layer.path);
  }
  qcow2::Layer& base = chain.layer(base_depth);
  if (base.qcow2 && !base.qcow2->dirty() && !have_checkpoint) to_check.push_back(base.path);
  return to_check;
}

// Checks each layer as `qemu-img check` does, on its own read-only opening; throws
// CorruptionError for the first one with corruptions.
void check_layers(const std::vector<std::string>& to_check, const std::string& base_path) {
  for (const std::string& path : to_check) {
    auto img = qcow2::Image::open(qcow2::FileDevice::open(path));
    const auto r = qcow2::check(*img, qcow2::Repair::kNone);
    if (r.corruptions == 0) continue;
    std::string first;
    for (const auto& m : r.messages)
      if (m.rfind("ERROR", 0) == 0) {
        first = m;
        break;
      }
    throw qcow2::CorruptionError(
        path, "check found " + std::to_string(r.corruptions) + " corruptions" +
                  (first.empty() ? "" : " (" + first + ")") +
                  (path == base_path ? "; refusing to merge into it" : "; refusing to merge it"));
  }
}

// Every reason to refuse that the merge can know before it writes, checked before its first
// write (so a refused merge leaves every file byte for byte as it was, bitmaps included, and no
// checkpoint) and by plan_merge (a dry run refuses as the merge would, with the same error):
// BASE marked corrupt or with an external data file, its bitmaps' metadata inconsistent (the merge
// removes them), BASE unable to grow to TOP's size (the qcow2 L1 table limit; a raw block device
// smaller than TOP).
void refuse_before_writing(qcow2::Layer& base, uint64_t top_size) {
  if (base.qcow2) {
    qcow2::Image& img = *base.qcow2;
    if (auto why = qcow2::Writer::refusal(img)) {
      if (img.corrupt()) throw qcow2::CorruptionError(base.path, *why);
      throw qcow2::UnsupportedError(base.path, *why);
    }
    if (auto why = qcow2::Writer::grow_refusal(img, top_size))
      throw Error(base.path, *why + "; refusing to merge into it (nothing written)");
    if (auto problem = img.visit_bitmap_extents([](const qcow2::BitmapExtent&) {}))
      throw qcow2::CorruptionError(base.path, *problem);
    return;
  }
  const auto* file = dynamic_cast<const qcow2::FileDevice*>(base.raw.get());
  if (file && file->is_block_device() && file->size() < top_size)
    throw Error(base.path,
                "is a block device of " + std::to_string(file->size()) +
                    " bytes, smaller than TOP (" + std::to_string(top_size) +
                    " bytes), and cannot grow; refusing to merge into it (nothing written)");
}

// A BASE whose only copy of TOP's data the remaining deletions would leave must be consistent
// (as `qemu-img check` judges it: no corruption; leaks are harmless). A raw BASE has no metadata;
// a dirty one's refcounts are stale by design and not judged by them.
void check_base_consistent(const std::string& base_path) {
  auto img_dev = qcow2::FileDevice::open(base_path);
  if (qcow2::probe_format(*img_dev) != Format::kQcow2) return;
  auto img = qcow2::Image::open(std::move(img_dev));
  if (img->dirty()) return;
  const auto r = qcow2::check(*img, qcow2::Repair::kNone);
  if (r.corruptions > 0)
    throw qcow2::CorruptionError(base_path,
                                 "check found " + std::to_string(r.corruptions) +
                                     " corruptions; not deleting the rest of the merged layers "
                                     "(checkpoint kept)");
}

// Each name left to delete that is a file (not a symlink, whose removal loses no data) must be
// the layer the merge began with: its identity (real path, device, inode, size, mtime) one the
// checkpoint recorded. A file created at that name since, or written since, is not deleted.
void check_left_are_merged_layers(const Checkpoint& cp, const std::vector<std::string>& left) {
  const std::string recorded = " | " + cp.identity + " | ";
  for (const auto& p : left) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) continue;
    if (recorded.find(" | " + layer_identity(p) + " | ") == std::string::npos)
      throw Error(p,
                  "changed since the merge that is deleting it began (not the layer its checkpoint "
                  "recorded); not deleted, checkpoint kept");
  }
}

}  // namespace qcommit::engine
