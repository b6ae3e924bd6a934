// SPDX-License-Identifier: GPL-2.0-or-later
// libFuzzer target: engine::merge where both layers are fuzzed. The fuzz bytes are split at
// fuzz::kSeparator into TOP (top.qcow2) and BASE (base.qcow2, TOP's backing file in the seed
// corpus): BASE's header, tables, refcounts, bitmaps and snapshots are mutated too, so the merge
// must find a BASE it cannot write into safely before writing, or write into it without changing
// what TOP shows. Outcomes judged by fuzz::merge_top_into_base.
#include <cstdint>

#include "tests/fuzz/fuzz_merge.h"

using namespace qcommit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 2 * fuzz::kMaxInputBytes) return -1;
  const auto parts = fuzz::split_layers(data, size, 2);
  if (parts.size() != 2) return -1;
  return fuzz::merge_top_into_base(parts[0], parts[1]);
}
