// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit-slowfs: FUSE passthrough filesystem that emulates a sync NFS export.
//
// Every WRITE and FSYNC goes through one FIFO queue served at a configurable bandwidth (bytes/s),
// so a flush waits behind every write queued before it, as on a sync NFS server. Reads are served
// from the backing directory without throttling. The kernel page cache sits above (writeback_cache,
// max_write 1 MiB) and the bdi gets max_ratio=100/strict_limit=0 so dirty data piles up as on an
// NFS client. O_DIRECT opens get FOPEN_DIRECT_IO + FOPEN_PARALLEL_DIRECT_WRITES; with
// --direct-readers, read-only opens get FOPEN_DIRECT_IO too (see set_open_mode).
//
// Usage: qcommit-slowfs --backing DIR --mount DIR [--bandwidth 50M] [--latency-ms 0]
//                       [--control FILE] [--log FILE] [--stats FILE] [--pidfile FILE]
//                       [--max-background N] [--real-fsync] [--fsname NAME] [--direct-readers]
//                       [--fail-errno EIO|ENOSPC] [--backing-log FILE]
// --fsname sets the mount's source as /proc/mounts shows it (default "qcommit-slowfs"); e.g.
// `lab:/export` makes the mount look like an NFS export to libvirt's netfs pool, which takes a
// target already mounted from "HOST:DIR" as started instead of running mount(8) itself.
// The control file holds `bandwidth=<rate>`, `latency_ms=<n>` and/or `fail_writes=0|1` lines; it
// is polled every 50 ms, so they can change while running. While fail_writes=1 every WRITE,
// FSYNC, FALLOCATE and size change fails with the --fail-errno error (default EIO) and writes
// nothing, as a failing disk or server (or, with ENOSPC, a full one) does: the client's page
// cache then holds pages the storage never got. SIGUSR1 turns failing on and SIGUSR2 off at
// once, for tests that must fail one precise write. Rates take K/M/G suffixes (powers of 1000).
// The log is a CSV with one row per queued request (see kLogHeader).
// The backing log (kBackingLogHeader) has one row per write or fsync of the backing directory that
// took kBackingSlowMs or more after its turn in the queue: the emulator's own host filesystem
// holding up its replies (while a reply is pending the kernel sends no more background requests
// past max_background), not the emulated storage. Rows are written by the control loop. Both
// logs stamp rows with the wall clock (to line up with the lab's other logs): a step of it shows
// as a hole or an overlap in them; wait_ms and backing_ms are measured on the monotonic clock.

#define FUSE_USE_VERSION 312
#include <dirent.h>
#include <fcntl.h>
#include <fuse3/fuse_lowlevel.h>
#include <linux/fuse.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

constexpr unsigned kMaxWriteBytes = 1u << 20;
constexpr unsigned kMaxThreads = 128;
constexpr unsigned kIdleThreads = 16;
constexpr double kEntryTimeoutS = 1.0;
constexpr double kAttrTimeoutS = 1.0;
constexpr auto kControlPoll = std::chrono::milliseconds(50);
constexpr auto kStatsPeriod = std::chrono::milliseconds(500);
constexpr double kBackingSlowMs = 10.0;
constexpr const char* kBackingLogHeader = "done_epoch_s,op,ino,offset,bytes,backing_ms\n";
constexpr const char* kLogHeader =
    "enqueue_epoch_s,op,ino,offset,bytes,ahead_reqs,ahead_bytes,wait_ms,service_ms\n";

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "qcommit-slowfs: %s\n", what.c_str());
  std::exit(1);
}

std::optional<double> parse_rate(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || v <= 0) return std::nullopt;
  std::string suf(end);
  if (suf.empty() || suf == "B") return v;
  if (suf == "K" || suf == "k" || suf == "KB") return v * 1e3;
  if (suf == "M" || suf == "MB") return v * 1e6;
  if (suf == "G" || suf == "GB") return v * 1e9;
  return std::nullopt;
}

double epoch_now() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Config {
  std::string backing, mount, control, log, stats, pidfile, backing_log;
  std::string fsname = "qcommit-slowfs";
  double bandwidth_bps = 50e6;
  double latency_ms = 0;
  unsigned max_background = 0;  // 0 = kernel default
  bool real_fsync = false;
  bool direct_readers = false;  // read-only opens get FOPEN_DIRECT_IO (see set_open_mode)

  [[nodiscard]] std::optional<std::string> validate() const {
    if (backing.empty()) return "--backing is required";
    if (mount.empty()) return "--mount is required";
    if (!(bandwidth_bps > 0)) return "--bandwidth must be > 0";
    if (latency_ms < 0) return "--latency-ms must be >= 0";
    if (fsname.empty() || fsname.find_first_of(" \t\n") != std::string::npos)
      return "--fsname must be non-empty, without blanks";
    return std::nullopt;
  }
};

