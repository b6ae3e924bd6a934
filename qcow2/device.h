// SPDX-License-Identifier: GPL-2.0-or-later
// The block-device seam. The qcow2 code reads and writes images only through this interface, so
// tests can substitute memory, fault-injecting and crash-simulating devices.
#pragma once

#include <sys/types.h>

#include <compare>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qcow2/unique_fd.h"

namespace qcommit::qcow2 {

// Which ranges of a device hold data (SEEK_DATA/SEEK_HOLE semantics).
struct AllocationRun {
  uint64_t length = 0;
  bool data = true;  // false: a hole that reads as zeros
};

class BlockDevice {
 public:
  virtual ~BlockDevice() = default;
  // Name used in error messages (usually the path).
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual uint64_t size() const = 0;
  // Reads exactly out.size() bytes; bytes past the end of the device read as zeros.
  virtual void read(uint64_t offset, std::span<uint8_t> out) = 0;
  virtual void write(uint64_t offset, std::span<const uint8_t> in) = 0;
  virtual void flush() = 0;
  virtual void truncate(uint64_t new_size) = 0;
  [[nodiscard]] virtual bool writable() const = 0;
  // Bytes actually allocated on the host (st_blocks * 512 for files).
  [[nodiscard]] virtual uint64_t allocated_bytes() const = 0;
  // Data/hole run starting at offset (at most max_len bytes). Default: all data.
  [[nodiscard]] virtual AllocationRun allocation(uint64_t /*offset*/, uint64_t max_len) const {
    return {max_len, true};
  }
  // Preferred I/O alignment for writes (st_blksize, BLKIOMIN/BLKIOOPT) in bytes.
  [[nodiscard]] virtual uint32_t write_alignment() const { return 4096; }
};

// Which file an open file is: block devices by the device they are (two device nodes of one
// disk are the same disk), everything else by (st_dev, st_ino). Never by path.
struct FileId {
  bool block = false;
  dev_t dev = 0;  // st_rdev for a block device, st_dev otherwise
  ino_t ino = 0;  // 0 for a block device
  auto operator<=>(const FileId&) const = default;
};

// A path resolved by the kernel without opening the file for I/O (O_PATH): looking up a FIFO or
// a device node this way neither blocks nor reaches the device's driver. Policy checks (kind of
// file, allowed directories) run on the handle, and FileDevice::open(handle) reopens exactly this
// file through /proc/self/fd, so what was checked is what gets opened.
class PathHandle {
 public:
  // Resolves `path` as open(2) would (symlinks and '..' in order, relative to the working
  // directory). Throws IoError when the kernel cannot resolve it.
  [[nodiscard]] static PathHandle lookup(const std::string& path);

  [[nodiscard]] const std::string& path() const { return path_; }
  // Where the kernel's resolution led: the file's absolute path without symlinks.
  [[nodiscard]] const std::string& real_path() const { return real_path_; }
  [[nodiscard]] FileId id() const;
  [[nodiscard]] bool regular_or_block() const;
  // What kind of file this is, for messages: "a regular file", "a FIFO", "a directory", ...
  [[nodiscard]] const char* kind() const;
  [[nodiscard]] int fd() const { return fd_.get(); }

 private:
  PathHandle(std::string path, UniqueFd fd);
  std::string path_;
  std::string real_path_;
  UniqueFd fd_;
  mode_t mode_ = 0;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  dev_t rdev_ = 0;
};

struct FileOpenOptions {
  bool writable = false;
  bool direct = false;  // O_DIRECT where the filesystem allows it
};

// A regular file or a block device. Nothing else is ever opened for reading or writing: FIFOs,
// sockets, character devices and directories are refused from their O_PATH handle.
class FileDevice final : public BlockDevice {
 public:
  // Looks `path` up (PathHandle::lookup) and opens it from the handle.
  static std::unique_ptr<FileDevice> open(const std::string& path, FileOpenOptions options = {});
  // Opens the file `handle` refers to (not its path again); refuses anything but a regular file
  // or block device without opening it. The device's name is handle.path().
  static std::unique_ptr<FileDevice> open(const PathHandle& handle, FileOpenOptions options = {});
  ~FileDevice() override;
  FileDevice(const FileDevice&) = delete;
  FileDevice& operator=(const FileDevice&) = delete;

  [[nodiscard]] const std::string& name() const override { return path_; }
  [[nodiscard]] uint64_t size() const override { return size_; }
  void read(uint64_t offset, std::span<uint8_t> out) override;
  void write(uint64_t offset, std::span<const uint8_t> in) override;
  void flush() override;
  void truncate(uint64_t new_size) override;
  [[nodiscard]] bool writable() const override { return writable_; }
  [[nodiscard]] uint64_t allocated_bytes() const override;
  [[nodiscard]] AllocationRun allocation(uint64_t offset, uint64_t max_len) const override;
  [[nodiscard]] uint32_t write_alignment() const override { return alignment_; }
  [[nodiscard]] int fd() const { return fd_; }
  [[nodiscard]] bool is_block_device() const { return block_device_; }
  [[nodiscard]] dev_t st_dev() const { return dev_; }
  [[nodiscard]] ino_t st_ino() const { return ino_; }
  [[nodiscard]] FileId id() const;

 private:
  FileDevice(std::string path, int fd, bool writable);
  std::string path_;
  int fd_ = -1;
  bool writable_ = false;
  bool block_device_ = false;
  uint64_t size_ = 0;
  uint32_t alignment_ = 4096;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  dev_t rdev_ = 0;
};

// An in-memory device for tests.
class MemoryDevice final : public BlockDevice {
 public:
  explicit MemoryDevice(std::string name, std::vector<uint8_t> bytes = {})
      : name_(std::move(name)), bytes_(std::move(bytes)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] uint64_t size() const override { return bytes_.size(); }
  void read(uint64_t offset, std::span<uint8_t> out) override;
  void write(uint64_t offset, std::span<const uint8_t> in) override;
  void flush() override {}
  void truncate(uint64_t new_size) override { bytes_.resize(new_size); }
  [[nodiscard]] bool writable() const override { return true; }
  [[nodiscard]] uint64_t allocated_bytes() const override { return bytes_.size(); }
  [[nodiscard]] std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::string name_;
  std::vector<uint8_t> bytes_;
};

}  // namespace qcommit::qcow2
