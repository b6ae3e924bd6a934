// SPDX-License-Identifier: GPL-2.0-or-later
// libFuzzer target: a backing chain of 2-3 images. The fuzz bytes are split at
// fuzz::kSeparator into layer0.qcow2 (top), layer1.qcow2, layer2.qcow2 in a private directory;
// the images name their own backing files (the seed corpus has layer0 → layer1 → layer2).
// Chain::open with allowed_backing_dirs = that directory → bounded map() → read() of a few
// ranges. qcow2::Error is accepted; anything else is a bug.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "qcow2/chain.h"
#include "qcow2/error.h"
#include "tests/fuzz/fuzz_util.h"

using namespace qcommit;
using namespace qcommit::fuzz;

namespace {
constexpr uint64_t kMaxMapBytes = 8u << 20;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 3 * kMaxInputBytes) return -1;
  const std::string& dir = temp_dir();
  auto parts = split_layers(data, size, 3);
  for (size_t i = 0; i < 3; ++i) {
    const std::string p = dir + "/layer" + std::to_string(i) + ".qcow2";
    if (i < parts.size()) write_file(p, parts[i]);
    else std::filesystem::remove(p);
  }
  try {
    qcow2::ChainOptions opt;
    opt.allowed_backing_dirs = {dir};
    opt.cache_bytes = 1u << 20;
    opt.max_depth = 8;
    auto chain = qcow2::Chain::open(dir + "/layer0.qcow2", opt);
    const uint64_t vsize = chain.virtual_size();
    try {
      auto m = chain.map(0, std::min(vsize, kMaxMapBytes));
      uint64_t expect = 0;
      for (const auto& e : m) {
        if (e.start != expect || e.length == 0) std::abort();  // map must tile the range
        expect += e.length;
      }
      if (expect != std::min(vsize, kMaxMapBytes)) std::abort();
    } catch (const qcow2::Error&) {
    }
    std::vector<uint8_t> buf(64u << 10);
    for (uint64_t off : {uint64_t{0}, vsize / 2, vsize > 4096 ? vsize - 4096 : 0, vsize}) {
      try {
        chain.read(off, buf);
      } catch (const qcow2::Error&) {
      }
    }
  } catch (const qcow2::Error&) {
  }
  return 0;
}