// Rows of a CSV file, buffered in memory by the threads that serve requests and written by a
// thread of its own: writing the file on a request's path once stalled the FIFO server (and every
// request behind it) for 96-126 ms while the host flushed its page cache. Rows go out every
// kLogWritePeriod, at once after an urgent one, and all that are left when the log is destroyed.
class CsvLog {
 public:
  static constexpr auto kLogWritePeriod = std::chrono::milliseconds(200);

  // `f` null: no log, add() does nothing.
  CsvLog(FILE* f, const char* header) : f_(f) {
    if (!f_) return;
    std::fputs(header, f_);
    writer_ = std::thread([this] { write_rows(); });
  }
  ~CsvLog() {
    if (!writer_.joinable()) return;
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }
  CsvLog(const CsvLog&) = delete;
  CsvLog& operator=(const CsvLog&) = delete;

  explicit operator bool() const { return f_ != nullptr; }

  // Appends the row `snprintf` made in `line` (`n` its result, `cap` the buffer's size).
  void add(const char* line, int n, std::size_t cap, bool urgent) {
    if (!f_ || n <= 0) return;
    {
      std::lock_guard lk(m_);
      buf_.append(line, std::min<std::size_t>(static_cast<std::size_t>(n), cap - 1));
    }
    if (urgent) cv_.notify_one();
  }

 private:
  void write_rows() {
    std::string out;
    std::unique_lock lk(m_);
    for (;;) {
      cv_.wait_for(lk, kLogWritePeriod, [&] { return stop_ || !buf_.empty(); });
      out.swap(buf_);
      const bool stop = stop_;
      lk.unlock();
      if (!out.empty()) {
        std::fwrite(out.data(), 1, out.size(), f_);
        std::fflush(f_);
        out.clear();
      }
      lk.lock();
      if (stop && buf_.empty()) return;
    }
  }

  FILE* f_;
  std::mutex m_;
  std::condition_variable cv_;
  std::string buf_;
  bool stop_ = false;
  std::thread writer_;
};

// One FIFO "server": requests are served strictly in arrival order at `bandwidth` bytes/s.
class FifoLink {
 public:
  struct Ticket {
    char op = 'W';
    uint64_t ino = 0, offset = 0, bytes = 0;
    Clock::time_point enqueued{};
    double enqueued_epoch = 0;
    uint64_t ahead_bytes = 0;
    uint32_t ahead_reqs = 0;
    bool done = false;
  };

  FifoLink(double bps, double latency_ms, FILE* log)
      : bps_(bps), latency_ms_(latency_ms), log_(log, kLogHeader) {
    server_ = std::thread([this] { serve(); });
  }
  ~FifoLink() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_server_.notify_all();
    server_.join();
  }

  void set_bandwidth(double bps) { bps_.store(bps); }
  void set_latency_ms(double ms) { latency_ms_.store(ms); }
  double bandwidth() const { return bps_.load(); }
  double latency_ms() const { return latency_ms_.load(); }

  // Blocks until the request has been served, plus the per-request latency.
  void pass(char op, uint64_t ino, uint64_t offset, uint64_t bytes) {
    Ticket t;
    t.op = op;
    t.ino = ino;
    t.offset = offset;
    t.bytes = bytes;
    t.enqueued = Clock::now();
    t.enqueued_epoch = epoch_now();
    {
      std::unique_lock lk(m_);
      t.ahead_bytes = queued_bytes_;
      t.ahead_reqs = static_cast<uint32_t>(queue_.size());
      queued_bytes_ += bytes;
      queue_.push_back(&t);
      cv_server_.notify_one();
      cv_done_.wait(lk, [&] { return t.done; });
    }
    double lat = latency_ms_.load();
    if (lat > 0) std::this_thread::sleep_for(Seconds(lat / 1e3));
  }

  struct Snapshot {
    uint64_t queued_reqs, queued_bytes, total_reqs, total_bytes;
    double max_wait_ms;
  };
  Snapshot snapshot() {
    std::lock_guard lk(m_);
    return {queue_.size(), queued_bytes_, total_reqs_, total_bytes_, max_wait_ms_};
  }

 private:
  void serve() {
    Clock::time_point free_at = Clock::now();
    std::unique_lock lk(m_);
    for (;;) {
      cv_server_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      Ticket* t = queue_.front();
      auto now = Clock::now();
      auto start = std::max(now, free_at);
      auto service = std::chrono::duration_cast<Clock::duration>(
          Seconds(static_cast<double>(t->bytes) / bps_.load()));
      free_at = start + service;
      lk.unlock();
      std::this_thread::sleep_until(free_at);
      lk.lock();
      queue_.pop_front();
      queued_bytes_ -= t->bytes;
      total_reqs_++;
      total_bytes_ += t->bytes;
      double wait_ms = Seconds(start - t->enqueued).count() * 1e3;
      max_wait_ms_ = std::max(max_wait_ms_, wait_ms);
      if (log_) {
        char line[192];
        const int n = std::snprintf(
            line, sizeof line, "%.6f,%c,%llu,%llu,%llu,%u,%llu,%.3f,%.3f\n", t->enqueued_epoch,
            t->op, static_cast<unsigned long long>(t->ino),
            static_cast<unsigned long long>(t->offset), static_cast<unsigned long long>(t->bytes),
            t->ahead_reqs, static_cast<unsigned long long>(t->ahead_bytes), wait_ms,
            Seconds(service).count() * 1e3);
        log_.add(line, n, sizeof line, t->op == 'F' || total_reqs_ % 64 == 0);
      }
      t->done = true;
      cv_done_.notify_all();
    }
  }

  std::atomic<double> bps_;
  std::atomic<double> latency_ms_;
  CsvLog log_;
  std::mutex m_;
  std::condition_variable cv_server_, cv_done_;
  std::deque<Ticket*> queue_;
  uint64_t queued_bytes_ = 0, total_reqs_ = 0, total_bytes_ = 0;
  double max_wait_ms_ = 0;
  bool stop_ = false;
  std::thread server_;
};

