// SPDX-License-Identifier: GPL-2.0-or-later
// Writeback pacing of a job's target file: the daemon starts writeback of the target's dirty
// pages itself, in small pieces, so that the bytes queued at storage (pages under writeback)
// stay within the controller's window instead of leaving gigabytes to the kernel's flusher,
// which writes them in bursts that queue ahead of the guests' flushes.
//
// WritebackPlanner is pure (it asks a probe for the dirty bytes of a range and returns the
// ranges to start writing back); PageCacheFile is the syscall adapter (cachestat(2) with a
// /proc/meminfo fallback, sync_file_range(SYNC_FILE_RANGE_WRITE)).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/storage_kind.h"
#include "throttle/controller.h"

namespace qcommit::plugin {

using engine::StorageKind;
using engine::storage_kind_at;

struct ByteRange {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool operator==(const ByteRange&) const = default;
};

// 64 KiB: the window on 50 MB/s storage with a 20 ms budget is ~1 MiB and starts far below;
// with 256 KiB pieces only one piece fitted and storage sat idle ~80 % of a governed merge.
inline constexpr std::uint64_t kWritebackPieceBytes = 64 * 1024;
inline constexpr std::uint32_t kMaxWritebackProbesPerTick = 16384;  // 1 GiB of file per tick
inline constexpr std::uint64_t kWritebackSkipPieces = 64;           // clean spans skipped per probe
// Issued ranges the pacer re-reads between whole-file readings (one cachestat each).
inline constexpr std::size_t kMaxTrackedWritebackRanges = 32;
// The pacer's window is issued in ranges of at most 1/kWritebackRangesPerWindow of it (never below
// one piece), each its own request at storage: while one is written the next waits at storage, so
// storage never sits idle between the pacer's noticing that one is done and its issuing the next.
// Merged into one range, two adjacent pieces under a window of ~200 KiB (a busy guest's, 50 MB/s
// storage, 20 ms budget) went to storage as one 128 KiB request at a time, each after the
// previous one's end plus ~1.9 ms: storage idle 45 % of a merge that took 2.8x its unpaced time
// (FUSE trace, 2026-12-07).
inline constexpr std::uint64_t kWritebackRangesPerWindow = 4;

struct WritebackConfig {
  std::uint64_t piece_bytes = kWritebackPieceBytes;  // granularity of probes and writeback
  std::uint32_t max_probes_per_tick = kMaxWritebackProbesPerTick;
  [[nodiscard]] std::optional<std::string> validate() const;
};

struct WritebackInput {
  std::uint64_t file_size = 0;
  std::uint64_t writeback_bytes = 0;  // pages of the file already under writeback
  std::uint64_t window_bytes = 0;     // the controller's window
  std::uint64_t max_range_bytes = 0;  // adjacent pieces are merged up to this (0: no limit)
};

struct WritebackPlan {
  std::vector<ByteRange> ranges;  // start writeback of these (merged, ascending per lap)
  std::uint64_t dirty_bytes_issued = 0;
  // The whole file was probed: nothing else is dirty (as of this plan).  A caller whose dirty
  // estimate is higher (the kernel's flusher took some) can stop sweeping until it re-reads.
  bool lapped = false;
};

class WritebackPlanner {
 public:
  explicit WritebackPlanner(WritebackConfig cfg = {}) : cfg_(cfg) {}

  // Dirty bytes (not yet under writeback) in a range.
  using DirtyProbe = std::function<std::uint64_t(const ByteRange&)>;

  // Sweeps the file from where the previous plan stopped.  Guarantees
  //   writeback_bytes + dirty_bytes_issued <= window_bytes,
  // except that when nothing is under writeback one piece may be issued (liveness).
  [[nodiscard]] WritebackPlan plan(const WritebackInput& in, const DirtyProbe& dirty_in);

  [[nodiscard]] std::uint64_t cursor() const { return cursor_; }
  [[nodiscard]] const WritebackConfig& config() const { return cfg_; }

 private:
  WritebackConfig cfg_;
  std::uint64_t cursor_ = 0;
};

// The longest range the pacer issues under `window_bytes`: a kWritebackRangesPerWindow-th of it,
// whole pieces, at least one.
[[nodiscard]] std::uint64_t writeback_range_bytes(std::uint64_t window_bytes,
                                                  std::uint64_t piece_bytes);

struct PageCacheState {
  std::uint64_t dirty_bytes = 0;
  std::uint64_t writeback_bytes = 0;
  bool per_file = true;  // false: the host-wide /proc/meminfo fallback (an upper bound)
  // dirty_bytes bounds the file's from above (its memory cgroup's: memcg_target.h), it may be
  // above zero while the file is clean.
  bool dirty_upper_bound = false;
};

// Ranges a pacer started writeback on, merged while adjacent, at most `max_ranges` (past that
// the last two are joined into one covering range: an over-estimate, never an under-estimate).
class IssuedRanges {
 public:
  explicit IssuedRanges(std::size_t max_ranges = kMaxTrackedWritebackRanges) : max_(max_ranges) {}
  void add(const ByteRange& r);
  // Sum of the writeback bytes `read` reports over the ranges; ranges with nothing under
  // writeback any more are dropped from the list, and those also without dirty bytes (written,
  // clean) are appended to `clean` when given.  nullopt (and the list kept) when a reading fails.
  [[nodiscard]] std::optional<std::uint64_t> under_writeback(
      const std::function<std::optional<PageCacheState>(const ByteRange&)>& read,
      std::vector<ByteRange>* clean = nullptr);
  [[nodiscard]] const std::vector<ByteRange>& ranges() const { return ranges_; }
  void clear() { ranges_.clear(); }

