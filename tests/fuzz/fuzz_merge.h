// SPDX-License-Identifier: GPL-2.0-or-later
// The merge both merge fuzz targets run: TOP (fuzzed) merged into BASE (built or fuzzed) in a
// private directory, with the smallest window. Accepted outcomes: a qcow2::Error (the merge
// refused or stopped), after which TOP's guest view is what it was; or a finished merge after
// which BASE alone shows TOP's view from before. A crash, a sanitizer report, any other
// exception or a different view is a bug (abort, so libFuzzer keeps the input).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/merge.h"
#include "qcow2/chain.h"
#include "qcow2/check.h"
#include "qcow2/error.h"
#include "tests/fuzz/fuzz_util.h"

namespace qcommit::fuzz {

inline constexpr uint64_t kMaxViewBytes = 8u << 20;  // larger guest views are not compared

// The guest view of the chain from `path` (allowed backing files: `dir` only), or nullopt when
// its size is out of [min_size, kMaxViewBytes]. Throws qcow2::Error when it cannot be read.
inline std::optional<std::vector<uint8_t>> guest_view(const std::string& path,
                                                      const std::string& dir, uint64_t min_size) {
  qcow2::ChainOptions opt;
  opt.allowed_backing_dirs = {dir};
  opt.cache_bytes = 1u << 20;
  opt.max_depth = 4;
  auto chain = qcow2::Chain::open(path, opt);
  const uint64_t vsize = chain.virtual_size();
  if (vsize > kMaxViewBytes || vsize < min_size) return std::nullopt;
  std::vector<uint8_t> out(vsize);
  chain.read(0, out);
  return out;
}

inline void require_same(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                         const char* what) {
  if (std::equal(want.begin(), want.end(), got.begin())) return;
  auto [a, b] = std::mismatch(want.begin(), want.end(), got.begin());
  std::fprintf(stderr, "%s differs at guest offset %zu\n", what, size_t(a - want.begin()));
  std::abort();
}

// Returns libFuzzer's verdict: 0 (keep exploring) or -1 (input not of interest).
inline int merge_top_into_base(std::span<const uint8_t> top_bytes,
                               std::span<const uint8_t> base_bytes) {
  const std::string& dir = temp_dir();
  const std::string top = dir + "/top.qcow2", base = dir + "/base.qcow2";
  write_file(base, base_bytes);
  write_file(top, top_bytes);
  std::filesystem::remove(engine::checkpoint_path(base));
  const bool verbose = std::getenv("QCOMMIT_FUZZ_VERBOSE") != nullptr;

  // TOP's view before the merge; inputs whose view cannot be read are still merged (the merge
  // must then refuse), but huge virtual sizes are skipped (nothing to compare, too slow).
  std::optional<std::vector<uint8_t>> before;
  try {
    qcow2::ChainOptions opt;
    opt.allowed_backing_dirs = {dir};
    opt.max_depth = 4;
    auto chain = qcow2::Chain::open(top, opt);
    if (chain.virtual_size() > kMaxViewBytes) return 0;
    if (chain.depth() != 2 || chain.layer(1).path != base) return 0;  // not a TOP over our BASE
    before = guest_view(top, dir, 0);
  } catch (const qcow2::Error&) {
  }

  engine::MergeOptions mo;
  mo.top = top;
  mo.base = base;
  mo.allowed_backing_dirs = {dir};
  mo.write_mode = engine::WriteMode::kBuffered;
  mo.io_threads = 2;
  mo.inflight_bytes = engine::kChunkBytes;
  mo.window_bytes = engine::kChunkBytes;
  bool merged = false;
  try {
    (void)engine::merge(mo);
    merged = true;
  } catch (const qcow2::Error& e) {
    if (verbose) std::fprintf(stderr, "merge refused: %s\n", e.what());
  }
  if (verbose && merged)
    std::fprintf(stderr, "merged (view %s)\n", before ? "compared" : "unreadable before");
  if (!before) return 0;
  if (!merged) {
    // Refused or stopped: TOP (still there, over BASE) shows what it showed.
    std::optional<std::vector<uint8_t>> still;
    try {
      still = guest_view(top, dir, before->size());
    } catch (const qcow2::Error& e) {
      std::fprintf(stderr, "TOP cannot be read after a refused merge: %s\n", e.what());
      std::abort();
    }
    if (!still) {
      std::fprintf(stderr, "TOP's size changed after a refused merge\n");
      std::abort();
    }
    require_same(*before, *still, "TOP's view after a refused merge");
    return 0;
  }
  // Merged: BASE alone must now show what TOP showed.
  std::optional<std::vector<uint8_t>> after;
  try {
    after = guest_view(base, dir, before->size());
  } catch (const qcow2::Error& e) {
    std::fprintf(stderr, "merged BASE cannot be read: %s\n", e.what());
    std::abort();
  }
  if (!after) {
    std::fprintf(stderr, "merged BASE is smaller than TOP\n");
    std::abort();
  }
  require_same(*before, *after, "merged BASE");
  // And its metadata is consistent: the merge checked BASE before writing into it.
  try {
    auto img = qcow2::Image::open(qcow2::FileDevice::open(base));
    const auto r = qcow2::check(*img, qcow2::Repair::kNone);
    if (r.corruptions > 0) {
      std::fprintf(stderr, "merged BASE: check found %llu corruptions (%s)\n",
                   (unsigned long long)r.corruptions,
                   r.messages.empty() ? "" : r.messages.front().c_str());
      std::abort();
    }
  } catch (const qcow2::Error& e) {
    std::fprintf(stderr, "merged BASE cannot be checked: %s\n", e.what());
    std::abort();
  }
  // Beyond TOP's size (BASE larger than TOP) BASE keeps its old bytes: not compared here.
  return 0;
}

}  // namespace qcommit::fuzz