struct Inode {
  int fd = -1;  // O_PATH
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t nlookup = 0;
};

struct DirHandle {
  DIR* dp = nullptr;
  off_t offset = 0;
  dirent* entry = nullptr;
};

// Backing operations that took kBackingSlowMs or more.
class BackingLog {
 public:
  explicit BackingLog(FILE* f) : log_(f, kBackingLogHeader) {}
  void note(char op, uint64_t ino, uint64_t offset, uint64_t bytes, double ms) {
    if (!log_ || ms < kBackingSlowMs) return;
    char line[160];
    const int n =
        std::snprintf(line, sizeof line, "%.6f,%c,%llu,%llu,%llu,%.3f\n", epoch_now(), op,
                      static_cast<unsigned long long>(ino), static_cast<unsigned long long>(offset),
                      static_cast<unsigned long long>(bytes), ms);
    log_.add(line, n, sizeof line, false);
  }

 private:
  CsvLog log_;
};

// Milliseconds since `start`.
double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Fs {
  Config cfg;
  std::unique_ptr<FifoLink> link;
  std::unique_ptr<BackingLog> backing_log;
  std::mutex inodes_m;
  Inode root;
  std::map<std::pair<dev_t, ino_t>, std::unique_ptr<Inode>> inodes;
};

Fs* g_fs = nullptr;
thread_local bool t_mark_parallel = false;

Inode& inode_of(fuse_ino_t ino) {
  if (ino == FUSE_ROOT_ID) return g_fs->root;
  return *reinterpret_cast<Inode*>(ino);
}

std::string proc_path(int fd) {
  return "/proc/self/fd/" + std::to_string(fd);
}

// Adds FOPEN_PARALLEL_DIRECT_WRITES to open/create replies marked by the op handler (libfuse
// 3.14 has no fuse_file_info bit for it). The fuse_open_out is the last 16 bytes of the reply.
ssize_t io_writev(int fd, struct iovec* iov, int count, void*) {
  if (!t_mark_parallel || count < 2 || iov[count - 1].iov_len < sizeof(fuse_open_out))
    return ::writev(fd, iov, count);
  std::vector<iovec> v(iov, iov + count);
  std::vector<char> last(static_cast<char*>(iov[count - 1].iov_base),
                         static_cast<char*>(iov[count - 1].iov_base) + iov[count - 1].iov_len);
  auto* open_out =
      reinterpret_cast<fuse_open_out*>(last.data() + last.size() - sizeof(fuse_open_out));
  open_out->open_flags |= FOPEN_PARALLEL_DIRECT_WRITES;
  v.back().iov_base = last.data();
  return ::writev(fd, v.data(), count);
}

ssize_t io_read(int fd, void* buf, size_t len, void*) {
  return ::read(fd, buf, len);
}