 private:
  std::size_t max_;
  std::vector<ByteRange> ranges_;
};

// One fdatasync of a file at a time, in a thread of its own (a settle, TargetFile::start_settle).
// The thread syncs a duplicate of the descriptor, so it may outlive its owner.
class BackgroundDatasync {
 public:
  // False while the previous one runs, or when none can be started.
  [[nodiscard]] bool start(int fd);
  [[nodiscard]] bool busy() const { return busy_->load(); }

 private:
  std::shared_ptr<std::atomic<bool>> busy_ = std::make_shared<std::atomic<bool>>(false);
};

// The size and storage device (storage_device_of: st_rdev for a block device, else st_dev) of an
// open target file (0 and nullopt when fstat fails): what every TargetFile reports as size() and
// device().
[[nodiscard]] std::uint64_t target_size(int fd);
[[nodiscard]] std::optional<std::uint64_t> target_device(int fd);

// The job's target file as the governor sees it.
class TargetFile {
 public:
  virtual ~TargetFile() = default;
  [[nodiscard]] virtual std::uint64_t size() = 0;
  [[nodiscard]] virtual std::optional<std::uint64_t> device() = 0;  // st_dev
  [[nodiscard]] virtual std::optional<PageCacheState> page_cache() = 0;
  // The page cache of one range (cachestat over it: cost in proportion to its cached pages).
  // nullopt when only the system-wide fallback is available.
  [[nodiscard]] virtual std::optional<PageCacheState> page_cache_in(const ByteRange& r) = 0;
  [[nodiscard]] virtual std::uint64_t dirty_in(const ByteRange& r) = 0;
  virtual void start_writeback(const ByteRange& r) = 0;
  // Evicts the range's clean pages from the page cache (posix_fadvise DONTNEED): what the job
  // wrote and storage has is not kept cached (it would crowd out the guests' cache, and every
  // page cached makes each page-cache reading of the file slower).  Only called on ranges seen
  // clean (nothing dirty or under writeback), since DONTNEED starts writeback of dirty pages.
  virtual void drop_cached(const ByteRange& r) = 0;
  // Makes the file clean in the kernel's eyes: fdatasync in the background (the inode leaves
  // the dirty list, and the next page dirtied starts a fresh vm.dirty_expire clock).  False when
  // the previous one is still running.
  [[nodiscard]] virtual bool start_settle() = 0;
  [[nodiscard]] virtual bool settling() = 0;
  // The busy periods of the writeback started on the file (completion_clock.h ServiceMeter:
  // bytes written over the time it took) since the previous call; none where they are not timed.
  [[nodiscard]] virtual std::vector<throttle::CopySample> take_service_samples() { return {}; }
};

// vm.dirty_expire_centisecs as a duration (nullopt when unreadable).
[[nodiscard]] std::optional<std::chrono::milliseconds> dirty_expire();

// The shared-queue probe's I/O (throttle/probe.h): one small write + fdatasync at a time of a
// file of our own beside a job's target, in the background.
class ProbeFile {
 public:
  virtual ~ProbeFile() = default;
  // Starts one write + fdatasync in the background; false while the previous one runs or when
  // it cannot be started.
  [[nodiscard]] virtual bool start() = 0;
  [[nodiscard]] virtual bool busy() = 0;
  // The latency of the probe that completed last, once (nullopt: none since the last call, or
  // it failed).
  [[nodiscard]] virtual std::optional<std::chrono::nanoseconds> take() = 0;
  // What went wrong with the last probe that failed, naming the file and the error ("" when
  // none failed or the implementation cannot tell).
  [[nodiscard]] virtual std::string failure() { return {}; }
};

// A probe file, or why there is none: one line naming the file (or the target) and the reason,
// for the daemon's log and `qcommit status`.
struct ProbeOpening {
  std::unique_ptr<ProbeFile> file;
  std::string why_not;  // set when `file` is nullptr
};

class TargetFiles {
 public:
  virtual ~TargetFiles() = default;
  // A probe file on the storage of the target at `path`, or why there is none (the target is not
  // a file on a filesystem we can write to).
  [[nodiscard]] virtual ProbeOpening open_probe(const std::string& path) {
    return {nullptr, "no probe files here (target " + path + ")"};
  }
  // The filesystem the target at `path` is on and whether other hosts can share it
  // (engine/storage_kind.h); nullopt when it cannot be told.
  [[nodiscard]] virtual std::optional<StorageKind> storage_kind(const std::string& path) {
    (void)path;
    return std::nullopt;
  }
  // nullptr when the file cannot be opened.
  [[nodiscard]] virtual std::unique_ptr<TargetFile> open(const std::string& path) = 0;
  // The image a non-active commit writes into, of the disk whose active layer is `active` and
  // whose backing files are `chain` (top to bottom); nullopt when the host cannot tell.
  [[nodiscard]] virtual std::optional<std::string> commit_base(
      const std::string& active, const std::vector<std::string>& chain) = 0;
  // The guest ranges a non-active commit of `layers` (qcow2 images) copies: the union of their
  // qcow2::own_extents, ascending and merged; nullopt when one cannot be read as qcow2.
  [[nodiscard]] virtual std::optional<std::vector<ByteRange>> commit_extents(
      const std::vector<std::string>& layers) {
    (void)layers;
    return std::nullopt;
  }
};

// Where a target's page cache is read: auto (cachestat(2) where the kernel has it, else
// no-cachestat), no-cachestat (what a kernel before 6.5 gets, forced: completion-clocked
// writeback and QEMU's memory cgroup, memcg_target.h; /proc/meminfo where QEMU or its cgroup is
// not found), no-cachestat-shadow (no-cachestat that also reads cachestat(2) at each whole-file
// reading and logs both: tests), or meminfo forced (the host-wide count with fdatasync of the
// target; diagnostics, tests).
enum class PageCacheSource { kAuto, kMeminfo, kNoCachestat, kNoCachestatShadow };
[[nodiscard]] std::optional<PageCacheSource> parse_page_cache_source(const std::string& s);
// "auto", "meminfo", "no-cachestat", "no-cachestat-shadow".
[[nodiscard]] const char* page_cache_source_name(PageCacheSource s);

// Real files: open(O_RDONLY|O_CLOEXEC), cachestat(2) (syscall 451, kernel >= 6.5) or the
// /proc/meminfo Dirty+Writeback fallback (host-wide: only an upper bound of the file's),
// sync_file_range(SYNC_FILE_RANGE_WRITE).
// commit_base: the lowest backing image that the QEMU holding `active` has open read-write
// (proc_fds.h).
// Without cachestat (or with no-cachestat forced) a target is read through QEMU's memory cgroup:
// the QEMU holding the target open for writing (proc_fds.h writer_of), its cgroup from
// /proc/PID/cgroup (memcg.h); where either is not found, /proc/meminfo as before.  `note` (when
// set) is told, per target opened, which source reads it and why, and in shadow mode each
// estimate next to cachestat's truth.
class SystemTargetFiles final : public TargetFiles {
 public:
  using Note = std::function<void(const std::string&)>;
  explicit SystemTargetFiles(PageCacheSource source = PageCacheSource::kAuto, Note note = {})
      : source_(source), note_(std::move(note)) {}
  [[nodiscard]] std::unique_ptr<TargetFile> open(const std::string& path) override;
  // A file created in the target's directory (when that is the target's filesystem) and
  // unlinked at once; 4 KiB O_DIRECT writes where the filesystem takes them.  Why not, naming
  // the file and strerror(3)'s text: the directory refuses new files (read-only mount, sandboxed
  // unit, permissions), the target is no regular file, its directory is another filesystem.
  [[nodiscard]] ProbeOpening open_probe(const std::string& path) override;
  [[nodiscard]] std::optional<StorageKind> storage_kind(const std::string& path) override {
    return storage_kind_at(path);
  }
  [[nodiscard]] std::optional<std::string> commit_base(
      const std::string& active, const std::vector<std::string>& chain) override;
  [[nodiscard]] std::optional<std::vector<ByteRange>> commit_extents(
      const std::vector<std::string>& layers) override;

 private:
  [[nodiscard]] std::unique_ptr<TargetFile> open_without_cachestat(int fd, const std::string& path);
  void tell(const std::string& s) const {
    if (note_) note_(s);
  }
  PageCacheSource source_;
  Note note_;
};

// Which source reads targets with `source` on this kernel, and why (start logs, doctor).
[[nodiscard]] std::string describe_page_cache_source(PageCacheSource source);

// Whether this kernel has cachestat(2) (>= 6.5).  Without it the page cache of a job's target is
// read host-wide from /proc/meminfo, an upper bound of the job's (see Governor::tick).
[[nodiscard]] bool cachestat_available();
// Parses /proc/meminfo text: Dirty + Writeback in bytes.  nullopt when absent.
[[nodiscard]] std::optional<PageCacheState> parse_meminfo(const std::string& text);
// parse_meminfo of /proc/meminfo.
[[nodiscard]] std::optional<PageCacheState> read_meminfo();
// cachestat(2) of a range of `fd` (length 0: to the end); nullopt when it fails.
[[nodiscard]] std::optional<PageCacheState> cachestat_of(int fd, const ByteRange& r);

}  // namespace qcommit::plugin
