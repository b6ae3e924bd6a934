// SPDX-License-Identifier: GPL-2.0-or-later
// Batched O_DIRECT writes straight from the sources' page cache, for the unthrottled copy.
//
// The copy pool's thread path costs two splice(2) calls and one device doorbell per request, and
// wakes a thread per request. For chains of small scattered pieces (rand4g4k: 16384 pieces of
// 4-60 KiB) that per-request cost is most of the merge's system CPU. Here a worker hands a batch
// of vectored writes to the kernel in one io_uring_enter(2); the data is not copied: each write's
// memory is a read-only shared mapping of the source file, so the device reads TOP's cached
// pages where they are, as with splice.
//
// Measured 2026-12-03 (2-core Debian 12 VM, kernel 6.18, ext4 on virtio; rand4g4k's 16384 pieces
// written in place, a stand-alone program): 16 threads splicing took 0.24-0.28 s of system CPU,
// 2 workers with batches of 64 from mappings 0.11-0.12 s; with the sources not cached, wall time
// 1.45-1.56 s against 0.70-0.85 s (2 runs each; WILLNEED read-ahead of each batch's sources
// first). tests/bench-results/io-uring-batches-2026-12-03.txt has every run.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "qcow2/unique_fd.h"

namespace qcommit::engine {

// A read-only shared mapping of a whole source file. Touching a page past the file's end would
// raise SIGBUS, so callers only get pointers to ranges inside the size the file had when mapped
// (layers do not change while they are merged; they are locked).
class SourceMapping {
 public:
  // Null where the file cannot be mapped (empty, or a filesystem that refuses).
  [[nodiscard]] static std::unique_ptr<SourceMapping> map(int fd);
  ~SourceMapping();
  SourceMapping(const SourceMapping&) = delete;
  SourceMapping& operator=(const SourceMapping&) = delete;

  // The mapped bytes [offset, offset + length), or null where that is not wholly inside.
  [[nodiscard]] const uint8_t* at(uint64_t offset, uint64_t length) const;
  // Starts reading [offset, offset + length) into the page cache, without waiting.
  void prefetch(uint64_t offset, uint64_t length) const;
  // Drops this process's page-table entries for the whole mapping (the page cache keeps the
  // pages): pages a write has touched otherwise count in our resident set.
  void unmap_pages() const;

 private:
  SourceMapping(int fd, uint8_t* base, uint64_t size) : fd_(fd), base_(base), size_(size) {}
  int fd_;
  uint8_t* base_;
  uint64_t size_;
};

// The mappings the batched workers write from, one per source descriptor (made on first use and
// kept while the set lives: a descriptor must stay open on the same file as long), and the bound
// on the pages they keep mapped.
class SourceMappings {
 public:
  SourceMappings();
  ~SourceMappings();
  SourceMappings(const SourceMappings&) = delete;
  SourceMappings& operator=(const SourceMappings&) = delete;

  // The mapping of `fd`; null where it cannot be mapped.
  [[nodiscard]] const SourceMapping* of(int fd);
  // Unmaps every mapping's pages once the file pages this process maps have grown by
  // kMaxMappedBytes (16 MiB, direct_batch.cpp) since the set was made (each time, where that
  // cannot be told).
  void release_if_grown();

 private:
  // File pages mapped by this process (/proc/self/statm's resident shared pages).
  [[nodiscard]] std::optional<uint64_t> mapped_file_bytes() const;
  std::mutex mu_;
  std::map<int, std::unique_ptr<SourceMapping>> maps_;  // by source descriptor
  UniqueFd statm_;                                      // /proc/self/statm
  uint64_t mapped_at_start_ = 0;
};

// One io_uring instance for one worker: vectored writes queued, submitted together, waited for
// together.
class DirectBatch {
 public:
  static constexpr unsigned kMaxWrites = 64;

  // Null where io_uring cannot be set up here (a kernel without it, kernel.io_uring_disabled, a
  // seccomp filter of a container): the caller copies with threads instead.
  [[nodiscard]] static std::unique_ptr<DirectBatch> open();
  ~DirectBatch();
  DirectBatch(const DirectBatch&) = delete;
  DirectBatch& operator=(const DirectBatch&) = delete;

  // Queues a write of `iov` (which must stay valid until wait() returns) at `offset` of `fd`;
  // false when the batch is full.
  [[nodiscard]] bool add(int fd, std::span<const iovec> iov, uint64_t offset, uint64_t length);
  // Hands the queued writes to the kernel.
  void submit();
  // Waits for every queued write; for each, in the order added: whether it wrote all its bytes
  // (false also for one the kernel did not take). The batch is empty afterwards.
  [[nodiscard]] std::vector<bool> wait();

 private:
  struct Ring;
  explicit DirectBatch(std::unique_ptr<Ring> ring);
  std::unique_ptr<Ring> ring_;
  std::vector<uint64_t> expected_;  // bytes per queued write
  size_t prepared_ = 0;             // queued writes placed in the submission ring
  size_t submitted_ = 0;            // of those, taken by the kernel
};

}  // namespace qcommit::engine
