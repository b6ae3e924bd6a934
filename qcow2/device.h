// The block-device seam. The qcow2 code reads and writes images only through this interface, so
// tests can substitute memory, fault-injecting and crash-simulating devices.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

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

struct FileOpenOptions {
  bool writable = false;
  bool direct = false;  // O_DIRECT where the filesystem allows it
};

// A regular file or a block device.
class FileDevice final : public BlockDevice {
 public:
  static std::unique_ptr<FileDevice> open(const std::string& path, FileOpenOptions options = {});
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
