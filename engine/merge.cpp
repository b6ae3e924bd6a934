// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/merge.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "engine/base_fingerprint.h"
#include "engine/checkpoint.h"
#include "engine/copy_pool.h"
#include "engine/image_lock.h"
#include "engine/node_wait.h"
#include "engine/proc_walk.h"
#include "engine/rebase.h"
#include "engine/storage_kind.h"
#include "qcow2/chain.h"
#include "qcow2/check.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"
#include "qcow2/writer.h"

namespace qcommit::engine {

namespace fs = std::filesystem;
using qcow2::Chain;
using qcow2::Error;
using qcow2::Format;
using qcow2::IoError;
using qcow2::MapEntry;

namespace {

inline constexpr auto kProgressInterval = std::chrono::milliseconds(200);
// Unthrottled, a window's copies wait to be issued together (issue_deferred); clusters assembled
// over a view of BASE that had to be read (BASE's backing file shows there, or it holds part of
// the cluster) keep that view in memory until then. Past this many bytes they are issued early.
inline constexpr uint64_t kMaxHeldViewBytes = 32ull << 20;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Same inode, or the same block device through two nodes (/dev/vg/lv, /dev/mapper/vg-lv).
// Not fs::equivalent: libstdc++'s refuses device files (ENOTSUP), so a BASE on a logical volume
// or loop device was "not in the backing chain".
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  if (S_ISBLK(sa.st_mode) && S_ISBLK(sb.st_mode)) return sa.st_rdev == sb.st_rdev;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// BASE once more with O_DIRECT, through the descriptor already open (/proc/self/fd names that
// very file even if its path was swapped since), and checked to be the same file. -1 where the
// filesystem refuses O_DIRECT (then the copy is buffered).
UniqueFd reopen_direct(const qcow2::FileDevice& base) {
  const std::string self = "/proc/self/fd/" + std::to_string(base.fd());
  UniqueFd fd(::open(self.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC));
  struct stat a {}, b {};
  if (fd.get() < 0 || ::fstat(fd.get(), &a) != 0 || ::fstat(base.fd(), &b) != 0) return UniqueFd();
  if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) throw Error(base.name(), "changed while the merge opened it");
  return fd;
}

// Pages of `fd` in the page cache, counted with mincore(2) over read-only mappings of at most
// kResidencySliceBytes (any kernel; cachestat(2) needs 6.5).
inline constexpr uint64_t kResidencySliceBytes = 1ull << 30;
uint64_t cached_pages(int fd) {
  const off_t size = ::lseek(fd, 0, SEEK_END);
  uint64_t pages = 0;
  std::vector<unsigned char> vec(kResidencySliceBytes / kPageBytes);
  for (uint64_t off = 0; off < uint64_t(std::max<off_t>(size, 0)); off += kResidencySliceBytes) {
    const uint64_t len = std::min<uint64_t>(kResidencySliceBytes, uint64_t(size) - off);
    void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, off_t(off));
    if (m == MAP_FAILED) return 0;  // not mappable: nothing to verify
    if (::mincore(m, len, vec.data()) == 0)
      for (uint64_t i = 0; i < (len + kPageBytes - 1) / kPageBytes; ++i) pages += vec[i] & 1;
    ::munmap(m, len);
  }
  return pages;
}

// Writes back what an interrupted run left dirty in BASE's page cache. A write-back that failed
// while nobody was left to see it (the run died first) is reported once, to the first fsync on a
// file opened after it: that error belongs to the interrupted run, whose unwritten pages are
// dropped next and read again from the storage. So one error is taken as that report and the
// write-back asked again; an error the second time is the storage failing now.
void write_back_before_resuming(int fd, const std::string& path) {
  if (::fdatasync(fd) == 0 || ::fdatasync(fd) == 0) return;
  throw IoError(path, std::string("cannot write back cached pages before resuming: ") + strerror(errno), errno);
}

// Why BASE's cached pages could not be dropped, naming only what was seen: the processes that
// have it open, else the pages left and the filesystem they are on.
std::string undroppable_pages_problem(const std::string& path, uint64_t pages_left,
                                      const std::optional<StorageKind>& kind) {
  std::string problem = "cannot drop its cached pages to read it from storage before resuming an interrupted merge (" +
                        std::to_string(pages_left) + " pages stayed after a write-back and a drop, on " +
                        (kind ? kind->fs : std::string("a filesystem of unknown type")) + ")";
  if (const std::vector<Holder> holders = holders_of(path, Access::any); !holders.empty())
    return problem + "; it is open in " + describe(holders) + ": close it and run the merge again";
  return problem + "; no other process has it open";
}

