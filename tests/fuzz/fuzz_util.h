// SPDX-License-Identifier: GPL-2.0-or-later
// Helpers shared by the libFuzzer targets: a private temporary directory and whole-file writes.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qcommit::fuzz {

// Inputs larger than this are ignored: the interesting structure of a qcow2 image is in its
// first clusters, and small inputs keep the fuzzer fast.
inline constexpr size_t kMaxInputBytes = 1u << 20;
// Guest bytes any one target reads or maps per input.
inline constexpr uint64_t kMaxReadBytes = 256u << 10;
inline constexpr unsigned kMaxLookups = 2048;

// A directory private to this process, under /dev/shm when available (merges flush often).
inline const std::string& temp_dir() {
  static const std::string dir = [] {
    std::string base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string tmpl = base + "/qcommit-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) std::abort();
    // Best effort cleanup at exit (libFuzzer exits through exit()).
    static std::string copy = tmpl;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(copy, ec);
    });
    return tmpl;
  }();
  return dir;
}

inline void write_file(const std::string& path, std::span<const uint8_t> bytes) {
  std::filesystem::remove(path);  // never write through a symlink a previous input left
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) std::abort();
    done += size_t(n);
  }
  ::close(fd);
}

// Splits `data` at each occurrence of kSeparator into at most max_parts parts.
inline constexpr std::string_view kSeparator = "\n--qcommit-fuzz-layer--\n";

inline std::vector<std::span<const uint8_t>> split_layers(const uint8_t* data, size_t size, size_t max_parts) {
  std::vector<std::span<const uint8_t>> parts;
  std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  while (parts.size() + 1 < max_parts) {
    size_t at = all.find(kSeparator, start);
    if (at == std::string_view::npos) break;
    parts.emplace_back(data + start, at - start);
    start = at + kSeparator.size();
  }
  parts.emplace_back(data + start, size - start);
  return parts;
}

}  // namespace qcommit::fuzz
