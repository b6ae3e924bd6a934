// SPDX-License-Identifier: GPL-2.0-or-later
// The children of TOP that a merge moves onto BASE (`--rebase`). Each is opened for writing and
// its new backing name decided before anything is written; so are the ranges where its view
// would change once it reads BASE instead of TOP. Those are made to read as zeros in the child
// itself before its header names BASE, as `qemu-img rebase` (safe mode) does: only where the
// child allocates nothing and only where BASE's view may differ from what TOP showed the child.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qcow2/chain.h"
#include "qcow2/image.h"
#include "qcow2/writer.h"

namespace qcommit::engine {

// [start, end) in guest bytes.
struct ByteRange {
  uint64_t start = 0, end = 0;
  bool operator==(const ByteRange&) const = default;
};

// Virtual sizes before the merge.
struct RebaseSizes {
  uint64_t child = 0, top = 0, base = 0;
};

// Where a child of TOP reads something else once backed by BASE after the merge. BASE then shows
// TOP's view over [0, TOP's size) and keeps its own view beyond it (BASE grows to TOP's size,
// never shrinks), while the child read zeros past TOP's end (nothing is read from a backing file
// past its end). So the view can change only in [top, min(child, base)), and there only where
// the child provides nothing itself (`child_allocated`) and BASE's view is not known to be zeros
// (`base_nonzero`). Both inputs sorted and disjoint; so is the result, adjacent ranges joined.
[[nodiscard]] std::vector<ByteRange> view_changes_on_rebase(const RebaseSizes& sizes,
                                                            std::span<const ByteRange> child_allocated,
                                                            std::span<const ByteRange> base_nonzero);

// The ranges of [from, to) that the top layer of `chain` allocates itself (data, zero flags),
// whatever its backing file shows.
[[nodiscard]] std::vector<ByteRange> allocated_in_top(qcow2::Chain& chain, uint64_t from, uint64_t to);

// The ranges of [from, to) whose view through `chain` from layer `depth` down may not read as
// zeros (block status without the zero attribute).
[[nodiscard]] std::vector<ByteRange> nonzero_view(qcow2::Chain& chain, size_t depth, uint64_t from, uint64_t to);

// A child of TOP that the switch moves onto BASE, opened for writing before the copy starts.
struct RebaseTarget {
  std::string path;
  std::unique_ptr<qcow2::Image> image;
  std::unique_ptr<qcow2::Writer> writer;  // refuses a corrupt or dirty child at construction
  std::string backing_name;               // BASE, relative if the child's old name was
  // Made to read as zeros in the child before its backing switches (view_changes_on_rebase).
  std::vector<ByteRange> zero_first;
  // The child opened read-only before the switch: its own data, which a partial cluster that
  // zero_first allocates keeps.
  std::unique_ptr<qcow2::Chain> old_view;
};

// Opens `child` (whose backing file is TOP, the top of `chain`, or already BASE when
// `rebased_before`: an interrupted run of this merge switched it, with its zeros) for writing
// and decides its zero_first ranges; a child the writer refuses (corrupt, dirty, an external data
// file) refuses the merge before anything is written. `chain` is the merge's chain with BASE at
// `base_depth`, as before the copy.
[[nodiscard]] RebaseTarget prepare_rebase(const std::string& child, const qcow2::ChainOptions& child_options,
                                          bool rebased_before, qcow2::Chain& chain, size_t base_depth);

// The switch of one child, after the copy: its zero_first ranges, then one commit that makes
// them durable before the header names BASE (data → flush → refcounts → L2 → L1 → flush →
// header). `chain` is the merge's chain (TOP's view where a partial cluster needs it). `point`
// is told before each write ("child-zero", "rebase", the writer's persistence points).
// Returns the bytes made to read as zeros.
uint64_t switch_child(RebaseTarget& target, qcow2::Chain& chain,
                      const std::function<void(std::string_view)>& point);

}  // namespace qcommit::engine