// A run that finds BASE's checkpoint reads BASE from its storage, not from the page cache. After a
// failed writeback (EIO; ENOSPC on a thin or network volume) the kernel keeps the pages it could
// not write as clean, cached pages: the interrupted run's metadata would be read back as if it
// were on disk, and a leak repair judged on it could free clusters that the on-disk tables still
// use. So: write back what is still dirty, drop every cached page, and check that none is left.
void drop_cached_pages(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return;  // opening the chain reports it
  // The page cache is the storage (tmpfs; an overlay or eCryptfs over tmpfs): nothing to read
  // again, and nothing can be dropped.
  const std::optional<StorageKind> kind = storage_kind_beneath(fd.get());
  if (kind && kind->in_memory) return;
  write_back_before_resuming(fd.get(), path);
  uint64_t left = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    left = cached_pages(fd.get());
    if (left == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  throw Error(path, undroppable_pages_problem(path, left, kind));
}

// Step 6 of a merge: the copy, window by window. Zeros, compressed data and BASE's new clusters
// in guest order (BASE stays sequential for later reads); pieces BASE holds in place in its host
// order; each window committed (data, flush, refcounts, L2, L1/header) and then checkpointed.
class WindowCopier {
 public:
  WindowCopier(const MergeOptions& options, MergeResult& result, Chain& source_chain, size_t base_layer,
               qcow2::Writer* base_writer, const std::string& checkpoint, const std::string& merge_identity,
               uint64_t total_bytes, Clock::time_point started)
      : opt(options),
        res(result),
        chain(source_chain),
        base_depth(base_layer),
        base(chain.layer(base_layer)),
        writer(base_writer),
        cp_path(checkpoint),
        identity(merge_identity),
        total(total_bytes),
        t_start(started),
        top_size(chain.virtual_size()),
        dst_dev(base.qcow2 ? base.qcow2->data_device() : *base.raw),
        dst_file(dynamic_cast<qcow2::FileDevice*>(&dst_dev)),
        dst_name(base.path) {
    if (!dst_file) throw Error(base.path, "internal: base is not a file");
    if (opt.write_mode != WriteMode::kBuffered) direct_fd = reopen_direct(*dst_file);
    res.direct_io = direct_fd.valid();
    buffered = !direct_fd.valid();
    bulk_fd = buffered ? dst_file->fd() : direct_fd.get();
    raw_base_is_blockdev = !base.qcow2 && dst_file->is_block_device();
    base_view = [this](uint64_t o, std::span<uint8_t> out) { chain.read(o, out, base_depth); };
    // O_DIRECT writes go out in pieces the device takes as one request each, whole clusters of
    // BASE where a cluster fits; an unthrottled request is a whole number of such pieces.
    const uint64_t grain = base.qcow2 ? std::max(kDirectAlignment, base.qcow2->cluster_size()) : kDirectAlignment;
    splice_piece = direct_fd.valid() ? device_request_bytes(direct_fd.get()) : kChunkBytes;
    if (splice_piece >= grain) {
      splice_piece -= splice_piece % grain;
      unthrottled_request -= kChunkBytes % splice_piece;
    }
    pool = std::make_unique<CopyPool>(opt.io_threads, opt.inflight_bytes, opt.governor.get(),
                                      splice_piece, opt.io_uring && direct_fd.valid());
    res.io_uring = pool->batched();
    defer_jobs = !opt.governor && direct_fd.valid() && writer;
    if (writer) {
      l1_span = base.qcow2->geometry().l1_entry_span();
      max_l2s = std::max<uint64_t>(1, kMaxDirtyMetadataBytes / base.qcow2->cluster_size());
    }
  }

  // Copies `extents` (what the layers above BASE provide, in guest order) into BASE. Returns the
  // bytes done (those of `extents`).
  //
  // A window ends on a cluster boundary of BASE. Inside an extent the cut is aligned below; a full
  // window whose last piece ends inside a cluster (an extent of TOP ends there, and the cluster's
  // other pieces, e.g. the next subclusters TOP has, are further extents) first takes the rest
  // of that cluster's pieces, up to `cut_at`: split over two windows, a cluster new to BASE was
  // written whole in the first and rewritten in place for its later pieces in the second. The
  // window is over its bytes by less than a cluster and touches no further L2 table.
  uint64_t run(const std::vector<MapEntry>& extents) {
    report(true);
    uint64_t cut_at = 0;  // non-zero: the window is full and ends at this guest offset
    for (const MapEntry& e : extents) {
      uint64_t off = e.start;
      const uint64_t end = e.start + e.length;
      while (off < end) {
        if (cut_at && off >= cut_at) {  // nothing more of the cluster the full window ended in
          run_window(cut_at);
          cut_at = 0;
        }
        uint64_t piece_end = cut_at ? std::min(end, cut_at) : std::min(end, off + (opt.window_bytes - window_bytes));
        if (writer) {
          const auto& g = base.qcow2->geometry();
          if (piece_end < end && !cut_at)
            piece_end = g.align_down(piece_end) > off ? g.align_down(piece_end) : std::min(end, g.align_up(off + 1));
          // Do not let one piece span more L1 entries than the window may still touch.
          const uint64_t l1 = off / l1_span;
          if (l1 != last_l1) {
            ++window_l2s;
            last_l1 = l1;
          }
          const uint64_t l1_end = (l1 + 1) * l1_span;
          if (piece_end > l1_end) piece_end = l1_end;
        }
        window.push_back({off, piece_end, &e});
        window_bytes += piece_end - off;
        off = piece_end;
        if (!cut_at && (window_bytes >= opt.window_bytes || (writer && window_l2s >= max_l2s)))
          cut_at = writer ? base.qcow2->geometry().align_up(off) : off;
        if (cut_at && off >= cut_at) {
          run_window(off);
          cut_at = 0;
        }
      }
    }
    if (!window.empty()) run_window(top_size);  // else everything is committed already
    res.copy_seconds = seconds_since(t_copy);
    res.io_uring_writes = pool->batched_writes();
    report(true);
    return done_bytes;
  }

 private:
  // A window: pieces in guest order, bounded in bytes and in L2 tables touched (dirty metadata).
  struct Piece {
    uint64_t start, end;
    const MapEntry* e;
  };

  void progress(const Progress& p) {
    if (opt.on_progress) opt.on_progress(p);
  }
  void point(std::string_view name) {
    if (opt.on_write_point) opt.on_write_point(name);
  }

  void report(bool force) {
    auto now = Clock::now();
    if (!force && now - last_progress < kProgressInterval) return;
    last_progress = now;
    const double el = seconds_since(t_copy);
    progress({done_bytes, total, seconds_since(t_start), el > 0 ? double(done_bytes) / el : 0, "copy"});
  }

  void commit_window(uint64_t upto) {
    pool->drain();  // callers have submitted their pending request
    if (writer) {
      writer->commit();
    } else {
      dst_dev.flush();
    }
    point("checkpoint");
    save_checkpoint(cp_path, {identity, upto, base_fingerprint(base, upto), {}});
    if (opt.on_checkpoint) opt.on_checkpoint(upto);
    window_bytes = 0;
  }

  // kAuto: O_DIRECT for every aligned request of at least kMinDirectRequestBytes, in place or
  // into new space, and for the aligned pieces of a cluster overwritten in place whatever their
  // size (pending_small_direct); other smaller ones through the page cache. (Through the page
  // cache every byte is copied once more in the kernel and 16 writers queue on BASE's inode
  // lock: rand4g spent 1.7-2.0 s of system CPU per GiB that way against 0.43-0.46 s O_DIRECT,
  // and took 2.4x as long on a busy host; rand4g4k's 4-60 KiB pieces in place took 0.23 s of
  // system CPU O_DIRECT against 0.28 s, in the same time; docs/benchmarks.md.)
  void submit_pending() {
    if (opt.write_mode == WriteMode::kAuto && pending.direct_dst && pending.length < kMinDirectRequestBytes &&
        !pending_small_direct) {
      pending.dst_fd = dst_file->fd();  // through the page cache, writeback started at once
      pending.direct_dst = false;
      pending.buffered_dst = true;
    }
    pending_small_direct = false;
    if (pending.length) {
      if (defer_jobs) {
        for (const AssembledCluster& c : pending.clusters) held_view_bytes += c.view.size();
        deferred.push_back(std::move(pending));
      } else {
        point("data");
        pool->submit(std::move(pending));
      }
    }
    pending = CopyJob{};
    if (held_view_bytes > kMaxHeldViewBytes) issue_deferred();
  }

  // Unthrottled, a window's copies are planned before any is issued, so that the new space they
  // write past BASE's end is allocated with one fallocate(2): O_DIRECT writes then fill unwritten
  // extents under the inode's shared lock (ext4, XFS) instead of allocating request by request
  // under its exclusive lock, and the filesystem lays the new clusters out in one piece. The
  // space is BASE's file size only: clusters past the last refcounted one are free, a crash
  // leaves them for the next allocation. Best effort: where fallocate is refused the writes
  // allocate as before (and report ENOSPC themselves).
  void issue_deferred() {
    if (!defer_jobs) return;
    uint64_t end = 0;
    for (const CopyJob& j : deferred)
      if (j.direct_dst) end = std::max(end, j.dst_offset + j.length);
    struct stat st {};
    if (end > 0 && ::fstat(dst_file->fd(), &st) == 0 && uint64_t(st.st_size) < end)
      (void)::fallocate(dst_file->fd(), 0, off_t(st.st_size), off_t(end - uint64_t(st.st_size)));
    for (CopyJob& j : deferred) {
      point("data");
      pool->submit(std::move(j));
    }
    deferred.clear();
    held_view_bytes = 0;
  }

  uint64_t request_bytes() {
    if (!opt.governor) return unthrottled_request;
    const uint64_t r = std::clamp<uint64_t>(opt.governor->preferred_request_bytes(), kDirectAlignment, kChunkBytes);
    return r - r % kDirectAlignment;
  }

  // Bulk copies src→dst. Adjacent requests contiguous in the destination are coalesced (their
  // sources gathered) up to the governor's preferred request size (at most kChunkBytes), a whole
  // number of device requests unthrottled; the destination must be aligned for O_DIRECT, else the
  // buffered fd is used. kAuto sends requests smaller than kMinDirectRequestBytes through the page
  // cache.
  // small_direct: kAuto writes the request O_DIRECT (where aligned) even when it is small.
  void submit_copy(int src_fd, const std::string& src_name, uint64_t src_off, uint64_t dst_off,
                   uint64_t len, bool small_direct = false) {
    const uint64_t chunk = request_bytes();
    for (uint64_t p = 0; p < len;) {
      const uint64_t n = std::min(chunk, len - p);
      const bool aligned = (dst_off + p) % kDirectAlignment == 0 && n % kDirectAlignment == 0;
      const int fd = aligned ? bulk_fd : dst_file->fd();
      if (pending.length && pending.clusters.empty() && pending.dst_fd == fd &&
          pending.dst_offset + pending.length == dst_off + p && pending.length + n <= chunk) {
        CopySource& last = pending.sources.back();
        if (last.fd == src_fd && last.offset + last.length == src_off + p)
          last.length += n;
        else
          pending.sources.push_back({src_fd, src_off + p, n, &src_name});
        pending.length += n;
      } else {
        submit_pending();
        pending = CopyJob{{{src_fd, src_off + p, n, &src_name}}, {}, fd, dst_off + p, n, buffered || !aligned,
                          !buffered && aligned, &dst_name};
      }
      if (small_direct) pending_small_direct = true;
      p += n;
    }
  }

  // A cluster assembled in memory, written whole at `dst_off`; adjacent ones are coalesced like
  // submit_copy's requests (a job holds one cluster at least, whatever the governor prefers).
  void submit_cluster(AssembledCluster&& c, uint64_t dst_off) {
    const uint64_t n = c.length;
    const bool aligned = dst_off % kDirectAlignment == 0 && n % kDirectAlignment == 0;
    const int fd = aligned ? bulk_fd : dst_file->fd();
    if (pending.length && !pending.clusters.empty() && pending.dst_fd == fd &&
        pending.dst_offset + pending.length == dst_off && pending.length + n <= request_bytes()) {
      pending.clusters.push_back(std::move(c));
      pending.length += n;
      return;
    }
    submit_pending();
    pending.clusters.push_back(std::move(c));
    pending.dst_fd = fd;
    pending.dst_offset = dst_off;
    pending.length = n;
    pending.buffered_dst = buffered || !aligned;
    pending.direct_dst = !buffered && aligned;
    pending.dst_name = &dst_name;
  }

  // Reads TOP's view (used where there is no plain host offset, e.g. compressed clusters).
  void copy_through_chain(uint64_t off, uint64_t len) {
    for (uint64_t p = 0; p < len; p += kChunkBytes) {
      const uint64_t n = std::min(kChunkBytes, len - p);
      buf.resize(n);
      chain.read(off + p, buf, 0);
      point("data");
      if (writer)
        writer->write(off + p, buf, base_view);
      else
        dst_dev.write(off + p, buf);
    }
  }

  void write_zero_range(uint64_t off, uint64_t end) {
    // Write zeros only where BASE's own view is not already zero.
    for (uint64_t z = off; z < end;) {
      MapEntry b = chain.status(z, end - z, base_depth);
      if (b.zero) {
        res.skipped_zero_bytes += b.length;
        z += b.length;
        continue;
      }
      point("data");
      if (writer) {
        writer->write_zeroes(z, b.length, base_view);
        res.zeroed_bytes += b.length;
      } else {
        bool punched = false;
        if (!raw_base_is_blockdev)
          punched = ::fallocate(dst_file->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(z),
                                off_t(b.length)) == 0;
        if (!punched && raw_base_is_blockdev) {
          uint64_t range[2] = {z, b.length};
          punched = ::ioctl(dst_file->fd(), BLKZEROOUT, range) == 0;
        }
        if (!punched) {
          std::vector<uint8_t> zeros(std::min<uint64_t>(b.length, kChunkBytes), 0);
          for (uint64_t q = 0; q < b.length; q += zeros.size())
            dst_dev.write(z + q, std::span<const uint8_t>(zeros.data(), std::min<uint64_t>(zeros.size(), b.length - q)));
        }
        res.zeroed_bytes += b.length;
      }
      z += b.length;
    }
  }

  // Part of a cluster of BASE that one piece provides, with where its bytes are in the source.
  struct PartialPiece {
    uint64_t start, end;
    CopySource source;
  };
  using PartialClusters = std::map<uint64_t, std::vector<PartialPiece>>;  // by cluster

  // Where a piece meets BASE's cluster grid: [off, a) is a partial head inside the cluster `off`
  // is in, [a, b) whole clusters (the last one may end at the virtual size), [b, piece_end) a
  // partial tail inside the cluster at b.
  [[nodiscard]] std::pair<uint64_t, uint64_t> cluster_split(uint64_t off, uint64_t piece_end) const {
    const auto& g = base.qcow2->geometry();
    const uint64_t a = std::min(g.align_up(off), piece_end);
    const uint64_t b = std::max(a, piece_end == base.qcow2->virtual_size() ? piece_end : g.align_down(piece_end));
    return {a, b};
  }

  [[nodiscard]] CopySource source_of(const MapEntry& e, uint64_t off, uint64_t len) {
    qcow2::Layer& src = chain.layer(e.depth);
    qcow2::BlockDevice& sdev = src.qcow2 ? src.qcow2->data_device() : *src.raw;
    auto* sfile = dynamic_cast<qcow2::FileDevice*>(&sdev);
    return {sfile->fd(), *e.offset + (off - e.start), len, &sdev.name()};
  }

  // The partial heads and tails of the window's pieces, by the cluster of BASE they fall in.
  void collect_partial(const Piece& p, PartialClusters& partial) {
    const auto [a, b] = cluster_split(p.start, p.end);
    const auto& g = base.qcow2->geometry();
    if (p.start < a) partial[g.align_down(p.start)].push_back({p.start, a, source_of(*p.e, p.start, a - p.start)});
    if (b < p.end) partial[b].push_back({b, p.end, source_of(*p.e, b, p.end - b)});
  }

  // True when BASE's view of [c, cend) reads as zeros (no need to read it).
  [[nodiscard]] bool base_reads_zero(uint64_t c, uint64_t cend) {
    for (uint64_t z = c; z < cend;) {
      const MapEntry b = chain.status(z, cend - z, base_depth);
      if (!b.zero || b.length == 0) return false;
      z += b.length;
    }
    return true;
  }

  // The pieces of a cluster at `dst` (BASE's host offset of the cluster at guest offset `c`),
  // each 4 KiB-aligned one O_DIRECT whatever its size (spliced from the source's pages; nothing
  // dirtied in BASE's page cache, no writeback to start), the others through the page cache,
  // which reads the rest of their first and last pages (never the pages of an aligned piece:
  // pieces do not overlap).
  void submit_pieces(const std::vector<PartialPiece>& pieces, uint64_t c, uint64_t dst) {
    for (const PartialPiece& pp : pieces)
      submit_copy(pp.source.fd, *pp.source.name, pp.source.offset, dst + (pp.start - c),
                  pp.end - pp.start, true);
  }

  // Every piece of the window that covers part of the cluster at `c`, at once (the first piece
  // of it met does it; later ones find it gone). A cluster BASE has as plain data is overwritten
  // where the pieces fall, through the copy pool. Any other is written once: where BASE's view
  // of it reads as zeros and the writer gives it space that reads as zeros too (new, past the
  // file's end when the merge opened it), only its pieces (rand4g4k: 4-60 KiB of each new
  // 64 KiB cluster); else whole, BASE's view of it (read before the cluster is staged) with the
  // pieces laid over it, assembled by the copy pool (Writer::write would write it whole and then
  // again for each later piece, one by one through the page cache). Space reused inside the
  // file, a zero-flagged cluster's own host cluster and a cluster over BASE's backing file's
  // data are written whole.
  void write_partial_cluster(uint64_t c, PartialClusters& partial) {
    auto it = partial.find(c);
    if (it == partial.end()) return;
    std::vector<PartialPiece> pieces = std::move(it->second);
    partial.erase(it);
    std::sort(pieces.begin(), pieces.end(), [](const PartialPiece& x, const PartialPiece& y) { return x.start < y.start; });
    const uint64_t cend = std::min(c + base.qcow2->cluster_size(), base.qcow2->virtual_size());
    for (const PartialPiece& pp : pieces)
      if (pp.start < c || pp.end > cend)
        throw Error(dst_name, "internal: partial piece outside its cluster at " + qcow2::hex(c));
    if (const auto host = writer->prepare_in_place(c)) {
      submit_pieces(pieces, c, *host);
      return;
    }
    AssembledCluster ac;
    ac.length = cend - c;
    const bool view_zero = base_reads_zero(c, cend);
    if (!view_zero) {
      ac.view.resize(ac.length);
      chain.read(c, ac.view, base_depth);
    }
    const qcow2::Writer::ClusterRewrite rewrite = writer->prepare_cluster_rewrite(c);
    if (view_zero && rewrite.reads_zeros) {
      submit_pieces(pieces, c, rewrite.host_offset);
      uint64_t piece_bytes = 0;
      for (const PartialPiece& pp : pieces) piece_bytes += pp.end - pp.start;
      res.zeros_left_unwritten += ac.length - piece_bytes;
      return;
    }
    for (const PartialPiece& pp : pieces) ac.patches.push_back({pp.source, pp.start - c});
    submit_cluster(std::move(ac), rewrite.host_offset);
  }

  // Copies one data piece that has a plain host offset in its source layer.
  void copy_direct(const MapEntry& e, uint64_t off, uint64_t piece_end, PartialClusters& partial) {
    if (!writer) {
      const CopySource s = source_of(e, off, piece_end - off);
      submit_copy(s.fd, *s.name, s.offset, off, s.length);
      return;
    }
    // Split at BASE's cluster grid: partial head/tail with the rest of their clusters' pieces,
    // the middle as full clusters written straight to their host offsets.
    const auto [a, b] = cluster_split(off, piece_end);
    if (off < a) write_partial_cluster(base.qcow2->geometry().align_down(off), partial);
    if (a < b) {
      const CopySource s = source_of(e, off, piece_end - off);
      for (const auto& r : writer->prepare_full_write(a, b - a))
        submit_copy(s.fd, *s.name, s.offset + (r.guest_offset - off), r.host_offset, r.length);
    }
    if (b < piece_end) write_partial_cluster(b, partial);
  }

  void run_window_body(uint64_t upto) {
    // Zeros and compressed data in guest order; plain data below.
    std::vector<const Piece*> direct;
    for (const Piece& p : window) {
      if (p.e->zero) {
        submit_pending();
        pool->drain();
        write_zero_range(p.start, p.end);
      } else if (!p.e->offset || p.e->compressed) {
        copy_through_chain(p.start, p.end - p.start);
        res.copied_bytes += p.end - p.start;
      } else {
        direct.push_back(&p);
        continue;
      }
      done_bytes += p.end - p.start;
      report(false);
    }
    // Pieces BASE already holds in place are written in BASE's host order (the device sees an
    // ascending stream).  Pieces that need new clusters go in guest order and their clusters are
    // allocated in that order: guest-adjacent pieces are adjacent in BASE and coalesce into one
    // request gathered from wherever TOP holds them, and a later sequential read of BASE is
    // sequential on disk (as after `qemu-img commit`).  In TOP's host order instead (the order the
    // guest wrote them) the reads from TOP were sequential but BASE kept TOP's scatter; the merge
    // took no longer in guest order, warm or cold (docs/benchmarks.md, "Appended clusters in
    // guest order").  A piece goes by its first cluster: one that starts in a cluster BASE holds
    // and runs on into new ones has those allocated with the pieces in place, out of guest order
    // (layout only; what BASE reads is the same either way).
    struct Keyed {
      uint64_t group, key;  // group 0: in place, by BASE's host offset; 1: new, by guest offset
      const Piece* p;
    };
    std::vector<Keyed> order;
    order.reserve(direct.size());
    for (const Piece* p : direct) {
      if (!writer) {
        order.push_back({0, p->start, p});
        continue;
      }
      const qcow2::Run r = base.qcow2->lookup(p->start, 1);
      if (r.type == qcow2::SubclusterType::kNormal)
        order.push_back({0, r.host_offset, p});
      else
        order.push_back({1, p->start, p});
    }
    std::stable_sort(order.begin(), order.end(), [](const Keyed& x, const Keyed& y) {
      return std::tie(x.group, x.key) < std::tie(y.group, y.key);
    });
    // The L2 tables the new clusters need, allocated first (in guest order): otherwise each one
    // lands between the data clusters around the write that first needs it, splitting their
    // requests (rand1t: a table per 8 data clusters on average) and scattering the tables'
    // own writes at the commit.
    if (writer)
      for (const Piece& p : window)
        if (!p.e->zero) writer->prepare_l2(p.start);
    PartialClusters partial;
    if (writer)
      for (const Keyed& k : order) collect_partial(*k.p, partial);
    for (const Keyed& k : order) {
      const Piece* p = k.p;
      copy_direct(*p->e, p->start, p->end, partial);
      res.copied_bytes += p->end - p->start;
      done_bytes += p->end - p->start;  // submitted; durable at the window's commit
      report(false);
    }
    submit_pending();
    issue_deferred();
    window.clear();
    window_l2s = 0;
    last_l1 = ~0ull;
    commit_window(upto);
    report(false);
  }

  // BASE's metadata found inconsistent while it is written (a refcount that cannot be right):
  // marked corrupt, as QEMU does, so that nothing uses it for writing before a repair.
  void run_window(uint64_t upto) {
    try {
      run_window_body(upto);
    } catch (const qcow2::CorruptionError& e) {
      if (writer && e.file() == base.qcow2->name()) writer->mark_corrupt();
      throw;
    }
  }

  const MergeOptions& opt;
  MergeResult& res;
  Chain& chain;
  const size_t base_depth;
  qcow2::Layer& base;
  qcow2::Writer* const writer;  // null: raw BASE
  const std::string& cp_path;
  const std::string& identity;
  const uint64_t total;
  const Clock::time_point t_start;
  const uint64_t top_size;

  qcow2::BlockDevice& dst_dev;
  qcow2::FileDevice* const dst_file;
  const std::string& dst_name;
  UniqueFd direct_fd;
  bool buffered = true;
  int bulk_fd = -1;
  bool raw_base_is_blockdev = false;
  qcow2::ViewReader base_view;
  uint64_t splice_piece = kChunkBytes;
  uint64_t unthrottled_request = kChunkBytes;
  std::unique_ptr<CopyPool> pool;

  uint64_t done_bytes = 0, window_bytes = 0;
  Clock::time_point last_progress = Clock::now();
  const Clock::time_point t_copy = Clock::now();
  std::vector<uint8_t> buf;
  CopyJob pending;
  bool pending_small_direct = false;  // see submit_pending()
  bool defer_jobs = false;  // see issue_deferred()
  std::vector<CopyJob> deferred;
  uint64_t held_view_bytes = 0;  // of the assembled clusters in `deferred`
  std::vector<Piece> window;
  uint64_t window_l2s = 0, last_l1 = ~0ull;
  uint64_t l1_span = 0, max_l2s = 0;
};

// BASE as the result names it: as QEMU names it, unless that name has "." or ".." components
// ("vms/../templates/base.qcow2"), then the path the kernel resolved (as `qcommit info` shows
// it). A block device keeps its name (/dev/vg/lv, not the /dev/dm-N it leads to).
std::string display_name(const qcow2::Layer& layer) {
  for (const auto& part : fs::path(layer.path))
    if ((part == "." || part == "..") && !layer.real_path.empty() && !layer.real_path.starts_with("/dev/"))
      return layer.real_path;
  return layer.path;
}

// Where a re-run of the merge a checkpoint belongs to may go on from: the checkpoint's offset if
// BASE is still in the state that the commits up to it left (engine/base_fingerprint.h), else 0:
// BASE was replaced, rolled back or restored since, and the copy starts over.
uint64_t resumable_offset(const Checkpoint& cp, const qcow2::Layer& base) {
  if (cp.done == 0 || cp.base_state != base_fingerprint(base, cp.done)) return 0;
  return cp.done;
}

// The layers merged must be consistent: with overlapping metadata (an L2 entry pointing into a
// metadata cluster, a cluster shared beyond its refcount, the L1 table used as an L2 table) the
// bytes they show are not guest data and would be copied into BASE. Leaks are harmless. A dirty
// (lazy refcounts) layer's refcounts are stale, so it is not judged by them here. BASE too,
// unless the merge repairs it anyway (dirty, or an interrupted run's leaks: `have_checkpoint`):
// its allocator trusts its refcounts, and a cluster in use with refcount 0 would be handed out
// again.
std::vector<std::string> layers_to_check(Chain& chain, size_t base_depth, bool have_checkpoint) {
  std::vector<std::string> to_check;
  for (size_t i = 0; i < base_depth; ++i) {
    qcow2::Layer& layer = chain.layer(i);
    if (layer.qcow2 && !layer.qcow2->dirty()) to_check.push_back(layer.path);
  }
  qcow2::Layer& base = chain.layer(base_depth);
  if (base.qcow2 && !base.qcow2->dirty() && !have_checkpoint) to_check.push_back(base.path);
  return to_check;
}

// Checks each layer as `qemu-img check` does, on its own read-only opening; throws
// CorruptionError for the first one with corruptions.
void check_layers(const std::vector<std::string>& to_check, const std::string& base_path) {
  for (const std::string& path : to_check) {
    auto img = qcow2::Image::open(qcow2::FileDevice::open(path));
    const auto r = qcow2::check(*img, qcow2::Repair::kNone);
    if (r.corruptions == 0) continue;
    std::string first;
    for (const auto& m : r.messages)
      if (m.rfind("ERROR", 0) == 0) {
        first = m;
        break;
      }
    throw qcow2::CorruptionError(
        path, "check found " + std::to_string(r.corruptions) + " corruptions" +
                  (first.empty() ? "" : " (" + first + ")") +
                  (path == base_path ? "; refusing to merge into it" : "; refusing to merge it"));
  }
}

// Every reason to refuse that the merge can know before it writes, checked before its first
// write (so a refused merge leaves every file byte for byte as it was, bitmaps included, and no
// checkpoint) and by plan_merge (a dry run refuses as the merge would, with the same error):
// BASE marked corrupt or with an external data file, its bitmaps' metadata inconsistent (the merge
// removes them), BASE unable to grow to TOP's size (the qcow2 L1 table limit; a raw block device
// smaller than TOP).
void refuse_before_writing(qcow2::Layer& base, uint64_t top_size) {
  if (base.qcow2) {
    qcow2::Image& img = *base.qcow2;
    if (auto why = qcow2::Writer::refusal(img)) {
      if (img.corrupt()) throw qcow2::CorruptionError(base.path, *why);
      throw qcow2::UnsupportedError(base.path, *why);
    }
    if (auto why = qcow2::Writer::grow_refusal(img, top_size))
      throw Error(base.path, *why + "; refusing to merge into it (nothing written)");
    if (auto problem = img.visit_bitmap_extents([](const qcow2::BitmapExtent&) {}))
      throw qcow2::CorruptionError(base.path, *problem);
    return;
  }
  const auto* file = dynamic_cast<const qcow2::FileDevice*>(base.raw.get());
  if (file && file->is_block_device() && file->size() < top_size)
    throw Error(base.path, "is a block device of " + std::to_string(file->size()) +
                               " bytes, smaller than TOP (" + std::to_string(top_size) +
                               " bytes), and cannot grow; refusing to merge into it (nothing written)");
}

// Which merge a checkpoint belongs to: the layers above BASE (as they are now) and BASE.
std::string merge_identity(Chain& chain, size_t base_depth) {
  std::string identity;
  for (size_t i = 0; i < base_depth; ++i) identity += layer_identity(chain.layer(i).path) + " | ";
  return identity + fs::weakly_canonical(chain.layer(base_depth).path).string();
}

// Where BASE is in TOP's chain (opened read-only with the options' backing directories).
size_t base_depth_in(Chain& chain, const MergeOptions& opt) {
  if (chain.depth() < 2) throw Error(opt.top, "image has no backing file: nothing to merge into");
  if (!opt.base) return 1;
  for (size_t i = 1; i < chain.depth(); ++i)
    if (same_file(chain.layer(i).path, *opt.base)) return i;
  throw Error(*opt.base, "is not in the backing chain of " + opt.top);
}

// The extents the layers above BASE provide, from guest offset `from` on, merged like qemu-img map.
std::vector<MapEntry> extents_above(Chain& chain, size_t base_depth, uint64_t from, uint64_t& total) {
  const uint64_t top_size = chain.virtual_size();
  std::vector<MapEntry> extents;
  total = 0;
  for (uint64_t off = from; off < top_size;) {
    MapEntry e = chain.status(off, top_size - off, 0, base_depth);
    off += e.length;
    if (!e.data && !e.zero) continue;  // BASE (or below) provides it
    if (!extents.empty() && qcow2::mergeable(extents.back(), e))
      extents.back().length += e.length;
    else
      extents.push_back(e);
    total += e.length;
  }
  return extents;
}

// Grows BASE to `new_size` so that nothing TOP shows changes, at any instant. Past BASE's end
// TOP reads zeros (QEMU reads nothing from a backing file past its end); once BASE is larger, its
// unallocated grown clusters would read BASE's own backing file instead, and TOP (and a re-run's
// plan, which takes them as provided by BASE) would see that file's bytes. So, as QEMU does when
// it grows an image that has a backing file, the part of the grown range that BASE's backing file
// covers is made to read as zeros in the same commit that grows BASE: the writer puts the zero
// flags (zero data on v2) in L2 tables that are durable before the header names the new size.
// Ranges the layers above BASE provide data for are left alone: TOP shows its own data there,
// and the copy (or a re-run's) writes them. A raw BASE has no backing file: truncate reads zeros.
// Returns the bytes made to read as zeros.
uint64_t grow_base(Chain& chain, size_t base_depth, qcow2::Writer* writer, uint64_t new_size,
                   const std::vector<MapEntry>& extents_above_base) {
  qcow2::Layer& base = chain.layer(base_depth);
  const uint64_t old_size = base.virtual_size();
  if (!writer) {
    base.raw->truncate(new_size);
    return 0;
  }
  writer->grow(new_size);
  const uint64_t below_size = chain.depth() > base_depth + 1 ? chain.layer(base_depth + 1).virtual_size() : 0;
  const uint64_t shadow_end = std::min(new_size, below_size);  // where BASE's backing file shows
  uint64_t zeroed = 0;
  qcow2::ViewReader base_view = [&](uint64_t o, std::span<uint8_t> out) { chain.read(o, out, base_depth); };
  auto zero = [&](uint64_t from, uint64_t to) {
    if (from >= to) return;
    writer->write_zeroes(from, to - from, base_view);
    zeroed += to - from;
  };
  uint64_t pos = old_size;
  for (const MapEntry& e : extents_above_base) {
    if (pos >= shadow_end) break;
    if (!e.data) continue;  // zero extents are zeroed here too: they must read as zeros anyway
    const uint64_t s = e.start, t = e.start + e.length;
    if (t <= pos) continue;
    zero(pos, std::min(s, shadow_end));
    pos = std::max(pos, t);
  }
  zero(pos, shadow_end);
  writer->commit();
  return zeroed;
}

// A BASE whose only copy of TOP's data the remaining deletions would leave must be consistent
// (as `qemu-img check` judges it: no corruption; leaks are harmless). A raw BASE has no metadata;
// a dirty one's refcounts are stale by design and not judged by them.
void check_base_consistent(const std::string& base_path) {
  auto img_dev = qcow2::FileDevice::open(base_path);
  if (qcow2::probe_format(*img_dev) != Format::kQcow2) return;
  auto img = qcow2::Image::open(std::move(img_dev));
  if (img->dirty()) return;
  const auto r = qcow2::check(*img, qcow2::Repair::kNone);
  if (r.corruptions > 0)
    throw qcow2::CorruptionError(base_path, "check found " + std::to_string(r.corruptions) +
                                                " corruptions; not deleting the rest of the merged layers "
                                                "(checkpoint kept)");
}

// Each name left to delete that is a file (not a symlink, whose removal loses no data) must be
// the layer the merge began with: its identity (real path, device, inode, size, mtime) one the
// checkpoint recorded. A file created at that name since, or written since, is not deleted.
void check_left_are_merged_layers(const Checkpoint& cp, const std::vector<std::string>& left) {
  const std::string recorded = " | " + cp.identity + " | ";
  for (const auto& p : left) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) continue;
    if (recorded.find(" | " + layer_identity(p) + " | ") == std::string::npos)
      throw Error(p, "changed since the merge that is deleting it began (not the layer its checkpoint "
                     "recorded); not deleted, checkpoint kept");
  }
}

