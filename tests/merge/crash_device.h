// SPDX-License-Identifier: GPL-2.0-or-later
// A crash-simulating block device for the merge crash tests.
//
// It keeps the durable image (what survives a power cut) and the list of writes and truncates
// issued since the last flush. Reads see everything issued. A crash can be armed to happen right
// after the k-th write; after a crash the device refuses all further I/O (so nothing the crashed
// code does afterwards, destructors included, can reach the "disk"). The surviving bytes are the
// durable image alone, or the durable image plus a random subset of the unflushed operations
// applied in random order ("torn" write-back order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "qcow2/device.h"

namespace qcommit::test {

// Thrown to unwind the code under test at the crash moment.
struct SimulatedCrash : std::runtime_error {
  SimulatedCrash() : std::runtime_error("simulated crash") {}
};

class CrashDevice final : public qcow2::BlockDevice {
 public:
  CrashDevice(std::string name, std::vector<uint8_t> durable)
      : name_(std::move(name)), durable_(durable), current_(std::move(durable)) {}

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] uint64_t size() const override { return current_.size(); }
  void read(uint64_t offset, std::span<uint8_t> out) override {
    alive();
    std::fill(out.begin(), out.end(), uint8_t{0});
    if (offset < current_.size()) {
      const uint64_t n = std::min<uint64_t>(out.size(), current_.size() - offset);
      std::memcpy(out.data(), current_.data() + offset, n);
    }
  }
  void write(uint64_t offset, std::span<const uint8_t> in) override {
    alive();
    Op op{offset, std::vector<uint8_t>(in.begin(), in.end()), false};
    apply(current_, op);
    pending_.push_back(std::move(op));
    ++writes_;
    if (crash_after_write_ && writes_ == crash_after_write_) crash();
  }
  void flush() override {
    alive();
    durable_ = current_;
    pending_.clear();
    ++flushes_;
  }
  void truncate(uint64_t new_size) override {
    alive();
    Op op{new_size, {}, true};
    apply(current_, op);
    pending_.push_back(std::move(op));
  }
  [[nodiscard]] bool writable() const override { return true; }
  [[nodiscard]] uint64_t allocated_bytes() const override { return current_.size(); }

  // Crash right after the k-th write (1-based); 0 disarms.
  void crash_after_write(uint64_t k) { crash_after_write_ = k; }
  [[noreturn]] void crash() {
    crashed_ = true;
    throw SimulatedCrash();
  }
  [[nodiscard]] bool crashed() const { return crashed_; }
  [[nodiscard]] uint64_t writes() const { return writes_; }
  [[nodiscard]] uint64_t flushes() const { return flushes_; }
  [[nodiscard]] size_t pending() const { return pending_.size(); }

  // What survives: the durable image only.
  [[nodiscard]] std::vector<uint8_t> durable() const { return durable_; }
  // What survives with a disk that wrote back a random subset of the unflushed operations, in
  // random order.
  [[nodiscard]] std::vector<uint8_t> torn(std::mt19937_64& rng) const {
    std::vector<const Op*> keep;
    for (const auto& op : pending_)
      if (rng() & 1) keep.push_back(&op);
    std::shuffle(keep.begin(), keep.end(), rng);
    std::vector<uint8_t> img = durable_;
    for (const Op* op : keep) apply(img, *op);
    return img;
  }
  // Everything issued (as if the crash had not happened).
  [[nodiscard]] const std::vector<uint8_t>& current() const { return current_; }

 private:
  struct Op {
    uint64_t offset;  // or the new size for a truncate
    std::vector<uint8_t> data;
    bool truncate;
  };
  static void apply(std::vector<uint8_t>& img, const Op& op) {
    if (op.truncate) {
      img.resize(op.offset);
      return;
    }
    if (img.size() < op.offset + op.data.size()) img.resize(op.offset + op.data.size());
    std::memcpy(img.data() + op.offset, op.data.data(), op.data.size());
  }
  void alive() const {
    if (crashed_) throw SimulatedCrash();
  }

  std::string name_;
  std::vector<uint8_t> durable_;
  std::vector<uint8_t> current_;
  std::vector<Op> pending_;
  uint64_t writes_ = 0, flushes_ = 0, crash_after_write_ = 0;
  bool crashed_ = false;
};

// Lends a device to an Image (which owns its device) while the test keeps the device.
class BorrowedDevice final : public qcow2::BlockDevice {
 public:
  explicit BorrowedDevice(qcow2::BlockDevice& d) : d_(d) {}
  [[nodiscard]] const std::string& name() const override { return d_.name(); }
  [[nodiscard]] uint64_t size() const override { return d_.size(); }
  void read(uint64_t offset, std::span<uint8_t> out) override { d_.read(offset, out); }
  void write(uint64_t offset, std::span<const uint8_t> in) override { d_.write(offset, in); }
  void flush() override { d_.flush(); }
  void truncate(uint64_t new_size) override { d_.truncate(new_size); }
  [[nodiscard]] bool writable() const override { return d_.writable(); }
  [[nodiscard]] uint64_t allocated_bytes() const override { return d_.allocated_bytes(); }

 private:
  qcow2::BlockDevice& d_;
};

}  // namespace qcommit::test
