// The byte-range locks QEMU takes on image files (OFD locks on bytes 100+perm and 200+perm), so
// that a running QEMU and qcommit refuse each other instead of corrupting an image.
#pragma once

#include <cstdint>
#include <string>

namespace qcommit::engine {

// QEMU's permission bits (block/block-common.h) and lock byte bases (block/file-posix.c).
inline constexpr uint32_t kPermConsistentRead = 0x01;
inline constexpr uint32_t kPermWrite = 0x02;
inline constexpr uint32_t kPermWriteUnchanged = 0x04;
inline constexpr uint32_t kPermResize = 0x08;
inline constexpr uint32_t kPermAll = 0x0f;
inline constexpr uint64_t kLockPermBase = 100;
inline constexpr uint64_t kLockSharedBase = 200;

// Holds QEMU-compatible locks on one file for its lifetime (RAII). Throws qcow2::Error naming the
// file and, where it can be found, the process that holds the conflicting lock.
class ImageLock {
 public:
  // perm: what we do with the file; shared: what we allow others to do.
  ImageLock(const std::string& path, uint32_t perm, uint32_t shared);
  ~ImageLock();
  ImageLock(const ImageLock&) = delete;
  ImageLock& operator=(const ImageLock&) = delete;
  ImageLock(ImageLock&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) { o.fd_ = -1; }

  // Reading an image while nobody changes it.
  static ImageLock reader(const std::string& path) {
    return ImageLock(path, kPermConsistentRead, kPermConsistentRead | kPermWriteUnchanged);
  }
  // Writing an image exclusively (others may not even read it consistently while we change it).
  static ImageLock writer(const std::string& path) {
    return ImageLock(path, kPermConsistentRead | kPermWrite | kPermResize, kPermWriteUnchanged);
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// "pid 1234 (qemu-system-x86)" for every process that has `path` open, or "" if none is found
// (engine/proc_walk.h).
[[nodiscard]] std::string describe_holders(const std::string& path);

}  // namespace qcommit::engine
