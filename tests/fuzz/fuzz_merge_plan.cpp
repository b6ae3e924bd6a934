// SPDX-License-Identifier: GPL-2.0-or-later
// libFuzzer target: engine::merge of a fuzzed TOP into a small valid BASE.
// BASE (4 MiB, 64 KiB clusters, some data) is built once with the unit tests' ImageBuilder and
// copied fresh for every input; the fuzz bytes are TOP (top.qcow2, naming base.qcow2 as its
// backing file in the seed corpus). Outcomes judged by fuzz::merge_top_into_base.
#include <cstdint>
#include <vector>

#include "tests/fuzz/fuzz_merge.h"
#include "tests/unit/image_builder.h"

using namespace qcommit;

namespace {

constexpr uint64_t kBaseSize = 4u << 20;

const std::vector<uint8_t>& base_bytes() {
  static const std::vector<uint8_t> bytes = [] {
    test::ImageBuilder b(test::ImageSpec{.cluster_bits = 16, .size = kBaseSize});
    for (uint64_t c = 0; c < kBaseSize / b.cluster_size(); c += 3)
      (void)b.write_cluster(c * b.cluster_size(), uint8_t(0x40 + c));
    b.pad_to_cluster();
    return b.bytes();
  }();
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > fuzz::kMaxInputBytes) return -1;
  return fuzz::merge_top_into_base(std::span<const uint8_t>(data, size), base_bytes());
}