// `merge TOP --base BASE --delete` again after a run that stopped while deleting the merged layers
// (TOP first): TOP is gone, and BASE's checkpoint, written by this user, lists TOP among the names
// being deleted. TOP's view can no longer be compared with BASE's, so the rest are deleted under
// this rule, and only under it:
//   - the list was written only after verify_base_holds_view() found BASE showing TOP's view, in a
//     run holding every lock: BASE held TOP's data when TOP went;
//   - what is left (intermediates, a symlink's target) shows nothing to anyone but through TOP,
//     unless another image or a domain uses it: asked again (find_layer_users), such a layer is
//     left in place and reported;
//   - each file left must still be the layer recorded (check_left_are_merged_layers);
//   - BASE must still be consistent (check_base_consistent).
// A refusal names the file, deletes nothing and keeps the checkpoint. Nothing else is trusted
// from a checkpoint to decide what to delete.
std::optional<MergeResult> finish_interrupted_delete(const MergeOptions& opt) {
  struct stat st {};
  if (!opt.delete_merged || !opt.base || ::lstat(opt.top.c_str(), &st) == 0 || errno != ENOENT) return std::nullopt;
  const std::string cp_path = checkpoint_path(*opt.base);
  const auto cp = load_checkpoint(cp_path);
  const std::string top = fs::absolute(opt.top).string();
  if (!cp || std::find(cp->deleting.begin(), cp->deleting.end(), top) == cp->deleting.end()) return std::nullopt;
  std::vector<std::string> left;
  for (const auto& p : cp->deleting)
    if (::lstat(p.c_str(), &st) == 0) left.push_back(p);
  check_left_are_merged_layers(*cp, left);
  check_base_consistent(*opt.base);
  MergeResult res;
  res.top = opt.top;
  res.base = *opt.base;
  res.resumed = true;
  res.resumed_from = cp->done;
  LayerUserQuery q{left, {*opt.base}};
  q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
  if (const auto users = find_layer_users(q, opt.find_users); !users.empty()) {
    for (const auto& p : left) res.not_deleted.push_back({p, "still used by " + describe_users(users)});
    return res;
  }
  unlink_names(left, res.deleted, res.not_deleted, opt.on_write_point);
  if (!res.not_deleted.empty()) return res;  // the checkpoint lists what is left
  if (opt.on_write_point) opt.on_write_point("checkpoint");
  remove_checkpoint(cp_path);
  return res;
}

}  // namespace


