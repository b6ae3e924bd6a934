// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/copy_pool.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <span>

#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

namespace {

constexpr uint64_t kMinSplicePipeBytes = 256ull << 10;  // smaller pipes: pread/pwrite

// Workers of the batched path: with batches of 64, 16384 random 4-60 KiB pieces written in place
// took 0.36-0.46 s with 2 workers against 0.61-0.73 s with 1 (2026-12-03, the stand-alone program
// of direct_batch.h); more workers would split the queue into smaller batches.
constexpr unsigned kBatchWorkers = 2;
// Source bytes one batch writes at most.
constexpr uint64_t kMaxBatchBytes = 8ull << 20;
// Requests from this size on stay with the splice threads. Batching is worth it where the cost per
// request dominates: on rand4g4k (4-60 KiB pieces) it took system CPU from 1.94 to 1.24 s per GiB
// (medians of 5 pairs, 2026-12-03); on rand4g (64 KiB clusters and longer runs) everything batched
// took 0.65 s against 0.59 s and more system CPU, mapping faults costing more than splice there.
constexpr uint64_t kMaxBatchedJobBytes = 64ull << 10;

}  // namespace

// A pipe through which splice(2) hands the source's page-cache pages to an O_DIRECT write of the
// base: the device reads them where they are (no copy through user space, nothing dirtied in the
// page cache). Capacity is one copy request if the kernel allows it (unprivileged pipes stop at
// /proc/sys/fs/pipe-max-size, 1 MiB by default); then a request is written in several pieces.
struct SplicePipe {
  UniqueFd rd, wr;
  uint64_t piece = 0;  // bytes per splice; 0: not usable, copy through user space

  [[nodiscard]] static SplicePipe open(uint64_t max_piece) {
    SplicePipe p;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return p;
    p.rd = UniqueFd(fds[0]);
    p.wr = UniqueFd(fds[1]);
    for (uint64_t want = kChunkBytes; want >= kMinSplicePipeBytes; want /= 2) {
      if (::fcntl(p.wr.get(), F_SETPIPE_SZ, int(want)) >= 0) break;
    }
    const int got = ::fcntl(p.wr.get(), F_GETPIPE_SZ);
    if (got >= int(kMinSplicePipeBytes))
      p.piece = std::max(kDirectAlignment,
                         std::min(uint64_t(got), max_piece) / kDirectAlignment * kDirectAlignment);
    return p;
  }
};