int do_lookup(fuse_ino_t parent, const char* name, fuse_entry_param* e) {
  std::memset(e, 0, sizeof(*e));
  e->attr_timeout = kAttrTimeoutS;
  e->entry_timeout = kEntryTimeoutS;
  int fd = openat(inode_of(parent).fd, name, O_PATH | O_NOFOLLOW);
  if (fd < 0) return errno;
  if (fstatat(fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0) {
    int err = errno;
    close(fd);
    return err;
  }
  std::lock_guard lk(g_fs->inodes_m);
  auto key = std::make_pair(e->attr.st_dev, e->attr.st_ino);
  auto it = g_fs->inodes.find(key);
  Inode* in;
  if (it != g_fs->inodes.end()) {
    in = it->second.get();
    close(fd);
  } else {
    auto p = std::make_unique<Inode>();
    p->fd = fd;
    p->dev = e->attr.st_dev;
    p->ino = e->attr.st_ino;
    in = p.get();
    g_fs->inodes.emplace(key, std::move(p));
  }
  in->nlookup++;
  e->ino = reinterpret_cast<fuse_ino_t>(in);
  return 0;
}

void forget_one(fuse_ino_t ino, uint64_t n) {
  if (ino == FUSE_ROOT_ID) return;
  std::lock_guard lk(g_fs->inodes_m);
  Inode& in = inode_of(ino);
  in.nlookup -= std::min(n, in.nlookup);
  if (in.nlookup == 0) {
    close(in.fd);
    g_fs->inodes.erase(std::make_pair(in.dev, in.ino));
  }
}

void op_init(void*, fuse_conn_info* conn) {
  if (conn->capable & FUSE_CAP_WRITEBACK_CACHE)
    conn->want |= FUSE_CAP_WRITEBACK_CACHE;
  else
    std::fprintf(stderr, "qcommit-slowfs: kernel lacks writeback_cache\n");
  conn->want &=
      ~static_cast<unsigned>(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  conn->max_write = kMaxWriteBytes;
  conn->max_readahead = kMaxWriteBytes;
  if (g_fs->cfg.max_background) {
    conn->max_background = g_fs->cfg.max_background;
    conn->congestion_threshold = g_fs->cfg.max_background * 3 / 4;
  }
}

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_entry_param e;
  int err = do_lookup(parent, name, &e);
  if (err)
    fuse_reply_err(req, err);
  else
    fuse_reply_entry(req, &e);
}

void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t n) {
  forget_one(ino, n);
  fuse_reply_none(req);
}

void op_forget_multi(fuse_req_t req, size_t count, fuse_forget_data* f) {
  for (size_t i = 0; i < count; i++) forget_one(f[i].ino, f[i].nlookup);
  fuse_reply_none(req);
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  struct stat st;
  if (fstatat(inode_of(ino).fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0)
    return (void)fuse_reply_err(req, errno);
  fuse_reply_attr(req, &st, kAttrTimeoutS);
}

// While set, every write fails with this errno (0: writes work). Set from the control file, the
// command line's --fail-errno and SIGUSR1/SIGUSR2; lock-free, so a signal handler may store it.
std::atomic<int> g_fail_errno{0};
int g_fault_errno = EIO;  // what failing means: --fail-errno
static_assert(std::atomic<int>::is_always_lock_free);

void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int valid, fuse_file_info* fi) {
  Inode& in = inode_of(ino);
  std::string path = proc_path(in.fd);
  int rc = 0;
  if (valid & FUSE_SET_ATTR_MODE)
    rc = fi ? fchmod(static_cast<int>(fi->fh), attr->st_mode) : chmod(path.c_str(), attr->st_mode);
  if (!rc && (valid & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))) {
    uid_t u = (valid & FUSE_SET_ATTR_UID) ? attr->st_uid : static_cast<uid_t>(-1);
    gid_t g = (valid & FUSE_SET_ATTR_GID) ? attr->st_gid : static_cast<gid_t>(-1);
    rc = fchownat(in.fd, "", u, g, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW);
  }
  if (!rc && (valid & FUSE_SET_ATTR_SIZE) && g_fail_errno)
    return (void)fuse_reply_err(req, g_fail_errno);
  if (!rc && (valid & FUSE_SET_ATTR_SIZE))
    rc = fi ? ftruncate(static_cast<int>(fi->fh), attr->st_size)
            : truncate(path.c_str(), attr->st_size);
  if (!rc && (valid & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME))) {
    timespec tv[2];
    tv[0].tv_sec = tv[1].tv_sec = 0;
    tv[0].tv_nsec = tv[1].tv_nsec = UTIME_OMIT;
    if (valid & FUSE_SET_ATTR_ATIME_NOW)
      tv[0].tv_nsec = UTIME_NOW;
    else if (valid & FUSE_SET_ATTR_ATIME)
      tv[0] = attr->st_atim;
    if (valid & FUSE_SET_ATTR_MTIME_NOW)
      tv[1].tv_nsec = UTIME_NOW;
    else if (valid & FUSE_SET_ATTR_MTIME)
      tv[1] = attr->st_mtim;
    rc = fi ? futimens(static_cast<int>(fi->fh), tv) : utimensat(AT_FDCWD, path.c_str(), tv, 0);
  }
  if (rc) return (void)fuse_reply_err(req, errno);
  op_getattr(req, ino, fi);
}

