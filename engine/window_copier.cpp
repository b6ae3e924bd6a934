// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/window_copier.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "engine/base_fingerprint.h"
#include "engine/checkpoint.h"
#include "engine/copy_pool.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

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

}  // namespace

uint64_t copy_windows(const MergeOptions& options, MergeResult& result, Chain& chain,
                      size_t base_layer, qcow2::Writer* base_writer, const std::string& checkpoint,
                      const std::string& merge_identity, uint64_t total_bytes,
                      Clock::time_point started, const std::vector<MapEntry>& extents) {
  return WindowCopier(options, result, chain, base_layer, base_writer, checkpoint, merge_identity,
                      total_bytes, started)
      .run(extents);
}

}  // namespace qcommit::engine