namespace {

using AlignedBuffer = std::unique_ptr<uint8_t, decltype(&free)>;

// A worker's buffer: kChunkBytes, aligned for O_DIRECT; null if it cannot be had.
[[nodiscard]] AlignedBuffer chunk_buffer() {
  void* mem = nullptr;
  if (posix_memalign(&mem, kDirectAlignment, kChunkBytes) != 0) mem = nullptr;
  return AlignedBuffer(static_cast<uint8_t*>(mem), &free);
}

// A request for the batched workers: small, O_DIRECT, from sources (the rest of the checks, and
// a copy the threads' way where they fail, are the worker's).
[[nodiscard]] bool batchable(const CopyJob& j) {
  return j.direct_dst && j.clusters.empty() && !j.sources.empty() &&
         j.length < kMaxBatchedJobBytes && j.dst_offset % kDirectAlignment == 0 &&
         j.length % kDirectAlignment == 0;
}

// In-kernel copies. Each returns how many leading bytes of the job it wrote; it stops early
// (and the caller copies the rest through user space, which also names the file at fault on
// an I/O error) at the source's end, on a filesystem that refuses, or on any error.

// O_DIRECT destination: splice the sources' cached pages into the pipe, one device request's
// worth at a time, and the pipe into the write.
[[nodiscard]] uint64_t splice_copy(const CopyJob& j, SplicePipe& pipe) {
  if (!pipe.piece) return 0;
  for (const CopySource& s : j.sources)
    if (s.offset % kDirectAlignment != 0 || s.length % kDirectAlignment != 0) return 0;
  uint64_t done = 0;
  size_t si = 0;    // current source
  uint64_t sp = 0;  // position in it
  while (done < j.length) {
    const uint64_t want = std::min(pipe.piece, j.length - done);
    uint64_t in = 0;
    while (in < want) {
      const CopySource& s = j.sources[si];
      loff_t off = loff_t(s.offset + sp);
      const ssize_t n =
          ::splice(s.fd, &off, pipe.wr.get(), nullptr, std::min(want - in, s.length - sp), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // the source's end, or refused
      in += uint64_t(n);
      sp += uint64_t(n);
      if (sp == s.length) {
        ++si;
        sp = 0;
      }
    }
    uint64_t out = 0;
    while (out < in) {
      loff_t dst = loff_t(j.dst_offset + done + out);
      const ssize_t n = ::splice(pipe.rd.get(), nullptr, j.dst_fd, &dst, in - out, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        pipe = SplicePipe::open(pipe.piece);  // drop what the failed write left in the pipe
        return done + out;
      }
      out += uint64_t(n);
    }
    done += out;
    if (in < want) return done;
  }
  return done;
}

// Buffered destination: copy_file_range (a page-cache copy in the kernel, or a reflink or a
// server-side copy where the filesystem offers one).
[[nodiscard]] uint64_t range_copy(const CopyJob& j) {
  uint64_t done = 0;
  for (const CopySource& s : j.sources) {
    for (uint64_t sp = 0; sp < s.length;) {
      loff_t src = loff_t(s.offset + sp), dst = loff_t(j.dst_offset + done);
      const ssize_t n = ::copy_file_range(s.fd, &src, j.dst_fd, &dst, s.length - sp, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return done;
      sp += uint64_t(n);
      done += uint64_t(n);
    }
  }
  return done;
}

// Reads `out.size()` bytes of `s` at `from` bytes into it; zeros past the end of its file.
void read_source(const CopySource& s, uint64_t from, std::span<uint8_t> out) {
  for (uint64_t p = 0; p < out.size();) {
    const ssize_t n = ::pread(s.fd, out.data() + p, out.size() - p, off_t(s.offset + from + p));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw qcow2::IoError(
          *s.name, "read at " + qcow2::hex(s.offset + from + p) + " failed: " + strerror(errno),
          errno);
    }
    if (n == 0) {
      std::memset(out.data() + p, 0, out.size() - p);
      break;
    }
    p += uint64_t(n);
  }
}

// The job's clusters, one after the other, into `buf` (kChunkBytes, aligned).
void assemble(const CopyJob& j, uint8_t* buf) {
  uint64_t pos = 0;
  for (const AssembledCluster& c : j.clusters) {
    if (c.view.empty())
      std::memset(buf + pos, 0, c.length);
    else
      std::memcpy(buf + pos, c.view.data(), c.length);
    for (const ClusterPatch& p : c.patches)
      read_source(p.source, 0, std::span<uint8_t>(buf + pos + p.at, p.source.length));
    pos += c.length;
  }
}

// Bytes [from, length) of the job from `buf` (which holds them from its start).
void write_out(const CopyJob& j, uint64_t from, const uint8_t* buf) {
  for (uint64_t done = from; done < j.length;) {
    const ssize_t n =
        ::pwrite(j.dst_fd, buf + (done - from), j.length - done, off_t(j.dst_offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw qcow2::IoError(
          *j.dst_name,
          "write at " + qcow2::hex(j.dst_offset + done) + " failed: " + strerror(errno), errno);
    }
    done += uint64_t(n);
  }
}

// Bytes [from, length) of the job through `buf` (at least one request long).
void user_copy(const CopyJob& j, uint64_t from, uint8_t* buf) {
  uint64_t pos = 0;  // job offset where the current source starts
  for (const CopySource& s : j.sources) {
    const uint64_t end = pos + s.length;
    if (end > from) {
      const uint64_t p = std::max(from, pos);
      read_source(s, p - pos, std::span<uint8_t>(buf + (p - from), end - p));
    }
    pos = end;
  }
  write_out(j, from, buf);
}

void copy(const CopyJob& j, uint8_t* buf, SplicePipe& pipe) {
  if (!j.clusters.empty()) {
    assemble(j, buf);
    write_out(j, 0, buf);
  } else {
    uint64_t done = j.direct_dst ? splice_copy(j, pipe) : range_copy(j);
    if (j.direct_dst) done -= done % kDirectAlignment;  // the rest must start aligned
    if (done < j.length) user_copy(j, done, buf);
  }
  if (j.buffered_dst)
    ::sync_file_range(j.dst_fd, off_t(j.dst_offset), off_t(j.length), SYNC_FILE_RANGE_WRITE);
}

}  // namespace

uint64_t device_request_bytes(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return kChunkBytes;
  const dev_t dev = S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev;
  const std::string sys =
      "/sys/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
  auto read_u64 = [](const std::string& path) -> std::optional<uint64_t> {
    std::ifstream in(path);
    uint64_t v = 0;
    if (in >> v && v > 0) return v;
    return std::nullopt;
  };
  for (const char* queue : {"/queue/", "/../queue/"}) {  // a partition's limits are its disk's
    const auto segments = read_u64(sys + queue + "max_segments");
    const auto sectors_kb = read_u64(sys + queue + "max_sectors_kb");
    if (!segments || !sectors_kb) continue;
    return std::min({*segments * kPageBytes, *sectors_kb * 1024, kChunkBytes});
  }
  return kChunkBytes;
}

CopyPool::CopyPool(unsigned threads, uint64_t inflight_limit, CopyGovernor* governor,
                   uint64_t splice_piece_bytes, bool batched)
    : limit_(inflight_limit), splice_piece_(splice_piece_bytes), governor_(governor) {
  if (batched && !governor) open_batches(std::min(threads, kBatchWorkers));
  for (size_t i = 0; i < batches_.size(); ++i)
    workers_.emplace_back([this, i] { run_batched(*batches_[i], batch_bufs_[i].get()); });
  for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  small_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void CopyPool::submit(CopyJob job) {
  if (governor_) {
    for (;;) {
      Duration wait = governor_->admit(Clock::now(), job.length, inflight());
      if (wait <= Duration::zero()) break;
      std::this_thread::sleep_for(std::min<Duration>(wait, std::chrono::milliseconds(50)));
      governor_->tick(Clock::now());
    }
  }
  std::unique_lock lk(mu_);
  done_cv_.wait(lk, [&] { return inflight_ == 0 || inflight_ + job.length <= limit_ || error_; });
  rethrow_locked();
  inflight_ += job.length;
  if (!batches_.empty() && batchable(job)) {
    small_queue_.push_back(std::move(job));
    small_cv_.notify_one();
  } else {
    queue_.push_back(std::move(job));
    cv_.notify_one();
  }
}

void CopyPool::drain() {
  std::unique_lock lk(mu_);
  done_cv_.wait(lk, [&] { return inflight_ == 0; });
  rethrow_locked();
}

uint64_t CopyPool::inflight() {
  std::lock_guard lk(mu_);
  return inflight_;
}

uint64_t CopyPool::batched_writes() {
  std::lock_guard lk(mu_);
  return batched_writes_;
}

void CopyPool::open_batches(unsigned n) {
  maps_ = std::make_unique<SourceMappings>();
  for (unsigned i = 0; i < n; ++i) {
    auto b = DirectBatch::open();
    AlignedBuffer buf = chunk_buffer();
    if (!b || !buf) {
      batches_.clear();
      batch_bufs_.clear();
      maps_.reset();
      return;
    }
    batches_.push_back(std::move(b));
    batch_bufs_.push_back(std::move(buf));
  }
}

void CopyPool::rethrow_locked() {
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CopyPool::run() {
  const AlignedBuffer buf = chunk_buffer();
  if (!buf) return;
  SplicePipe pipe;
  bool pipe_tried = false;
  for (;;) {
    CopyJob job;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto t0 = Clock::now();
    std::exception_ptr err;
    try {
      if (job.direct_dst && !pipe_tried) {
        pipe = SplicePipe::open(splice_piece_);
        pipe_tried = true;
      }
      copy(job, buf.get(), pipe);
    } catch (...) {
      err = std::current_exception();
    }
    const auto t1 = Clock::now();
    if (governor_ && !err) governor_->completed(t1, job.length, t1 - t0);
    finished(job.length, 0, err);
  }
}

void CopyPool::finished(uint64_t bytes, uint64_t written, const std::exception_ptr& err) {
  {
    std::lock_guard lk(mu_);
    inflight_ -= bytes;
    batched_writes_ += written;
    if (err && !error_) error_ = err;
  }
  done_cv_.notify_all();
}

void CopyPool::run_batched(DirectBatch& batch, uint8_t* buf) {
  SplicePipe pipe = SplicePipe::open(splice_piece_);
  for (;;) {
    std::vector<CopyJob> jobs = take_batch();
    if (jobs.empty()) return;
    uint64_t written = 0;
    const std::exception_ptr err = copy_batch(jobs, batch, buf, pipe, written);
    uint64_t bytes = 0;
    for (const CopyJob& j : jobs) bytes += j.length;
    finished(bytes, written, err);
  }
}

std::vector<CopyJob> CopyPool::take_batch() {
  std::unique_lock lk(mu_);
  small_cv_.wait(lk, [&] { return stop_ || !small_queue_.empty(); });
  std::vector<CopyJob> jobs;
  uint64_t bytes = 0;
  while (!small_queue_.empty() && jobs.size() < DirectBatch::kMaxWrites &&
         (jobs.empty() || bytes + small_queue_.front().length <= kMaxBatchBytes)) {
    bytes += small_queue_.front().length;
    jobs.push_back(std::move(small_queue_.front()));
    small_queue_.pop_front();
  }
  return jobs;
}

std::exception_ptr CopyPool::copy_batch(std::vector<CopyJob>& jobs, DirectBatch& batch,
                                        uint8_t* buf, SplicePipe& pipe, uint64_t& written) {
  std::vector<std::vector<iovec>> iovs;  // kept until the batch is waited for
  iovs.reserve(jobs.size());
  std::vector<size_t> batched, others;
  for (size_t i = 0; i < jobs.size(); ++i) {
    iovs.push_back(mapped_iovecs(jobs[i]));
    if (!iovs.back().empty() &&
        batch.add(jobs[i].dst_fd, iovs.back(), jobs[i].dst_offset, jobs[i].length)) {
      batched.push_back(i);
    } else {
      iovs.pop_back();
      others.push_back(i);
    }
  }
  batch.submit();
  std::exception_ptr err;
  auto copy_one = [&](const CopyJob& j) {
    try {
      copy(j, buf, pipe);
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  };
  for (size_t i : others) copy_one(jobs[i]);
  const std::vector<bool> ok = batch.wait();
  for (size_t k = 0; k < batched.size(); ++k) {
    if (ok[k])
      ++written;
    else
      copy_one(jobs[batched[k]]);
  }
  maps_->release_if_grown();
  return err;
}

std::vector<iovec> CopyPool::mapped_iovecs(const CopyJob& j) {
  std::vector<iovec> v;
  if (j.sources.size() > IOV_MAX) return v;
  std::vector<const SourceMapping*> maps;
  maps.reserve(j.sources.size());
  for (const CopySource& s : j.sources) {
    maps.push_back(maps_->of(s.fd));
    const uint8_t* p = maps.back() ? maps.back()->at(s.offset, s.length) : nullptr;
    if (!p || s.offset % kDirectAlignment != 0 || s.length % kDirectAlignment != 0) return {};
    if (!v.empty() && static_cast<uint8_t*>(v.back().iov_base) + v.back().iov_len == p)
      v.back().iov_len += s.length;
    else
      v.push_back(iovec{const_cast<uint8_t*>(p), s.length});
  }
  for (size_t i = 0; i < maps.size(); ++i)
    maps[i]->prefetch(j.sources[i].offset, j.sources[i].length);
  return v;
}

}  // namespace qcommit::engine
