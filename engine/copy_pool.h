// SPDX-License-Identifier: GPL-2.0-or-later
// The copy pool of the merge engine: a few threads run copy jobs (one contiguous range of BASE,
// gathered from source extents) from a layer's host offsets to BASE's, in the kernel where it can
// (splice into O_DIRECT writes, copy_file_range into buffered ones), else through user space;
// clusters that TOP provides only parts of are assembled in the worker's buffer and written once.
// The engine's governor admits each job; completions are reported back to it. Unthrottled, where
// io_uring is available, small requests go instead to a few workers (kBatchWorkers in
// copy_pool.cpp) that write them in batches straight from mappings of the sources
// (engine/direct_batch.h).
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/direct_batch.h"
#include "engine/merge.h"

namespace qcommit::engine {

inline constexpr uint64_t kDirectAlignment = 4096;
inline constexpr uint64_t kPageBytes = 4096;

// The largest write BASE's block device takes as one request when the data lies in separate
// 4 KiB pages (page-cache pages are not contiguous): max_segments pages, at most max_sectors_kb.
// A 1 MiB splice on virtio-blk (254 segments) went out as a 1016 KiB and an 8 KiB request; sized
// to the limit, seq4g's copy took 0.30 s/GiB instead of 0.37 s (medians of 4, micro-benchmark).
// kChunkBytes where sysfs does not tell (network and FUSE filesystems have no queue).
[[nodiscard]] uint64_t device_request_bytes(int fd);

// One source extent of a copy job.
struct CopySource {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  const std::string* name = nullptr;
};

// Bytes of a source laid over an assembled cluster, `at` bytes into it.
struct ClusterPatch {
  CopySource source;
  uint64_t at = 0;
};

// A cluster of BASE written whole from memory: BASE's view of it (zeros, or `view` when that was
// read) with the patches laid over it. A cluster that TOP provides only parts of is written once
// this way instead of once whole and again for every other part.
struct AssembledCluster {
  uint64_t length = 0;
  std::vector<uint8_t> view;  // empty: BASE's view of the cluster reads as zeros
  std::vector<ClusterPatch> patches;
};

// A write of one contiguous destination range, gathered from source extents in destination
// order: pieces adjacent in BASE make one request even where their sources are not adjacent
// (new clusters are allocated in guest order, their sources wherever TOP wrote them). Either
// `sources` or `clusters` (back to back), never both.
struct CopyJob {
  std::vector<CopySource> sources;         // lengths add up to `length`
  std::vector<AssembledCluster> clusters;  // lengths add up to `length` (at most kChunkBytes)
  int dst_fd = -1;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  bool buffered_dst = false;  // start writeback right away (bounded dirty data)
  bool direct_dst = false;    // dst_fd is O_DIRECT (offsets and length aligned)
  const std::string* dst_name = nullptr;
};

struct SplicePipe;

class CopyPool {
 public:
  // `batched`: without a governor, try the batched path for small requests (a source descriptor
  // must then stay open on the same file while the pool lives: its mapping is kept by descriptor).
  CopyPool(unsigned threads, uint64_t inflight_limit, CopyGovernor* governor,
           uint64_t splice_piece_bytes, bool batched = false);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Queues `job` once the governor admits it and the bytes in flight allow; throws the first error
  // a worker met.
  void submit(CopyJob job);
  // Returns once every submitted job is done; throws the first error a worker met.
  void drain();
  [[nodiscard]] uint64_t inflight();

  // Whether small requests are written in batches through io_uring.
  [[nodiscard]] bool batched() const { return !batches_.empty(); }
  // Requests written whole through io_uring so far.
  [[nodiscard]] uint64_t batched_writes();

 private:
  using AlignedBuffer = std::unique_ptr<uint8_t, decltype(&free)>;

  // Rings and buffers for `n` batched workers, or none at all.
  void open_batches(unsigned n);
  void rethrow_locked();
  // A splice thread: one job at a time from queue_.
  void run();
  // A worker is done with requests of `bytes` in all, `written` of them written through io_uring;
  // the first error is kept for submit() and drain() to throw.
  void finished(uint64_t bytes, uint64_t written, const std::exception_ptr& err);
  // A batched worker. `buf`: kChunkBytes, aligned, for the jobs copied the threads' way.
  void run_batched(DirectBatch& batch, uint8_t* buf);
  // The queued small jobs, up to one batch (at least one; none only when the pool stops).
  [[nodiscard]] std::vector<CopyJob> take_batch();
  // Writes the jobs that can go from mappings through `batch` and copies the others meanwhile. A
  // batched write the kernel did not complete in full is copied again the threads' way (the same
  // bytes to the same place), which also names the file at fault on an I/O error. Returns the
  // first error; `written`: the jobs written whole through `batch`.
  [[nodiscard]] std::exception_ptr copy_batch(std::vector<CopyJob>& jobs, DirectBatch& batch,
                                              uint8_t* buf, SplicePipe& pipe, uint64_t& written);
  // The data of a job for the batched workers (batchable() in copy_pool.cpp) as slices of the
  // sources' mappings (adjacent ones joined); empty where it cannot be written that way: too many
  // sources, one unaligned, or one not mapped (or not wholly inside its mapping: the user-space
  // copy then reads zeros past the end). Starts reading the sources into the page cache.
  [[nodiscard]] std::vector<iovec> mapped_iovecs(const CopyJob& j);

  uint64_t limit_;
  uint64_t splice_piece_;
  CopyGovernor* governor_;
  std::mutex mu_;
  std::condition_variable cv_, small_cv_, done_cv_;
  std::deque<CopyJob> queue_;        // for the splice threads
  std::deque<CopyJob> small_queue_;  // for the batched workers
  uint64_t inflight_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::unique_ptr<SourceMappings> maps_;               // the batched workers' sources
  std::vector<std::unique_ptr<DirectBatch>> batches_;  // one per batched worker
  std::vector<AlignedBuffer> batch_bufs_;              // one per batched worker
  uint64_t batched_writes_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace qcommit::engine
