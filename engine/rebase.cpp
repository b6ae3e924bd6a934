// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/rebase.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "qcow2/error.h"
#include "qcow2/format.h"

namespace qcommit::engine {

namespace fs = std::filesystem;
using qcow2::Chain;
using qcow2::Error;
using qcow2::MapEntry;

namespace {

// Appends [start, end) to sorted, disjoint `out`, joined to the last range when they touch.
void append(std::vector<ByteRange>& out, uint64_t start, uint64_t end) {
  if (start >= end) return;
  if (!out.empty() && out.back().end == start)
    out.back().end = end;
  else
    out.push_back({start, end});
}

// Block status of [from, to) run by run; `keep` says whether a run belongs to the result.
template <class Keep>
std::vector<ByteRange> ranges_where(Chain& chain, uint64_t from, uint64_t to, size_t depth,
                                    std::optional<size_t> stop, Keep keep) {
  std::vector<ByteRange> out;
  for (uint64_t off = from; off < to;) {
    const MapEntry e = chain.status(off, to - off, depth, stop);
    if (e.length == 0) throw Error(chain.layer(depth).path, "block status made no progress");
    if (keep(e)) append(out, off, off + e.length);
    off += e.length;
  }
  return out;
}

// The new backing name of `child`: resolved by the kernel, never lexically ("link/.." is not
// "."): relative from the child's real directory when the old name was relative, else BASE's real
// path; a block device keeps the name it was given (/dev/vg/lv is stable, the /dev/dm-N it
// points to is not).
std::string backing_name_for(const std::string& child, const std::string& old, const std::string& base_path) {
  struct stat st {};
  const bool blockdev = ::stat(base_path.c_str(), &st) == 0 && S_ISBLK(st.st_mode);
  const fs::path target = blockdev ? fs::absolute(base_path) : fs::canonical(base_path);
  std::string name = !old.empty() && fs::path(old).is_relative() && !blockdev
                         ? target.lexically_relative(fs::canonical(fs::absolute(child).parent_path())).string()
                         : target.string();
  if (name.size() > qcow2::kMaxBackingNameBytes)
    throw Error(child, "cannot be rebased: the backing name '" + name + "' is longer than " +
                           std::to_string(qcow2::kMaxBackingNameBytes) + " bytes");
  return name;
}

// What the child must be given to keep its view once on BASE (nothing when it is there
// already). Computed from the chain as it is before the copy: the copy writes BASE only below
// TOP's end, and the ranges lie past it.
std::vector<ByteRange> zeros_to_keep_view(Chain& child_chain, Chain& chain, size_t base_depth) {
  const RebaseSizes sizes{child_chain.virtual_size(), chain.virtual_size(),
                          chain.layer(base_depth).virtual_size()};
  const uint64_t from = sizes.top, to = std::min(sizes.child, sizes.base);
  if (from >= to) return {};
  const auto allocated = allocated_in_top(child_chain, from, to);
  const auto nonzero = nonzero_view(chain, base_depth, from, to);
  return view_changes_on_rebase(sizes, allocated, nonzero);
}

// The child's view before the switch, for the part of a cluster its zeros do not cover: its own
// data, else TOP's view, read through the merge's chain (whose BASE is the one the copy wrote:
// the child's own opening of BASE may hold tables the copy has replaced since), else zeros.
void read_old_view(Chain& child_chain, Chain& chain, uint64_t offset, std::span<uint8_t> out) {
  const uint64_t top_size = chain.virtual_size();
  for (uint64_t pos = 0; pos < out.size();) {
    const uint64_t off = offset + pos;
    const MapEntry e = child_chain.status(off, out.size() - pos, 0, size_t{1});
    if (e.length == 0) throw Error(child_chain.top().path, "block status made no progress");
    std::span<uint8_t> piece = out.subspan(pos, e.length);
    if (e.present) {
      child_chain.read(off, piece, 0);
    } else {
      const uint64_t below_top = off < top_size ? std::min<uint64_t>(piece.size(), top_size - off) : 0;
      if (below_top) chain.read(off, piece.first(below_top), 0);
      std::fill(piece.begin() + long(below_top), piece.end(), uint8_t{0});
    }
    pos += e.length;
  }
}

}  // namespace

std::vector<ByteRange> view_changes_on_rebase(const RebaseSizes& sizes, std::span<const ByteRange> child_allocated,
                                              std::span<const ByteRange> base_nonzero) {
  const uint64_t lo = sizes.top, hi = std::min(sizes.child, sizes.base);
  std::vector<ByteRange> out;
  if (lo >= hi) return out;
  auto a = child_allocated.begin();
  for (const ByteRange& r : base_nonzero) {
    uint64_t pos = std::max(r.start, lo);
    const uint64_t end = std::min(r.end, hi);
    while (pos < end) {
      while (a != child_allocated.end() && a->end <= pos) ++a;
      if (a == child_allocated.end() || a->start >= end) {
        append(out, pos, end);
        break;
      }
      append(out, pos, std::max(pos, a->start));  // up to the child's own range
      pos = std::max(pos, a->end);
    }
  }
  return out;
}

std::vector<ByteRange> allocated_in_top(Chain& chain, uint64_t from, uint64_t to) {
  // Stopped below the top layer: `present` is set only by what the top layer itself allocates
  // (past its backing file's end an unallocated range reads as zeros, but is not present).
  return ranges_where(chain, from, to, 0, size_t{1}, [](const MapEntry& e) { return e.present; });
}

std::vector<ByteRange> nonzero_view(Chain& chain, size_t depth, uint64_t from, uint64_t to) {
  return ranges_where(chain, from, to, depth, std::nullopt, [](const MapEntry& e) { return !e.zero; });
}

RebaseTarget prepare_rebase(const std::string& child, const qcow2::ChainOptions& child_options,
                            bool rebased_before, Chain& chain, size_t base_depth) {
  const qcow2::Layer& base = chain.layer(base_depth);
  RebaseTarget t;
  t.path = child;
  t.image = qcow2::Image::open(qcow2::FileDevice::open(child, {.writable = true}));
  t.writer = std::make_unique<qcow2::Writer>(*t.image);
  t.backing_name = backing_name_for(child, t.image->backing_name().value_or(""), base.path);
  // Staged now, written at the switch: a name that does not fit in the child's header cluster
  // refuses the merge before anything is written.
  t.writer->set_backing(t.backing_name, std::string(qcow2::to_string(base.format)));
  t.writer->check_header_fits();
  if (rebased_before) return t;  // its zeros were durable before its header named BASE
  t.old_view = std::make_unique<Chain>(Chain::open(child, child_options));
  // Every child the writer accepts can be given them (zero flags, zero data in a v2 child); one
  // with an external data file, whose raw file other readers may take for the disk, was refused
  // above.
  t.zero_first = zeros_to_keep_view(*t.old_view, chain, base_depth);
  return t;
}

uint64_t switch_child(RebaseTarget& t, Chain& chain, const std::function<void(std::string_view)>& point) {
  t.writer->on_write_point = [point](qcow2::WritePoint wp) { point(qcow2::to_string(wp)); };
  uint64_t zeroed = 0;
  if (!t.zero_first.empty()) {
    const qcow2::ViewReader old_view = [&t, &chain](uint64_t o, std::span<uint8_t> out) {
      read_old_view(*t.old_view, chain, o, out);
    };
    point("child-zero");
    for (const ByteRange& r : t.zero_first) {
      t.writer->write_zeroes(r.start, r.end - r.start, old_view);
      zeroed += r.end - r.start;
    }
  }
  point("rebase");
  t.writer->commit();
  t.writer->on_write_point = nullptr;
  return zeroed;
}

}  // namespace qcommit::engine