std::string MergeOptions::validate() const {
  if (top.empty()) return "no TOP image given";
  if (io_threads == 0 || io_threads > 64) return "io_threads must be 1..64";
  if (inflight_bytes < kChunkBytes) return "inflight_bytes must be at least one chunk (2 MiB)";
  if (window_bytes < kChunkBytes) return "window_bytes must be at least 2 MiB";
  return "";
}

namespace {

// One merge, as named steps over the state they share. Steps run in the order of run(); nothing is
// written before begin_checkpoint().
class MergeJob {
 public:
  explicit MergeJob(const MergeOptions& options) : opt(options) { res.top = opt.top; }

  MergeResult run() {
    lock_chain();
    find_checkpoint();
    prepare_children();
    refuse_orphaning_delete();
    plan_and_check();
    refuse_before_writing();
    report_resume();
    if (opt.governor) opt.governor->begin(Clock::now());
    try {
      open_base_writer();
      begin_checkpoint();
      remove_base_bitmaps();  // first: bitmap metadata found inconsistent refuses before BASE grows
      grow_base_to_top();
      copy();
      switch_children();
      finish();
    } catch (const std::exception& e) {
      if (!out_of_space(e)) throw;
      throw_no_space(e);
    }
    return res;
  }

 private:
  void progress(const Progress& p) {
    if (opt.on_progress) opt.on_progress(p);
  }
  void point(std::string_view name) {
    if (opt.on_write_point) opt.on_write_point(name);
  }