int backing_flags(int flags) {
  // writeback_cache: the kernel may read pages of write-only files and handles O_APPEND itself.
  if ((flags & O_ACCMODE) == O_WRONLY) flags = (flags & ~O_ACCMODE) | O_RDWR;
  flags &= ~(O_APPEND | O_DIRECT | O_NOFOLLOW);
  return flags;
}

// O_DIRECT opens: direct I/O with parallel writes.  With --direct-readers, read-only opens get
// direct I/O as well (without it, a read sees what the page cache holds, as on a local file). With
// FUSE's inode I/O modes (seen on Linux 6.18) one open of an inode in caching mode (any open
// without FOPEN_DIRECT_IO) makes the kernel take the inode's lock exclusively for every O_DIRECT
// write, so a reader such as qcommitd's page-cache fd on the target would serialise QEMU's
// cache=none writes to one request at a time; an NFS client lets them run in parallel whoever
// else holds the file open.  The page cache they leave alone is the inode's, which cachestat(2)
// and fadvise still reach.
void set_open_mode(fuse_file_info* fi) {
  if (fi->flags & O_DIRECT) {
    fi->direct_io = 1;
    t_mark_parallel = true;  // FOPEN_PARALLEL_DIRECT_WRITES, see io_writev
  } else if (g_fs->cfg.direct_readers && (fi->flags & O_ACCMODE) == O_RDONLY) {
    fi->direct_io = 1;
    fi->keep_cache = 1;
  } else {
    fi->keep_cache = 1;  // all writes come through this mount
  }
}

void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  int fd = open(proc_path(inode_of(ino).fd).c_str(), backing_flags(fi->flags) & ~O_CREAT);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fi->fh = static_cast<uint64_t>(fd);
  set_open_mode(fi);
  fuse_reply_open(req, fi);
  t_mark_parallel = false;
}

void op_create(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode,
               fuse_file_info* fi) {
  int fd = openat(inode_of(parent).fd, name, backing_flags(fi->flags) | O_CREAT, mode);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  fuse_entry_param e;
  int err = do_lookup(parent, name, &e);
  if (err) {
    close(fd);
    return (void)fuse_reply_err(req, err);
  }
  fi->fh = static_cast<uint64_t>(fd);
  set_open_mode(fi);
  fuse_reply_create(req, &e, fi);
  t_mark_parallel = false;
}

void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  if (mkdirat(inode_of(parent).fd, name, mode) < 0) return (void)fuse_reply_err(req, errno);
  fuse_entry_param e;
  int err = do_lookup(parent, name, &e);
  if (err)
    fuse_reply_err(req, err);
  else
    fuse_reply_entry(req, &e);
}

void op_unlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_reply_err(req, unlinkat(inode_of(parent).fd, name, 0) < 0 ? errno : 0);
}

void op_rmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  fuse_reply_err(req, unlinkat(inode_of(parent).fd, name, AT_REMOVEDIR) < 0 ? errno : 0);
}

void op_rename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t newparent,
               const char* newname, unsigned int flags) {
  int rc = renameat2(inode_of(parent).fd, name, inode_of(newparent).fd, newname, flags);
  fuse_reply_err(req, rc < 0 ? errno : 0);
}

void op_read(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
  buf.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  buf.buf[0].fd = static_cast<int>(fi->fh);
  buf.buf[0].pos = off;
  fuse_reply_data(req, &buf, FUSE_BUF_SPLICE_MOVE);
}

void op_write_buf(fuse_req_t req, fuse_ino_t ino, fuse_bufvec* in_buf, off_t off,
                  fuse_file_info* fi) {
  size_t size = fuse_buf_size(in_buf);
  if (int e = g_fail_errno) return (void)fuse_reply_err(req, e);
  g_fs->link->pass('W', ino == FUSE_ROOT_ID ? 1 : inode_of(ino).ino, static_cast<uint64_t>(off),
                   size);
  fuse_bufvec out = FUSE_BUFVEC_INIT(size);
  out.buf[0].flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  out.buf[0].fd = static_cast<int>(fi->fh);
  out.buf[0].pos = off;
  const auto start = Clock::now();
  ssize_t res = fuse_buf_copy(&out, in_buf, static_cast<fuse_buf_copy_flags>(0));
  g_fs->backing_log->note('W', ino == FUSE_ROOT_ID ? 1 : inode_of(ino).ino,
                          static_cast<uint64_t>(off), size, ms_since(start));
  if (res < 0)
    fuse_reply_err(req, static_cast<int>(-res));
  else
    fuse_reply_write(req, static_cast<size_t>(res));
}

void op_flush(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  int rc = close(dup(static_cast<int>(fi->fh)));
  fuse_reply_err(req, rc < 0 ? errno : 0);
}

