// SPDX-License-Identifier: GPL-2.0-or-later
#include "qcow2/device.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "qcow2/error.h"

namespace qcommit::qcow2 {

namespace {
[[noreturn]] void throw_errno(const std::string& name, const std::string& what, int err) {
  throw IoError(name, what + ": " + std::strerror(err), err);
}

// The magic link of an open fd: readlink gives the file's resolved path, open() reopens the very
// file the fd refers to (whatever its path names now).
inline constexpr const char* kProcSelfFd = "/proc/self/fd/";
std::string proc_fd_path(int fd) {
  return kProcSelfFd + std::to_string(fd);
}
}  // namespace

PathHandle PathHandle::lookup(const std::string& path) {
  // O_PATH: the kernel resolves the name and pins the file, but no open() of a device driver,
  // no wait for a FIFO's writer, no read or write permission needed.
  UniqueFd fd(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!fd.valid()) throw_errno(path, "cannot open", errno);
  return PathHandle(path, std::move(fd));
}

PathHandle::PathHandle(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) throw_errno(path_, "cannot stat", errno);
  std::string link(PATH_MAX, '\0');
  const ssize_t n = ::readlink(proc_fd_path(fd_.get()).c_str(), link.data(), link.size());
  if (n < 0)
    throw_errno(path_,
                "cannot resolve through " + std::string(kProcSelfFd) + " (is /proc mounted?)",
                errno);
  if (size_t(n) >= link.size()) throw Error(path_, "resolved path longer than PATH_MAX");
  link.resize(size_t(n));
  real_path_ = std::move(link);
  mode_ = st.st_mode;
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  rdev_ = st.st_rdev;
}

FileId PathHandle::id() const {
  if (S_ISBLK(mode_)) return {.block = true, .dev = rdev_, .ino = 0};
  return {.block = false, .dev = dev_, .ino = ino_};
}

bool PathHandle::regular_or_block() const {
  return S_ISREG(mode_) || S_ISBLK(mode_);
}

const char* PathHandle::kind() const {
  if (S_ISREG(mode_)) return "a regular file";
  if (S_ISBLK(mode_)) return "a block device";
  if (S_ISDIR(mode_)) return "a directory";
  if (S_ISFIFO(mode_)) return "a FIFO";
  if (S_ISSOCK(mode_)) return "a socket";
  if (S_ISCHR(mode_)) return "a character device";
  return "a file of unknown type";
}

std::unique_ptr<FileDevice> FileDevice::open(const std::string& path, FileOpenOptions options) {
  return open(PathHandle::lookup(path), options);
}

