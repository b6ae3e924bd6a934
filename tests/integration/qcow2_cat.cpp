// SPDX-License-Identifier: GPL-2.0-or-later
// qcow2-cat IMAGE [OFFSET LENGTH]: writes the guest view of IMAGE (read through its whole backing
// chain with qcow2::Chain::read) to stdout. Test tool for the integration tests: its output is
// compared byte for byte with `qemu-img convert -O raw` / `qemu-img dd`.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "qcow2/chain.h"
#include "qcow2/error.h"

namespace {

inline constexpr size_t kChunkBytes = 4u << 20;

void write_all(const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(STDOUT_FILENO, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("stdout: write failed: ") + std::strerror(errno));
    }
    p += w;
    n -= size_t(w);
  }
}

uint64_t parse_u64(const char* s) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s, &end, 0);
  if (errno || !end || *end) throw std::runtime_error(std::string("bad number '") + s + "'");
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 4) {
    std::fprintf(stderr, "usage: qcow2-cat IMAGE [OFFSET LENGTH]\n");
    return 2;
  }
  try {
    auto chain = qcommit::qcow2::Chain::open(argv[1]);
    const uint64_t size = chain.virtual_size();
    uint64_t off = argc == 4 ? parse_u64(argv[2]) : 0;
    uint64_t end = argc == 4 ? off + parse_u64(argv[3]) : size;
    if (off > size) off = size;
    if (end > size) end = size;
    std::vector<uint8_t> buf(kChunkBytes);
    while (off < end) {
      const size_t n = size_t(std::min<uint64_t>(buf.size(), end - off));
      chain.read(off, std::span<uint8_t>(buf.data(), n));
      write_all(buf.data(), n);
      off += n;
    }
    return 0;
  } catch (const qcommit::qcow2::CorruptionError& e) {
    std::fprintf(stderr, "qcow2-cat: %s (image is corrupt)\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qcow2-cat: %s\n", e.what());
    return 1;
  }
}
