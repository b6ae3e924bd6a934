// SPDX-License-Identifier: GPL-2.0-or-later
// The offline merge engine: copies everything the layers above BASE (up to and including TOP)
// provide into BASE, so BASE then shows exactly what TOP showed. Same semantics as
// `qemu-img commit -b BASE TOP` followed by `qemu-img rebase -u` of TOP's children.
//
// Our own I/O: only the union of extents allocated above BASE is read, reads sorted by host
// offset, writes cluster-aligned and large, O_DIRECT where the filesystem allows it (else
// buffered with bounded dirty data; see WriteMode), copied inside the kernel (splice into
// O_DIRECT writes, copy_file_range into buffered ones), several requests in flight, paced by a
// CopyGovernor.
// Crash-safe (qcow2::Writer's ordered commits per window) and resumable (checkpoint file).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/layer_delete.h"
#include "engine/layer_users.h"
#include "engine/space.h"
#include "engine/wait_notice.h"
#include "qcow2/error.h"

namespace qcommit::engine {

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::nanoseconds;

// Seconds from `t0` to now, on Clock.
[[nodiscard]] inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline constexpr uint64_t kChunkBytes = 2ull << 20;             // one copy request
inline constexpr uint64_t kDefaultInflightBytes = 32ull << 20;  // unthrottled queue depth
inline constexpr uint64_t kWindowBytes = 512ull << 20;          // guest bytes per commit
inline constexpr uint64_t kMaxDirtyMetadataBytes = 8ull << 20;  // commit earlier if exceeded
// Threads (and so O_DIRECT requests in flight, unthrottled): 16 measured 0.40 s vs 0.43 s (seq4g)
// and 0.83 s vs 0.90 s (rand4g) against 8 (medians of 8 and 6 alternated runs).
inline constexpr unsigned kDefaultIoThreads = 16;
// With WriteMode::kAuto, requests at least this large bypass the page cache.
inline constexpr uint64_t kMinDirectRequestBytes = 64ull << 10;

// How BASE's data is written.
enum class WriteMode : uint8_t {
  // O_DIRECT for every aligned request: what is queued is exactly what is in flight (governed).
  kDirect,
  // Page cache, writeback started per request (sync_file_range), a flush per window.
  kBuffered,
  // O_DIRECT for aligned requests of at least kMinDirectRequestBytes, in place or into new
  // space (the source's cached pages are spliced into the write, nothing is copied through user
  // space or dirtied), and for the aligned pieces of a cluster overwritten in place whatever
  // their size; the page cache for other smaller requests and for unaligned ones.
  kAuto,
};

// Paces the copy. The engine asks before each write request and reports each completion.
// Implementations decide; the engine sleeps for the returned duration.
class CopyGovernor {
 public:
  virtual ~CopyGovernor() = default;
  // How long to wait before issuing a write of `bytes` while `inflight` bytes are outstanding.
  [[nodiscard]] virtual Duration admit(Clock::time_point now, uint64_t bytes, uint64_t inflight) = 0;
  virtual void completed(Clock::time_point now, uint64_t bytes, Duration latency) = 0;
  // Called about every tick while the copy runs (and while it waits).
  virtual void tick(Clock::time_point /*now*/) {}
  // Called once, after every check that could refuse the merge has passed and before its first
  // write: a governor creates what it needs beside BASE (a probe's scratch file) only now, so a
  // refused merge creates nothing there. May throw (the merge then fails, nothing written).
  virtual void begin(Clock::time_point /*now*/) {}
  // Largest write request the governor wants now (the engine splits and coalesces copies up to
  // this, within [kDirectAlignment-multiple, kChunkBytes]): a request larger than the window
  // would queue more ahead of co-tenants than the window allows.
  [[nodiscard]] virtual uint64_t preferred_request_bytes() { return kChunkBytes; }
};

struct Progress {
  uint64_t done_bytes = 0;
  uint64_t total_bytes = 0;
  double elapsed_s = 0;
  double rate_bps = 0;
  std::string phase;  // "plan", "resume", "copy", "switch", "done"
  uint64_t resume_offset = 0;  // "resume": the guest offset the interrupted run had committed
};

struct MergeResult;

struct MergeOptions {
  std::string top;
  std::optional<std::string> base;  // default: TOP's backing file
  std::vector<std::string> rebase;  // images whose backing file is TOP
  // How long to wait for another process (a backup tool, `qemu-img info`, a monitoring agent)
  // to release an image the merge must lock; 0: refuse at once. A running guest's QEMU is never
  // waited for. on_lock_wait is told once per wait (engine/wait_notice.h): a lock (who holds
  // it), a layer --delete removes that is still open, a device node not there yet; the --domain
  // form also tells a domain shutting down.
  Duration lock_wait = Duration::zero();
  LockWaitNotice on_lock_wait;
  // Backing files must lie inside these directory trees (empty: anywhere).
  std::vector<std::string> allowed_backing_dirs;
  bool delete_merged = false;
  // With delete_merged: who else uses a merged layer, beyond the qcow2 images in the layers' own
  // directories that the engine finds itself (engine/layer_users.h): the CLI's libvirt domains
  // and the images in its storage pools. A layer with users is never deleted: the merge is
  // refused before anything is written, and asked again right before the unlinks.
  FindLayerUsers find_users;
  WriteMode write_mode = WriteMode::kDirect;  // O_DIRECT only where the filesystem allows it
  unsigned io_threads = kDefaultIoThreads;
  // Without a governor: write O_DIRECT requests under 64 KiB in batches through io_uring,
  // straight from mappings of the layers (engine/direct_batch.h), where the kernel allows it.
  // Larger requests, every request where io_uring cannot be set up, and every request with a
  // governor (which admits each on its own) are spliced by io_threads threads.
  bool io_uring = true;
  uint64_t inflight_bytes = kDefaultInflightBytes;
  uint64_t window_bytes = kWindowBytes;
  std::shared_ptr<CopyGovernor> governor;  // null: unthrottled
  std::function<void(const Progress&)> on_progress;
  // Test hook: called after each committed window with the checkpointed guest offset.
  std::function<void(uint64_t)> on_checkpoint;
  // Test seam: called right before each write the merge makes to disk, named ("grow",
  // "zero-grown", "data", "window-commit", "checkpoint", "bitmaps", "child-zero" (a child's zeros
  // past TOP's end, engine/rebase.h), "rebase", "delete", and the qcow2 writer's persistence
  // points "data-flush", "l2-tables", "header", ..., BASE's and each child's). A crash test
  // stops the process here.
  std::function<void(std::string_view point)> on_write_point;
  // Runs after the copy and the switch while every image lock is still held (a QEMU that starts
  // now cannot open TOP or BASE): orchestration that must not race a starting guest (a domain's
  // definition, deletions) belongs here. What it throws fails the merge; the data is merged by
  // then, so running the same command again finishes the rest.
  std::function<void(MergeResult&)> while_locked;
  // Returns an error message, or empty when the options are usable.
  [[nodiscard]] std::string validate() const;
};

struct MergeResult {
  std::string top, base;
  std::vector<std::string> merged_layers;  // TOP and intermediates
  std::vector<std::string> rebased;
  std::vector<std::string> deleted;
  // --delete: merged layers (names) left in place, with why. The checkpoint stays (listing what
  // is left to delete), so the same command again finishes the job.
  std::vector<NotDeleted> not_deleted;
  uint64_t copied_bytes = 0;
  uint64_t zeroed_bytes = 0;
  uint64_t skipped_zero_bytes = 0;  // zero ranges BASE already read as zeros
  // Of clusters new to BASE that TOP provides only part of: the bytes around TOP's pieces, not
  // written because BASE's view there is zeros and the space the cluster got reads as zeros.
  uint64_t zeros_left_unwritten = 0;
  bool resumed = false;             // an interrupted run of this same merge was found and finished
  uint64_t resumed_from = 0;        // guest offset a previous run had checkpointed
  // The interrupted run's checkpoint did not describe BASE any more (BASE replaced, rolled back
  // to an internal snapshot or restored since): the copy started over from offset 0.
  bool base_changed = false;
  uint64_t leaks_repaired = 0;
  size_t bitmaps_removed = 0;
  bool base_grown = false;
  bool direct_io = false;  // O_DIRECT was available for (large) requests
  bool io_uring = false;   // small requests could go in batches through io_uring (rings set up)
  uint64_t io_uring_writes = 0;  // requests written whole that way
  double copy_seconds = 0;
  double switch_seconds = 0;  // rebase of children + final header updates
  double total_seconds = 0;
};

// What a merge would do, computed without writing anything.
struct MergePlan {
  std::vector<std::string> layers;  // TOP and intermediates, top first
  std::string base, base_format;
  size_t base_depth = 0;
  uint64_t top_size = 0, base_size = 0;
  uint64_t data_bytes = 0;        // bytes to copy
  uint64_t zero_bytes = 0;        // ranges that must read as zeros (flags on qcow2 v3 bases)
  uint64_t compressed_bytes = 0;  // of data_bytes, decompressed on the way
  size_t extents = 0;
  uint32_t base_snapshots = 0;    // internal snapshots: shared clusters are copied on write
  uint32_t base_bitmaps = 0;      // persistent bitmaps the merge removes
  std::vector<std::string> rebase;
  std::optional<uint64_t> resume_from;  // a matching checkpoint of an interrupted run
  std::vector<LayerUser> users;  // with delete_merged: who uses a merged layer (the merge refuses)
  SpaceNeed space;  // what the merge (from resume_from on) takes from BASE's filesystem
};
[[nodiscard]] MergePlan plan_merge(const MergeOptions& options);

// BASE's storage ran out of room (ENOSPC, EDQUOT) while the merge wrote. Its checkpoint, when it
// had written one, stays: the same merge run again once there is room resumes from it. Names
// BASE; problem() is the failure as the system reported it.
class NoSpaceError : public qcow2::IoError {
 public:
  NoSpaceError(std::string base, const std::string& problem, int err, SpaceNeed need_left,
               std::optional<uint64_t> checkpointed)
      : IoError(std::move(base), problem, err), need(need_left), resume_from(checkpointed) {}
  SpaceNeed need;  // what is left to write from the checkpoint on, and what is free now
  std::optional<uint64_t> resume_from;  // the checkpoint's guest offset; none: nothing written
};

// Runs the merge; throws qcow2::Error (naming the file) on bad input, refusal or I/O failure,
// NoSpaceError when BASE's storage is full.
MergeResult merge(const MergeOptions& options);

// Where the checkpoint of a merge into `base` lives.
[[nodiscard]] std::string checkpoint_path(const std::string& base);

}  // namespace qcommit::engine