void op_release(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  close(static_cast<int>(fi->fh));
  fuse_reply_err(req, 0);
}

void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, fuse_file_info* fi) {
  // Data is stable once its WRITE was served (sync export); the flush only waits its turn.
  g_fs->link->pass('F', inode_of(ino).ino, 0, 0);
  if (int e = g_fail_errno) return (void)fuse_reply_err(req, e);
  int err = 0;
  if (g_fs->cfg.real_fsync) {
    const auto start = Clock::now();
    const int rc = datasync ? fdatasync(static_cast<int>(fi->fh)) : fsync(static_cast<int>(fi->fh));
    err = rc < 0 ? errno : 0;  // before note(), which may change errno
    g_fs->backing_log->note('F', inode_of(ino).ino, 0, 0, ms_since(start));
  }
  fuse_reply_err(req, err);
}

void op_fallocate(fuse_req_t req, fuse_ino_t, int mode, off_t off, off_t len, fuse_file_info* fi) {
  if (int e = g_fail_errno) return (void)fuse_reply_err(req, e);
  int rc = fallocate(static_cast<int>(fi->fh), mode, off, len);
  fuse_reply_err(req, rc < 0 ? errno : 0);
}

void op_lseek(fuse_req_t req, fuse_ino_t, off_t off, int whence, fuse_file_info* fi) {
  off_t res = lseek(static_cast<int>(fi->fh), off, whence);
  if (res < 0)
    fuse_reply_err(req, errno);
  else
    fuse_reply_lseek(req, res);
}

void op_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  int fd = openat(inode_of(ino).fd, ".", O_RDONLY | O_DIRECTORY);
  if (fd < 0) return (void)fuse_reply_err(req, errno);
  auto* d = new DirHandle;
  d->dp = fdopendir(fd);
  if (!d->dp) {
    int err = errno;
    close(fd);
    delete d;
    return (void)fuse_reply_err(req, err);
  }
  fi->fh = reinterpret_cast<uint64_t>(d);
  fuse_reply_open(req, fi);
}

void op_readdir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  auto* d = reinterpret_cast<DirHandle*>(fi->fh);
  std::vector<char> buf(size);
  if (off != d->offset) {
    seekdir(d->dp, off);
    d->entry = nullptr;
    d->offset = off;
  }
  size_t used = 0;
  for (;;) {
    if (!d->entry) {
      errno = 0;
      d->entry = readdir(d->dp);
      if (!d->entry) break;
    }
    struct stat st {};
    st.st_ino = d->entry->d_ino;
    st.st_mode = static_cast<mode_t>(d->entry->d_type) << 12;
    off_t next = d->entry->d_off;
    size_t n = fuse_add_direntry(req, buf.data() + used, size - used, d->entry->d_name, &st, next);
    if (n > size - used) break;
    used += n;
    d->entry = nullptr;
    d->offset = next;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void op_releasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  auto* d = reinterpret_cast<DirHandle*>(fi->fh);
  closedir(d->dp);
  delete d;
  fuse_reply_err(req, 0);
}

void op_statfs(fuse_req_t req, fuse_ino_t ino) {
  struct statvfs sv;
  if (fstatvfs(inode_of(ino).fd, &sv) < 0) return (void)fuse_reply_err(req, errno);
  fuse_reply_statfs(req, &sv);
}

void op_setxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size,
                 int flags) {
  int rc = setxattr(proc_path(inode_of(ino).fd).c_str(), name, value, size, flags);
  fuse_reply_err(req, rc < 0 ? errno : 0);
}

void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  std::vector<char> buf(size);
  ssize_t n =
      getxattr(proc_path(inode_of(ino).fd).c_str(), name, size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0)
    fuse_reply_xattr(req, static_cast<size_t>(n));
  else
    fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  std::vector<char> buf(size);
  ssize_t n = listxattr(proc_path(inode_of(ino).fd).c_str(), size ? buf.data() : nullptr, size);
  if (n < 0) return (void)fuse_reply_err(req, errno);
  if (size == 0)
    fuse_reply_xattr(req, static_cast<size_t>(n));
  else
    fuse_reply_buf(req, buf.data(), static_cast<size_t>(n));
}

void op_removexattr(fuse_req_t req, fuse_ino_t ino, const char* name) {
  int rc = removexattr(proc_path(inode_of(ino).fd).c_str(), name);
  fuse_reply_err(req, rc < 0 ? errno : 0);
}

std::atomic<bool> g_stop{false};
std::string g_mountpoint;

void on_signal(int) {
  g_stop = true;
  umount2(g_mountpoint.c_str(), MNT_DETACH);  // the loop ends with ENODEV once unused
}

void on_fault_signal(int sig) {
  g_fail_errno = sig == SIGUSR1 ? g_fault_errno : 0;
}