  // 1-2. Finds BASE in TOP's chain (read-only) and takes the locks: nobody writes TOP and the
  // intermediates, nobody uses BASE. Everything the merge uses is then read again under the locks
  // (a QEMU that wrote TOP and exited in between leaves the first reading stale), BASE from its
  // storage when an interrupted run left a checkpoint (drop_cached_pages).
  void lock_chain() {
    std::vector<std::string> locked_paths;
    {
      qcow2::ChainOptions popts;
      popts.allowed_backing_dirs = opt.allowed_backing_dirs;
      popts.await_missing = node_waiter();
      Chain probe = Chain::open(opt.top, popts);
      base_depth = base_depth_in(probe, opt);
      for (size_t i = 0; i <= base_depth; ++i) {
        locked_paths.push_back(probe.layer(i).path);
        const std::string& path = probe.layer(i).path;
        locks.push_back(i < base_depth ? ImageLock::reader(path, opt.lock_wait, opt.on_lock_wait)
                                       : ImageLock::writer(path, opt.lock_wait, opt.on_lock_wait));
      }
    }
    if (fs::exists(checkpoint_path(locked_paths[base_depth]))) drop_cached_pages(locked_paths[base_depth]);
    qcow2::ChainOptions copts;
    copts.writable_depth = base_depth;
    copts.allowed_backing_dirs = opt.allowed_backing_dirs;
    chain.emplace(Chain::open(opt.top, copts));
    for (size_t i = 0; i <= base_depth; ++i)
      if (chain->depth() <= i || !same_file(chain->layer(i).path, locked_paths[i]))
        throw Error(opt.top, "its backing chain changed while the merge took its locks; run it again");
    for (size_t i = 0; i < base_depth; ++i) res.merged_layers.push_back(chain->layer(i).path);
    base = &chain->layer(base_depth);
    res.base = display_name(*base);
    top_size = chain->virtual_size();
  }

