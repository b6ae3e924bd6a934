// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/base_fingerprint.h"

#include <sys/stat.h>

#include <cstdio>

#include "qcow2/device.h"

namespace qcommit::engine {

namespace {

// FNV-1a, 64 bits: stable across builds and runs (a checkpoint outlives the binary that wrote it).
class Fnv1a {
 public:
  void add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (v >> (8 * i)) & 0xff;
      h_ *= kPrime;
    }
  }
  [[nodiscard]] uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull;
  static constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t h_ = kOffsetBasis;
};

}  // namespace

std::string base_fingerprint(const qcow2::Layer& base, uint64_t done) {
  const qcow2::BlockDevice& dev = base.qcow2 ? base.qcow2->file() : *base.raw;
  const auto* file = dynamic_cast<const qcow2::FileDevice*>(&dev);
  struct stat st {};
  if (file) (void)::fstat(file->fd(), &st);
  Fnv1a h;
  h.add(st.st_dev);
  h.add(st.st_ino);
  h.add(S_ISBLK(st.st_mode) ? st.st_rdev : 0);
  if (base.qcow2) {
    const qcow2::Image& img = *base.qcow2;
    const qcow2::Header& hd = img.header();
    h.add(hd.size);
    h.add(hd.l1_table_offset);
    h.add(hd.l1_size);
    const uint64_t span = img.geometry().l1_entry_span();
    const std::vector<uint64_t>& l1 = img.l1_table();
    const uint64_t entries = done == 0 ? 0 : (done - 1) / span + 1;
    for (uint64_t i = 0; i < entries && i < l1.size(); ++i) h.add(l1[i]);
  }
  char text[32];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h.value()));
  return text;
}

}  // namespace qcommit::engine