std::unique_ptr<FileDevice> FileDevice::open(const PathHandle& handle, FileOpenOptions options) {
  if (!handle.regular_or_block())
    throw Error(handle.path(), std::string("is ") + handle.kind() +
                                   ", not a regular file or block device; refusing to open it");
  // Reopened through the handle's magic link: the file checked, even if its path was swapped.
  const std::string via = proc_fd_path(handle.fd());
  const int flags = (options.writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOCTTY;
  int fd = -1;
  if (options.direct) {
    fd = ::open(via.c_str(), flags | O_DIRECT);
    if (fd < 0 && errno != EINVAL) throw_errno(handle.path(), "cannot open", errno);
  }
  if (fd < 0) fd = ::open(via.c_str(), flags);
  if (fd < 0) throw_errno(handle.path(), "cannot open", errno);
  auto dev = std::unique_ptr<FileDevice>(new FileDevice(handle.path(), fd, options.writable));
  if (dev->id() != handle.id()) throw Error(handle.path(), "changed while it was being opened");
  return dev;
}

FileDevice::FileDevice(std::string path, int fd, bool writable)
    : path_(std::move(path)), fd_(fd), writable_(writable) {
  struct stat st {};
  if (fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    throw_errno(path_, "cannot stat", err);
  }
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  rdev_ = st.st_rdev;
  if (S_ISBLK(st.st_mode)) {
    block_device_ = true;
    uint64_t bytes = 0;
    if (ioctl(fd_, BLKGETSIZE64, &bytes) != 0) {
      int err = errno;
      ::close(fd_);
      throw_errno(path_, "cannot get block device size", err);
    }
    size_ = bytes;
    unsigned int io_min = 0, io_opt = 0;
    if (ioctl(fd_, BLKIOMIN, &io_min) == 0 && io_min > 0) alignment_ = std::max(alignment_, io_min);
    if (ioctl(fd_, BLKIOOPT, &io_opt) == 0 && io_opt > 0 && io_opt <= (16u << 20))
      alignment_ = std::max(alignment_, io_opt);
  } else if (S_ISREG(st.st_mode)) {
    size_ = static_cast<uint64_t>(st.st_size);
    if (st.st_blksize > 0) alignment_ = std::max<uint32_t>(alignment_, uint32_t(st.st_blksize));
  } else {
    ::close(fd_);
    throw Error(path_, "not a regular file or block device");
  }
}

FileId FileDevice::id() const {
  if (block_device_) return {.block = true, .dev = rdev_, .ino = 0};
  return {.block = false, .dev = dev_, .ino = ino_};
}

FileDevice::~FileDevice() {
  if (fd_ >= 0) ::close(fd_);
}

void FileDevice::read(uint64_t offset, std::span<uint8_t> out) {
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(path_, "read of " + std::to_string(out.size()) + " bytes at " + hex(offset) +
                             " failed", errno);
    }
    if (n == 0) {  // end of file: the rest reads as zeros
      std::memset(out.data() + done, 0, out.size() - done);
      return;
    }
    done += size_t(n);
  }
}

void FileDevice::write(uint64_t offset, std::span<const uint8_t> in) {
  size_t done = 0;
  while (done < in.size()) {
    ssize_t n = ::pwrite(fd_, in.data() + done, in.size() - done, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(path_, "write of " + std::to_string(in.size()) + " bytes at " + hex(offset) +
                             " failed", errno);
    }
    done += size_t(n);
  }
  size_ = std::max(size_, offset + in.size());
}

void FileDevice::flush() {
  if (::fdatasync(fd_) != 0) throw_errno(path_, "flush failed", errno);
}

void FileDevice::truncate(uint64_t new_size) {
  if (block_device_) {
    if (new_size > size_) throw Error(path_, "block device too small for " + std::to_string(new_size) + " bytes");
    return;
  }
  if (::ftruncate(fd_, off_t(new_size)) != 0) throw_errno(path_, "cannot resize", errno);
  size_ = new_size;
}

uint64_t FileDevice::allocated_bytes() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return size_;
  if (block_device_) return size_;
  return uint64_t(st.st_blocks) * 512;
}

AllocationRun FileDevice::allocation(uint64_t offset, uint64_t max_len) const {
  if (block_device_ || max_len == 0) return {max_len, true};
  if (offset >= size_) return {max_len, false};
  off_t data = ::lseek(fd_, off_t(offset), SEEK_DATA);
  if (data < 0) {
    if (errno == ENXIO) return {max_len, false};  // trailing hole
    return {max_len, true};                       // unknown: treat as data
  }
  if (uint64_t(data) > offset) return {std::min<uint64_t>(max_len, uint64_t(data) - offset), false};
  off_t hole = ::lseek(fd_, off_t(offset), SEEK_HOLE);
  if (hole < 0 || uint64_t(hole) <= offset) return {max_len, true};
  return {std::min<uint64_t>(max_len, uint64_t(hole) - offset), true};
}

void MemoryDevice::read(uint64_t offset, std::span<uint8_t> out) {
  std::fill(out.begin(), out.end(), uint8_t{0});
  if (offset >= bytes_.size()) return;
  size_t n = size_t(std::min<uint64_t>(out.size(), bytes_.size() - offset));
  std::memcpy(out.data(), bytes_.data() + offset, n);
}

void MemoryDevice::write(uint64_t offset, std::span<const uint8_t> in) {
  if (offset + in.size() > bytes_.size()) bytes_.resize(offset + in.size());
  std::memcpy(bytes_.data() + offset, in.data(), in.size());
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace qcommit::qcow2