  // BASE's storage is full: what is left to write from the checkpoint on (BASE's tables as they
  // are on disk, the room an interrupted run leaves in its file) and what is free now. The
  // estimate is best effort: without it the error still names BASE and the way to resume.
  [[noreturn]] void throw_no_space(const std::exception& e) {
    std::optional<uint64_t> from;
    try {
      if (const auto cp = load_checkpoint(cp_path); cp && cp->identity == identity) from = cp->done;
    } catch (const std::exception&) {
    }
    SpaceNeed need;
    try {
      uint64_t bytes = 0;
      need = space_need_on_disk(*chain, base_depth,
                                extents_above(*chain, base_depth, from.value_or(0), bytes));
    } catch (const std::exception&) {
    }
    const auto* io = dynamic_cast<const IoError*>(&e);
    const auto* err = dynamic_cast<const Error*>(&e);
    const std::string cause =
        err ? (err->file() == base->path ? err->problem() : err->what()) : e.what();
    throw NoSpaceError(base->path, cause, io ? io->error_number() : ENOSPC, need, from);
  }

  // A backing file under /dev/ that does not exist yet (udev still creating an LV's node) is
  // waited for until the --wait budget, counted from the start of the merge, is spent.
  [[nodiscard]] std::function<bool(const std::string&)> node_waiter() const {
    if (opt.lock_wait <= Duration::zero()) return nullptr;
    const LockClock::time_point deadline = deadline_after(LockClock::now(), opt.lock_wait);
    return [this, deadline](const std::string& path) {
      return wait_for_node(path, deadline, opt.on_lock_wait);
    };
  }

