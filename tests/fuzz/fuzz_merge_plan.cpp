// libFuzzer target: engine::merge of a fuzzed TOP into a small valid BASE.
// BASE (4 MiB, 64 KiB clusters, some data) is built once with the unit tests' ImageBuilder and
// copied fresh for every input; the fuzz bytes are TOP (top.qcow2, naming base.qcow2 as its
// backing file in the seed corpus). The merge runs with the smallest window. Accepted outcomes:
// a qcow2::Error, or a BASE whose guest view equals TOP's view before the merge. A crash, a
// sanitizer report, any other exception or a different view is a bug.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <vector>

#include "engine/merge.h"
#include "qcow2/chain.h"
#include "qcow2/error.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/unit/image_builder.h"

using namespace qcommit;
using namespace qcommit::fuzz;

namespace {

constexpr uint64_t kBaseSize = 4u << 20;
constexpr uint64_t kMaxViewBytes = 8u << 20;  // TOP may be larger than BASE, up to this

const std::vector<uint8_t>& base_bytes() {
  static const std::vector<uint8_t> bytes = [] {
    test::ImageBuilder b(test::ImageSpec{.cluster_bits = 16, .size = kBaseSize});
    for (uint64_t c = 0; c < kBaseSize / b.cluster_size(); c += 3) (void)b.write_cluster(c * b.cluster_size(), uint8_t(0x40 + c));
    b.pad_to_cluster();
    return b.bytes();
  }();
  return bytes;
}

std::optional<std::vector<uint8_t>> view(const std::string& path, const std::string& dir, uint64_t min_size) {
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxInputBytes) return -1;
  const std::string& dir = temp_dir();
  const std::string top = dir + "/top.qcow2", base = dir + "/base.qcow2";
  write_file(base, base_bytes());
  write_file(top, std::span<const uint8_t>(data, size));
  std::filesystem::remove(engine::checkpoint_path(base));

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
    before = view(top, dir, 0);
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
    if (std::getenv("QCOMMIT_FUZZ_VERBOSE")) std::fprintf(stderr, "merge refused: %s\n", e.what());
  }
  if (std::getenv("QCOMMIT_FUZZ_VERBOSE") && merged)
    std::fprintf(stderr, "merged (view %s)\n", before ? "compared" : "unreadable before");
  if (!merged || !before) return 0;
  // Merged: BASE alone must now show what TOP showed.
  std::optional<std::vector<uint8_t>> after;
  try {
    after = view(base, dir, before->size());
  } catch (const qcow2::Error& e) {
    std::fprintf(stderr, "merged BASE cannot be read: %s\n", e.what());
    std::abort();
  }
  if (!after) {
    std::fprintf(stderr, "merged BASE is smaller than TOP\n");
    std::abort();
  }
  if (!std::equal(before->begin(), before->end(), after->begin())) {
    auto [a, b] = std::mismatch(before->begin(), before->end(), after->begin());
    std::fprintf(stderr, "merged BASE differs from TOP at guest offset %zu\n", size_t(a - before->begin()));
    std::abort();
  }
  // Beyond TOP's size (BASE larger than TOP) BASE keeps its old bytes: not compared here.
  return 0;
}
