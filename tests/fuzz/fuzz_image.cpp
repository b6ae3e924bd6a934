// SPDX-License-Identifier: GPL-2.0-or-later
// libFuzzer target: one qcow2 image from the fuzz bytes, read through the library.
// Image::open → lookup() over the virtual size (bounded) → read_run()/decompress() of data and
// compressed runs → refcount() of a few clusters → check(Repair::kAll) on a copy.
// qcow2::Error of any kind is an accepted outcome; anything else (crash, sanitizer report, other
// exception, no progress, timeouts, large allocations) is a bug.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "qcow2/check.h"
#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/image.h"
#include "tests/fuzz/fuzz_util.h"

using namespace qcommit;
using namespace qcommit::fuzz;

namespace {

constexpr size_t kCacheBytes = 1u << 20;

std::unique_ptr<qcow2::Image> open_bytes(const uint8_t* data, size_t size) {
  auto dev = std::make_unique<qcow2::MemoryDevice>("fuzz.qcow2", std::vector<uint8_t>(data, data + size));
  return qcow2::Image::open(std::move(dev), {.writable = true, .cache_bytes = kCacheBytes});
}

void read_runs(qcow2::Image& img, uint64_t start) {
  const uint64_t vsize = img.virtual_size();
  const uint64_t cs = img.cluster_size();
  std::vector<uint8_t> buf(std::min<uint64_t>(kMaxReadBytes, 64u << 10));
  std::vector<uint8_t> cluster;
  uint64_t off = start, read_total = 0;
  for (unsigned i = 0; i < kMaxLookups && off < vsize; ++i) {
    qcow2::Run run = img.lookup(off, vsize - off);
    if (run.length == 0 || run.guest_offset != off || run.length > vsize - off) std::abort();  // no progress
    if (read_total < kMaxReadBytes) {
      if (run.type == qcow2::SubclusterType::kNormal) {
        const uint64_t n = std::min<uint64_t>(run.length, buf.size());
        img.read_run(run, off, std::span<uint8_t>(buf.data(), n));
        read_total += n;
      } else if (run.type == qcow2::SubclusterType::kCompressed) {
        // A compressed run never leaves its cluster.
        const uint64_t in_cluster = img.geometry().offset_into_cluster(off);
        if (run.length > cs - in_cluster) std::abort();
        const uint64_t n = std::min<uint64_t>(run.length, buf.size());
        img.read_run(run, off, std::span<uint8_t>(buf.data(), n));
        cluster.resize(cs);
        img.decompress(run, cluster);
        if (!std::equal(buf.begin(), buf.begin() + long(n), cluster.begin() + long(in_cluster))) std::abort();
        read_total += cs;
      }
    }
    off += run.length;
  }
}

void exercise(qcow2::Image& img) {
  const uint64_t vsize = img.virtual_size();
  try {
    read_runs(img, 0);
  } catch (const qcow2::Error&) {
  }
  // A few lookups far into the disk (huge virtual sizes are valid).
  for (uint64_t off : {vsize / 2, vsize > 0 ? vsize - 1 : 0}) {
    try {
      read_runs(img, off);
    } catch (const qcow2::Error&) {
    }
  }
  try {
    const uint64_t file_clusters = (img.file().size() + img.cluster_size() - 1) / img.cluster_size();
    for (uint64_t c = 0; c < std::min<uint64_t>(file_clusters + 2, 32); ++c) (void)img.refcount(c);
    (void)img.refcount(~0ull / img.cluster_size());
    (void)img.metadata_preallocated();
  } catch (const qcow2::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxInputBytes) return -1;
  try {
    auto img = open_bytes(data, size);
    exercise(*img);
  } catch (const qcow2::Error&) {
  }
  // One check, with full repair (it walks everything check without repair walks, then writes
  // the fixes into the in-memory copy). A second check of the repaired copy must not throw
  // anything but qcow2::Error either.
  try {
    auto img = open_bytes(data, size);
    (void)qcow2::check(*img, qcow2::Repair::kAll);
  } catch (const qcow2::Error&) {
  }
  return 0;
}