  // 3. The checkpoint of an interrupted run of this same merge (same layers, same BASE).
  void find_checkpoint() {
    identity = merge_identity(*chain, base_depth);
    cp_path = checkpoint_path(base->path);
    old_cp = load_checkpoint(cp_path);
    resuming = old_cp && old_cp->identity == identity;
    resume_from = resuming ? resumable_offset(*old_cp, *base) : 0;
    res.base_changed = resuming && old_cp->done > 0 && resume_from == 0;
    res.resumed = resuming;
    res.resumed_from = resume_from;
  }

  // Each child is locked, opened for writing and its new backing name decided before anything is
  // written: a child that cannot be rebased (dirty, corrupt, read-only) stops the merge here, not
  // after the copy. The switch then writes through these same openings.
  void prepare_children() {
    for (const auto& child : opt.rebase) {
      qcow2::ChainOptions cho;
      cho.allowed_backing_dirs = opt.allowed_backing_dirs;
      cho.allowed_backing_dirs.push_back(fs::absolute(child).parent_path().string());
      Chain c = Chain::open(child, cho);
      // Already on BASE: rebased by this merge before it was interrupted (its checkpoint is there
      // until every child is done); rebased again, it stays the same.
      const bool rebased_before = resuming && c.depth() >= 2 && same_file(c.layer(1).path, base->path);
      if (!rebased_before && (c.depth() < 2 || !same_file(c.layer(1).path, chain->layer(0).path)))
        throw Error(child, "its backing file is not " + opt.top + "; refusing to rebase it");
      locks.push_back(ImageLock::writer(child, opt.lock_wait, opt.on_lock_wait));
      // Read again under the lock: what the child allocates decides what it is given as zeros.
      children.push_back(prepare_rebase(child, cho, rebased_before, *chain, base_depth));
    }
  }

  // 4. Plan: the extents the layers above BASE provide (with the original sizes), while the layers
  // are checked. The check reads every table of each layer, in its own thread on its own read-only
  // opening; nothing is written before its verdict. rand1t (1 TiB TOP, 2048 L2 tables): check
  // ~135 ms, planning ~110 ms.
  void plan_and_check() {
    const std::vector<std::string> to_check = layers_to_check(*chain, base_depth, old_cp.has_value());
    auto checked = std::async(std::launch::async, [&to_check, this] { check_layers(to_check, base->path); });
    progress({0, 0, seconds_since(t_start), 0, "plan"});
    try {
      extents = extents_above(*chain, base_depth, resume_from, total);
    } catch (...) {
      checked.get();  // a corrupt layer is reported as the check found it
      throw;
    }
    checked.get();  // throws if a layer is corrupt: nothing written yet
  }

  // 5. Every other refusal the merge can know of, before its first write.
  void refuse_before_writing() { engine::refuse_before_writing(*base, top_size); }

  void report_resume() {
    if (!resuming) return;
    Progress p{0, total, seconds_since(t_start), 0, "resume"};
    p.resume_offset = resume_from;
    progress(p);
  }

  // BASE's writer, after repairing what an interrupted run or lazy refcounts left.
  void open_base_writer() {
    if (!base->qcow2) return;
    qcow2::Image& img = *base->qcow2;
    if (img.dirty() || old_cp) {
      auto r = qcow2::check(img, img.dirty() ? qcow2::Repair::kAll : qcow2::Repair::kLeaks);
      if (r.corruptions > r.corruptions_fixed)
        throw qcow2::CorruptionError(base->path, "check found " + std::to_string(r.corruptions) +
                                                     " corruptions; refusing to merge into it");
      res.leaks_repaired = r.leaks_fixed;
    }
    writer = std::make_unique<qcow2::Writer>(img);
    writer->on_write_point = [this](qcow2::WritePoint wp) { point(qcow2::to_string(wp)); };
  }

  // The first write: from now on a re-run finds this merge's checkpoint.
  void begin_checkpoint() {
    point("checkpoint");
    save_checkpoint(cp_path, {identity, resume_from, base_fingerprint(*base, resume_from), {}});
  }

  // 5. BASE grows to TOP's size, the grown range reading as zeros from the same commit on.
  void grow_base_to_top() {
    if (top_size <= base->virtual_size()) return;
    point("grow");
    res.zeroed_bytes += grow_base(*chain, base_depth, writer.get(), top_size, extents);
    res.base_grown = true;
  }

  // Persistent bitmaps would be stale once BASE changes under them.
  void remove_base_bitmaps() {
    if (!writer) return;
    res.bitmaps_removed = writer->remove_bitmaps();
    writer->commit();
  }

  // 6. The copy, window by window.
  void copy() {
    done_bytes = WindowCopier(opt, res, *chain, base_depth, writer.get(), cp_path, identity, total, t_start).run(extents);
  }

  // 7. Children now use BASE. Short and bounded: one commit per child, its header last, after
  // the zeros that keep its view past TOP's end (engine/rebase.h).
  void switch_children() {
    progress({done_bytes, total, seconds_since(t_start), 0, "switch"});
    const auto t_switch = Clock::now();
    const std::function<void(std::string_view)> at_point = [this](std::string_view name) { point(name); };
    for (RebaseTarget& child : children) {
      (void)switch_child(child, *chain, at_point);
      res.rebased.push_back(child.path);
    }
    res.switch_seconds = seconds_since(t_switch);
  }

  // 8. With every lock still held (a QEMU starting now cannot open TOP or BASE): the caller's own
  // steps, then the deletions, then the checkpoint, last: until it is gone a re-run of the same
  // command accepts children already rebased and finishes what is left.
  void finish() {
    if (opt.while_locked) opt.while_locked(res);
    if (opt.delete_merged) {
      verify_base_holds_view();
      delete_merged_layers();
    }
    if (!res.not_deleted.empty()) {  // kept: the same command again deletes what is left
      locks.clear();
      res.total_seconds = seconds_since(t_start);
      progress({done_bytes, total, res.total_seconds, 0, "done"});
      return;
    }
    point("checkpoint");
    remove_checkpoint(cp_path);
    locks.clear();
    res.total_seconds = seconds_since(t_start);
    progress({done_bytes, total, res.total_seconds, 0, "done"});
  }