bool write_sysfs(const std::string& path, const std::string& value) {
  int fd = open(path.c_str(), O_WRONLY);
  if (fd < 0) return false;
  bool ok = write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
  close(fd);
  return ok;
}

void apply_control_file(const Config& cfg, FifoLink& link) {
  FILE* f = std::fopen(cfg.control.c_str(), "r");
  if (!f) return;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    auto eq = s.find('=');
    if (eq == std::string::npos) continue;
    std::string k = s.substr(0, eq), v = s.substr(eq + 1);
    if (k == "bandwidth") {
      if (auto r = parse_rate(v))
        link.set_bandwidth(*r);
      else
        std::fprintf(stderr, "qcommit-slowfs: %s: bad bandwidth '%s'\n", cfg.control.c_str(),
                     v.c_str());
    } else if (k == "latency_ms") {
      link.set_latency_ms(std::strtod(v.c_str(), nullptr));
    } else if (k == "fail_writes") {
      g_fail_errno = v == "1" ? g_fault_errno : 0;
    }
  }
  std::fclose(f);
}

// Let dirty data pile up as on an NFS client: lift FUSE's per-bdi 1% dirty cap. Runs once the
// session loop serves requests (stat() of the mount waits for FUSE INIT).
void tune_bdi(const Config& cfg) {
  struct stat mst;
  if (stat(cfg.mount.c_str(), &mst) < 0) {
    std::fprintf(stderr, "qcommit-slowfs: %s: %s\n", cfg.mount.c_str(), std::strerror(errno));
    return;
  }
  std::string bdi = "/sys/class/bdi/" + std::to_string(major(mst.st_dev)) + ":" +
                    std::to_string(minor(mst.st_dev)) + "/";
  if (!write_sysfs(bdi + "max_ratio", "100") || !write_sysfs(bdi + "strict_limit", "0"))
    std::fprintf(stderr, "qcommit-slowfs: %s: cannot set max_ratio/strict_limit: %s\n", bdi.c_str(),
                 std::strerror(errno));
}

void control_loop(const Config& cfg, FifoLink& link) {
  tune_bdi(cfg);
  timespec last{};
  auto next_stats = Clock::now();
  while (!g_stop) {
    struct stat st;
    if (!cfg.control.empty() && stat(cfg.control.c_str(), &st) == 0 &&
        (st.st_mtim.tv_sec != last.tv_sec || st.st_mtim.tv_nsec != last.tv_nsec)) {
      last = st.st_mtim;
      apply_control_file(cfg, link);
    }
    if (!cfg.stats.empty() && Clock::now() >= next_stats) {
      next_stats = Clock::now() + kStatsPeriod;
      auto s = link.snapshot();
      std::string tmp = cfg.stats + ".tmp";
      if (FILE* f = std::fopen(tmp.c_str(), "w")) {
        std::fprintf(f,
                     "bandwidth_bps=%.0f\nlatency_ms=%.3f\nqueued_reqs=%llu\nqueued_bytes=%llu\n"
                     "total_reqs=%llu\ntotal_bytes=%llu\nmax_wait_ms=%.3f\n",
                     link.bandwidth(), link.latency_ms(),
                     static_cast<unsigned long long>(s.queued_reqs),
                     static_cast<unsigned long long>(s.queued_bytes),
                     static_cast<unsigned long long>(s.total_reqs),
                     static_cast<unsigned long long>(s.total_bytes), s.max_wait_ms);
        std::fclose(f);
        std::rename(tmp.c_str(), cfg.stats.c_str());
      }
    }
    std::this_thread::sleep_for(kControlPoll);
  }
}

Config parse_args(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value for " + a);
      return argv[++i];
    };
    if (a == "--backing")
      c.backing = val();
    else if (a == "--mount")
      c.mount = val();
    else if (a == "--bandwidth") {
      std::string v = val();
      auto r = parse_rate(v);
      if (!r) die("bad --bandwidth '" + v + "' (e.g. 50M = 50 MB/s)");
      c.bandwidth_bps = *r;
    } else if (a == "--latency-ms")
      c.latency_ms = std::strtod(val().c_str(), nullptr);
    else if (a == "--control")
      c.control = val();
    else if (a == "--log")
      c.log = val();
    else if (a == "--stats")
      c.stats = val();
    else if (a == "--backing-log")
      c.backing_log = val();
    else if (a == "--pidfile")
      c.pidfile = val();
    else if (a == "--max-background")
      c.max_background = static_cast<unsigned>(std::stoul(val()));
    else if (a == "--direct-readers")
      c.direct_readers = true;
    else if (a == "--real-fsync")
      c.real_fsync = true;
    else if (a == "--fsname")
      c.fsname = val();
    else if (a == "--fail-errno") {
      std::string v = val();
      if (v == "EIO")
        g_fault_errno = EIO;
      else if (v == "ENOSPC")
        g_fault_errno = ENOSPC;
      else
        die("bad --fail-errno '" + v + "' (EIO or ENOSPC)");
    } else
      die("unknown argument '" + a + "'");
  }
  if (auto err = c.validate()) die(*err);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  Fs fs;
  fs.cfg = parse_args(argc, argv);
  g_fs = &fs;
  const Config& cfg = fs.cfg;

  fs.root.fd = open(cfg.backing.c_str(), O_PATH | O_DIRECTORY);
  if (fs.root.fd < 0) die(cfg.backing + ": " + std::strerror(errno));

  FILE* log = nullptr;
  if (!cfg.log.empty()) {
    log = std::fopen(cfg.log.c_str(), "w");
    if (!log) die(cfg.log + ": " + std::strerror(errno));
  }
  fs.link = std::make_unique<FifoLink>(cfg.bandwidth_bps, cfg.latency_ms, log);
  FILE* backing_log = nullptr;
  if (!cfg.backing_log.empty()) {
    backing_log = std::fopen(cfg.backing_log.c_str(), "w");
    if (!backing_log) die(cfg.backing_log + ": " + std::strerror(errno));
  }
  fs.backing_log = std::make_unique<BackingLog>(backing_log);

  fuse_lowlevel_ops ops{};
  ops.init = op_init;
  ops.lookup = op_lookup;
  ops.forget = op_forget;
  ops.forget_multi = op_forget_multi;
  ops.getattr = op_getattr;
  ops.setattr = op_setattr;
  ops.open = op_open;
  ops.create = op_create;
  ops.mkdir = op_mkdir;
  ops.unlink = op_unlink;
  ops.rmdir = op_rmdir;
  ops.rename = op_rename;
  ops.read = op_read;
  ops.write_buf = op_write_buf;
  ops.flush = op_flush;
  ops.release = op_release;
  ops.fsync = op_fsync;
  ops.fallocate = op_fallocate;
  ops.lseek = op_lseek;
  ops.opendir = op_opendir;
  ops.readdir = op_readdir;
  ops.releasedir = op_releasedir;
  ops.statfs = op_statfs;
  ops.setxattr = op_setxattr;
  ops.getxattr = op_getxattr;
  ops.listxattr = op_listxattr;
  ops.removexattr = op_removexattr;

  char arg0[] = "qcommit-slowfs";
  char* fargv[] = {arg0, nullptr};
  fuse_args args = FUSE_ARGS_INIT(1, fargv);
  fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), nullptr);
  if (!se) die("fuse_session_new failed");

  int fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fuse_fd < 0) die(std::string("/dev/fuse: ") + std::strerror(errno));
  struct stat rootst;
  if (stat(cfg.mount.c_str(), &rootst) < 0) die(cfg.mount + ": " + std::strerror(errno));
  std::string opts = "fd=" + std::to_string(fuse_fd) + ",rootmode=40000,user_id=0,group_id=0," +
                     "allow_other,default_permissions";
  if (mount(cfg.fsname.c_str(), cfg.mount.c_str(), "fuse.qcommit-slowfs", MS_NOSUID | MS_NODEV,
            opts.c_str()) < 0)
    die(cfg.mount + ": mount: " + std::strerror(errno));
  g_mountpoint = cfg.mount;

  fuse_custom_io io{};
  io.writev = io_writev;
  io.read = io_read;
  if (fuse_session_custom_io(se, &io, fuse_fd) != 0) {
    umount2(cfg.mount.c_str(), MNT_DETACH);
    die("fuse_session_custom_io failed");
  }

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  struct sigaction fault {};
  fault.sa_handler = on_fault_signal;
  fault.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &fault, nullptr);
  sigaction(SIGUSR2, &fault, nullptr);

  if (!cfg.pidfile.empty()) {
    if (FILE* f = std::fopen(cfg.pidfile.c_str(), "w")) {
      std::fprintf(f, "%d\n", getpid());
      std::fclose(f);
    }
  }
  std::thread control([&] { control_loop(cfg, *fs.link); });

  fuse_loop_config* lc = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(lc, kMaxThreads);
  fuse_loop_cfg_set_idle_threads(lc, kIdleThreads);
  int rc = fuse_session_loop_mt(se, lc);
  fuse_loop_cfg_destroy(lc);

  g_stop = true;
  control.join();
  umount2(cfg.mount.c_str(), MNT_DETACH);
  fuse_session_destroy(se);
  fs.link.reset();
  fs.backing_log.reset();
  if (log) std::fclose(log);
  if (backing_log) std::fclose(backing_log);
  if (!cfg.pidfile.empty()) unlink(cfg.pidfile.c_str());
  return rc < 0 ? 1 : 0;
}