  // TOP first; the checkpoint lists them first, for finish_interrupted_delete(). A layer that
  // another process has open (TOP is only read-locked, so a reader may have opened it) is not
  // deleted under it: such a reader (a monitoring agent's qemu-img info) is waited for within
  // --wait; one that keeps it open stops the merge, done but for the deletions, and the same
  // command again finishes them once the file is closed.
  //
  // Each layer goes by the names names_to_delete() gives (a symlink that named it, then the file
  // the chain resolved). A layer that has users (asked again here: one may have appeared since
  // refuse_orphaning_delete()) is not deleted, nor is any other then (their chains run through
  // the layers below); a name the kernel refuses to unlink is reported with its reason. Either
  // way the checkpoint stays and the same command again finishes the job.
  void delete_merged_layers() {
    for (const auto& p : res.merged_layers)
      if (const auto holders = wait_until_closed(p, opt.lock_wait, opt.on_lock_wait);
          !holders.empty())
        throw Error(p, "merged, but not deleted: it is open in " + describe(holders) +
                           "; run the same command again once it is closed");
    std::vector<std::string> names;
    for (size_t i = 0; i < base_depth; ++i)
      for (auto& n : names_to_delete(chain->layer(i).path, chain->layer(i).real_path)) names.push_back(n);
    if (const auto users = find_layer_users(layer_user_query(), opt.find_users); !users.empty()) {
      for (const auto& n : names) res.not_deleted.push_back({n, "still used by " + describe_users(users)});
      return;
    }
    Checkpoint deleting{identity, top_size, base_fingerprint(*base, top_size), {}};
    deleting.deleting = names;
    point("checkpoint");
    save_checkpoint(cp_path, deleting);
    unlink_names(names, res.deleted, res.not_deleted, opt.on_write_point);
  }

  // The merged layers, and the images whose chains pass through them without using them: the
  // chain's own layers down to BASE and the children rebased onto BASE.
  [[nodiscard]] LayerUserQuery layer_user_query() const {
    LayerUserQuery q;
    for (size_t i = 0; i < base_depth; ++i) q.layers.push_back(chain->layer(i).path);
    for (size_t i = 0; i <= base_depth; ++i) q.ignore.push_back(chain->layer(i).path);
    q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
    return q;
  }

  // 3b. --delete never orphans a user of a merged layer (another image backed by it, a domain
  // whose disk chain names it): refused before anything is written. Asked again right before the
  // unlinks (delete_merged_layers).
  void refuse_orphaning_delete() {
    if (!opt.delete_merged) return;
    if (const auto users = find_layer_users(layer_user_query(), opt.find_users); !users.empty())
      throw Error(users.front().layer, "--delete would leave its users without their backing file: " +
                                           describe_users(users) +
                                           "; nothing was written (name them with --rebase, or merge without --delete)");
  }

  // Asks the kernel to read ahead BASE's host ranges of a guest range (POSIX_FADV_WILLNEED).
  [[nodiscard]] std::function<void(uint64_t, uint64_t)> base_read_ahead() {
    auto* file = dynamic_cast<qcow2::FileDevice*>(base->qcow2 ? &base->qcow2->data_device() : base->raw.get());
    if (!file) return nullptr;
    return [this, fd = file->fd()](uint64_t off, uint64_t len) {
      for (uint64_t z = off, end = off + len; z < end;) {
        const MapEntry e = chain->status(z, end - z, base_depth);
        if (e.length == 0) return;
        if (e.offset && e.depth == base_depth)
          (void)::posix_fadvise(fd, off_t(*e.offset), off_t(e.length), POSIX_FADV_WILLNEED);
        z += e.length;
      }
    };
  }

  // Before any merged layer is deleted, whatever a checkpoint said about the copy: BASE must show
  // TOP's view on every range the layers above BASE provide (zero ranges read as zeros). A re-run
  // that trusted a checkpoint over a BASE changed since (an internal snapshot applied, an older
  // copy put back) would otherwise skip the copy and delete the only copy of TOP's data. A
  // difference deletes nothing and keeps the checkpoint.
  void verify_base_holds_view() {
    uint64_t bytes = 0;
    const std::vector<MapEntry> above = extents_above(*chain, base_depth, 0, bytes);
    if (const std::optional<uint64_t> at = first_view_difference(*chain, base_depth, above, base_read_ahead()))
      throw Error(base->path, "does not show TOP's data at guest offset " + std::to_string(*at) + " (" +
                                  qcow2::hex(*at) + "): not deleting the merged layers (nothing deleted, "
                                  "checkpoint kept)");
  }

  const MergeOptions& opt;
  MergeResult res;
  const Clock::time_point t_start = Clock::now();
  std::vector<ImageLock> locks;  // released last
  std::optional<Chain> chain;
  size_t base_depth = 0;
  qcow2::Layer* base = nullptr;
  uint64_t top_size = 0;
  std::string identity, cp_path;
  std::optional<Checkpoint> old_cp;
  bool resuming = false;
  uint64_t resume_from = 0;
  std::vector<RebaseTarget> children;
  std::vector<MapEntry> extents;
  uint64_t total = 0, done_bytes = 0;
  std::unique_ptr<qcow2::Writer> writer;
};

}  // namespace

MergeResult merge(const MergeOptions& opt) {
  if (auto err = opt.validate(); !err.empty()) throw Error(opt.top, err);
  if (auto finished = finish_interrupted_delete(opt)) return *finished;
  return MergeJob(opt).run();
}

MergePlan plan_merge(const MergeOptions& opt) {
  if (auto err = opt.validate(); !err.empty()) throw Error(opt.top, err);
  MergePlan p;
  qcow2::ChainOptions copts;
  copts.allowed_backing_dirs = opt.allowed_backing_dirs;
  Chain chain = Chain::open(opt.top, copts);
  p.base_depth = base_depth_in(chain, opt);
  for (size_t i = 0; i < p.base_depth; ++i) p.layers.push_back(chain.layer(i).path);
  qcow2::Layer& base = chain.layer(p.base_depth);
  p.base = base.path;
  p.base_format = qcow2::to_string(base.format);
  p.top_size = chain.virtual_size();
  p.base_size = base.virtual_size();
  // The checks the merge makes before it writes, with the same errors (and exit codes).
  const std::optional<Checkpoint> cp = load_checkpoint(checkpoint_path(base.path));
  check_layers(layers_to_check(chain, p.base_depth, cp.has_value()), base.path);
  refuse_before_writing(base, p.top_size);
  if (base.qcow2) {
    p.base_snapshots = base.qcow2->header().nb_snapshots;
    p.base_bitmaps = base.qcow2->bitmaps() ? base.qcow2->bitmaps()->nb_bitmaps : 0;
  }
  uint64_t total = 0;
  for (const MapEntry& e : extents_above(chain, p.base_depth, 0, total)) {
    ++p.extents;
    if (e.zero)
      p.zero_bytes += e.length;
    else
      p.data_bytes += e.length;
    if (e.compressed) p.compressed_bytes += e.length;
  }
  const std::string identity = merge_identity(chain, p.base_depth);
  if (cp && cp->identity == identity) p.resume_from = resumable_offset(*cp, base);
  p.rebase = opt.rebase;
  if (opt.delete_merged) {
    LayerUserQuery q{p.layers, {}};
    for (size_t i = 0; i <= p.base_depth; ++i) q.ignore.push_back(chain.layer(i).path);
    q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
    p.users = find_layer_users(q, opt.find_users);
  }
  // From where a run would start; an interrupted run's leftovers in BASE's file are reused.
  p.space = space_need(chain, p.base_depth,
                       extents_above(chain, p.base_depth, p.resume_from.value_or(0), total),
                       p.resume_from.has_value());
  return p;
}

}  // namespace qcommit::engine
