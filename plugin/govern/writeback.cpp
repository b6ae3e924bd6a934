// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/writeback.h"

#include "common/safe_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "common/safe_file.h"
#include "common/log_field.h"
#include "plugin/hypervisor/hypervisor.h"
#include "plugin/host/memcg.h"
#include "plugin/govern/completion_clock.h"
#include "plugin/govern/memcg_target.h"
#include "plugin/host/proc_fds.h"
#include "qcow2/device.h"
#include "qcow2/image.h"
#include "qcow2/unique_fd.h"

namespace qcommit::plugin {

std::optional<std::string> WritebackConfig::validate() const {
  if (piece_bytes == 0 || piece_bytes % 4096 != 0)
    return "writeback piece must be a multiple of 4K";
  if (max_probes_per_tick == 0) return "writeback max_probes_per_tick must be > 0";
  return std::nullopt;
}

void IssuedRanges::add(const ByteRange& r) {
  if (r.length == 0) return;
  if (!ranges_.empty()) {
    ByteRange& last = ranges_.back();
    if (last.offset + last.length == r.offset) {
      last.length += r.length;
      return;
    }
  }
  ranges_.push_back(r);
  if (ranges_.size() > max_) {  // join the last two (and whatever lies between them)
    const ByteRange b = ranges_.back();
    ranges_.pop_back();
    ByteRange& a = ranges_.back();
    const std::uint64_t lo = std::min(a.offset, b.offset);
    const std::uint64_t hi = std::max(a.offset + a.length, b.offset + b.length);
    a = ByteRange{lo, hi - lo};
  }
}

std::optional<std::uint64_t> IssuedRanges::under_writeback(
    const std::function<std::optional<PageCacheState>(const ByteRange&)>& read,
    std::vector<ByteRange>* clean) {
  std::uint64_t total = 0;
  std::vector<ByteRange> keep;
  std::vector<ByteRange> done;
  keep.reserve(ranges_.size());
  for (const ByteRange& r : ranges_) {
    const std::optional<PageCacheState> st = read(r);
    if (!st) return std::nullopt;
    if (st->writeback_bytes == 0) {
      if (st->dirty_bytes == 0) done.push_back(r);
      continue;
    }
    total += st->writeback_bytes;
    keep.push_back(r);
  }
  ranges_ = std::move(keep);
  if (clean) clean->insert(clean->end(), done.begin(), done.end());
  return total;
}

WritebackPlan WritebackPlanner::plan(const WritebackInput& in, const DirtyProbe& dirty_in) {
  WritebackPlan out;
  if (in.file_size == 0) return out;
  if (cursor_ >= in.file_size) cursor_ = 0;
  const std::uint64_t budget =
      in.window_bytes > in.writeback_bytes ? in.window_bytes - in.writeback_bytes : 0;
  const std::uint64_t start = cursor_;
  std::uint64_t scanned = 0;
  // Clean stretches are skipped with one probe of kWritebackSkipPieces pieces: the job dirties
  // a small part of a large target at a time, and probing every piece of a multi-GiB file each
  // pace interval costs more than the pace interval.
  const std::uint64_t span_bytes = cfg_.piece_bytes * kWritebackSkipPieces;
  std::uint64_t dirty_span_end = 0;  // pieces are probed one by one below this offset
  for (std::uint32_t probes = 0; probes < cfg_.max_probes_per_tick && scanned < in.file_size;
       ++probes) {
    if (cursor_ >= dirty_span_end || cursor_ < dirty_span_end - span_bytes) {
      ByteRange span{cursor_, std::min(span_bytes, in.file_size - cursor_)};
      if (dirty_in(span) == 0) {
        scanned += span.length;
        cursor_ += span.length;
        if (cursor_ >= in.file_size) cursor_ = 0;
        if (cursor_ == start) {
          out.lapped = true;
          break;
        }
        continue;
      }
      dirty_span_end = span.offset + span.length;
      ++probes;
    }
    ByteRange r{cursor_, std::min(cfg_.piece_bytes, in.file_size - cursor_)};
    const std::uint64_t d = dirty_in(r);
    if (d > 0) {
      const bool liveness = in.writeback_bytes == 0 && out.dirty_bytes_issued == 0;
      if (out.dirty_bytes_issued + d > budget && !liveness) break;  // resume here next tick
      if (!out.ranges.empty() && out.ranges.back().offset + out.ranges.back().length == r.offset &&
          (in.max_range_bytes == 0 || out.ranges.back().length + r.length <= in.max_range_bytes)) {
        out.ranges.back().length += r.length;
      } else {
        out.ranges.push_back(r);
      }
      out.dirty_bytes_issued += d;
    }
    scanned += r.length;
    cursor_ += r.length;
    if (cursor_ >= in.file_size) cursor_ = 0;
    if (cursor_ == start) {
      out.lapped = true;
      break;
    }
  }
  if (scanned >= in.file_size) out.lapped = true;
  return out;
}

std::uint64_t writeback_range_bytes(std::uint64_t window_bytes, std::uint64_t piece_bytes) {
  if (piece_bytes == 0) return window_bytes;
  const std::uint64_t pieces = window_bytes / kWritebackRangesPerWindow / piece_bytes;
  return std::max<std::uint64_t>(pieces, 1) * piece_bytes;
}

std::optional<PageCacheState> parse_meminfo(const std::string& text) {
  std::istringstream is(text);
  std::string line;
  std::optional<std::uint64_t> dirty, wb;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string key;
    std::uint64_t kb = 0;
    if (!(ls >> key >> kb)) continue;
    if (key == "Dirty:")
      dirty = kb * 1024;
    else if (key == "Writeback:")
      wb = kb * 1024;
  }
  if (!dirty || !wb) return std::nullopt;
  return PageCacheState{*dirty, *wb, false};
}

std::optional<PageCacheSource> parse_page_cache_source(const std::string& s) {
  if (s == "auto") return PageCacheSource::kAuto;
  if (s == "meminfo") return PageCacheSource::kMeminfo;
  if (s == "no-cachestat") return PageCacheSource::kNoCachestat;
  if (s == "no-cachestat-shadow") return PageCacheSource::kNoCachestatShadow;
  return std::nullopt;
}

const char* page_cache_source_name(PageCacheSource s) {
  switch (s) {
    case PageCacheSource::kAuto:
      return "auto";
    case PageCacheSource::kMeminfo:
      return "meminfo";
    case PageCacheSource::kNoCachestat:
      return "no-cachestat";
    case PageCacheSource::kNoCachestatShadow:
      return "no-cachestat-shadow";
  }
  return "auto";
}

std::optional<PageCacheState> read_meminfo() {
  std::ifstream f("/proc/meminfo");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_meminfo(ss.str());
}

std::uint64_t target_size(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_size);
}

std::optional<std::uint64_t> target_device(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return storage_device_of(st.st_mode, st.st_dev, st.st_rdev);
}

namespace {

#ifndef __NR_cachestat
constexpr long kSysCachestat = 451;
#else
constexpr long kSysCachestat = __NR_cachestat;
#endif

struct CachestatRange {
  std::uint64_t off;
  std::uint64_t len;
};
struct Cachestat {
  std::uint64_t nr_cache;
  std::uint64_t nr_dirty;
  std::uint64_t nr_writeback;
  std::uint64_t nr_evicted;
  std::uint64_t nr_recently_evicted;
};

// cachestat(2) of [off, off + len) of fd; errno is left set on failure.
bool call_cachestat(int fd, std::uint64_t off, std::uint64_t len, Cachestat& cs) {
  CachestatRange range{off, len};
  return ::syscall(kSysCachestat, fd, &range, &cs, 0) == 0;
}
// The failure says the kernel has no cachestat(2) (before 6.5), not that this call was refused.
bool cachestat_missing(int err) {
  return err == ENOSYS || err == EOPNOTSUPP;
}

}  // namespace

bool BackgroundDatasync::start(int fd) {
  if (busy()) return false;
  const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the thread may outlive the caller's fd
  if (dup < 0) return false;
  busy_->store(true);
  try {
    std::thread([dup, busy = busy_] {
      (void)::fdatasync(dup);  // best effort: a failure leaves the kernel's clock running
      ::close(dup);
      busy->store(false);
    }).detach();
  } catch (const std::system_error&) {  // no thread: no sync this time
    ::close(dup);
    busy_->store(false);
    return false;
  }
  return true;
}

namespace {

class SystemTargetFile final : public TargetFile {
 public:
  SystemTargetFile(int fd, PageCacheSource source)
      : fd_(fd), waiter_(system_wait(fd)), no_cachestat_(source == PageCacheSource::kMeminfo) {}

  std::uint64_t size() override { return target_size(fd_.get()); }
  std::optional<std::uint64_t> device() override { return target_device(fd_.get()); }
  std::optional<PageCacheState> page_cache() override {
    if (auto cs = cachestat({0, 0}))
      return PageCacheState{cs->nr_dirty * page_, cs->nr_writeback * page_, true};
    return read_meminfo();
  }
  std::optional<PageCacheState> page_cache_in(const ByteRange& r) override {
    if (auto cs = cachestat(r))
      return PageCacheState{cs->nr_dirty * page_, cs->nr_writeback * page_, true};
    return std::nullopt;
  }
  std::uint64_t dirty_in(const ByteRange& r) override {
    if (auto st = page_cache_in(r)) return st->dirty_bytes;
    return r.length;  // unknown: assume dirty (sync_file_range on clean pages is cheap)
  }
  bool start_settle() override { return sync_.start(fd_.get()); }
  bool settling() override { return sync_.busy(); }
  void drop_cached(const ByteRange& r) override {
    // Best effort, like start_writeback.
    (void)::posix_fadvise(fd_.get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                          POSIX_FADV_DONTNEED);
  }
  void start_writeback(const ByteRange& r) override {
    // Best effort: a failure leaves the writeback to the kernel's flusher.
    // Timed only (cachestat(2) counts what is in flight), and only with a thread that waits:
    // without one the ranges would pile up unwaited.  The clock is read before the call, which
    // may block while the first of its writes complete.
    const std::chrono::nanoseconds at = waiter_.now();
    if (::sync_file_range(fd_.get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                          SYNC_FILE_RANGE_WRITE) == 0 &&
        waiter_.running())
      waiter_.issued(r, std::nullopt, at);
  }
  std::vector<throttle::CopySample> take_service_samples() override {
    return waiter_.take_service_samples();
  }

 private:
  std::optional<Cachestat> cachestat(const ByteRange& r) {
    if (no_cachestat_) return std::nullopt;
    Cachestat cs{};
    if (!call_cachestat(fd_.get(), r.offset, r.length, cs)) {
      if (cachestat_missing(errno)) no_cachestat_ = true;
      return std::nullopt;
    }
    return cs;
  }

  UniqueFd fd_;
  // Waits for each range started, to time the writeback's busy periods (own_service_samples).
  WritebackWaiter waiter_;
  BackgroundDatasync sync_;
  std::uint64_t page_ = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  bool no_cachestat_ = false;
};

constexpr std::size_t kProbeWriteBytes = 4096;  // one page, O_DIRECT-aligned
constexpr std::int64_t kNoProbeResult = -1;

// What a probe thread shares with its ProbeFile (the thread may outlive it): the file, an
// aligned page to write, whether a probe runs, and the latency of the last one in ns.
// `name` (the unlinked file's, for messages) and the errno of the last failure: write_errno
// from the write, else sync_errno from the fdatasync (0: none failed).
struct ProbeShared {
  ProbeShared(int f, std::string n) : fd(f), name(std::move(n)) {}
  ~ProbeShared() { std::free(page); }
  ProbeShared(const ProbeShared&) = delete;
  ProbeShared& operator=(const ProbeShared&) = delete;
  UniqueFd fd;
  const std::string name;
  void* page = nullptr;
  std::atomic<bool> busy{false};
  std::atomic<std::int64_t> result_ns{kNoProbeResult};
  std::atomic<int> write_errno{0};
  std::atomic<int> sync_errno{0};
};

class SystemProbeFile final : public ProbeFile {
 public:
  explicit SystemProbeFile(std::shared_ptr<ProbeShared> s) : s_(std::move(s)) {}
  bool start() override {
    if (s_->busy.load()) return false;
    s_->busy.store(true);
    try {
      std::thread([s = s_] {
        const auto t0 = std::chrono::steady_clock::now();
        const ssize_t n = ::pwrite(s->fd.get(), s->page, kProbeWriteBytes, 0);
        bool ok = n == static_cast<ssize_t>(kProbeWriteBytes);
        if (!ok) {
          s->write_errno.store(n < 0 ? errno : ENOSPC);  // a short write: no room
          s->sync_errno.store(0);
        } else if (::fdatasync(s->fd.get()) != 0) {
          ok = false;
          s->write_errno.store(0);
          s->sync_errno.store(errno);
        }
        const auto t1 = std::chrono::steady_clock::now();
        s->result_ns.store(
            ok ? std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()
               : kNoProbeResult);
        s->busy.store(false);
      }).detach();
    } catch (const std::system_error&) {  // no thread: no probe this time
      s_->busy.store(false);
      return false;
    }
    return true;
  }
  bool busy() override { return s_->busy.load(); }
  std::optional<std::chrono::nanoseconds> take() override {
    if (s_->busy.load()) return std::nullopt;
    const std::int64_t ns = s_->result_ns.exchange(kNoProbeResult);
    if (ns == kNoProbeResult) return std::nullopt;
    return std::chrono::nanoseconds(ns);
  }
  std::string failure() override {
    if (const int e = s_->write_errno.load())
      return "write of " + log_field(s_->name) + " (unlinked): " + std::strerror(e);
    if (const int e = s_->sync_errno.load())
      return "fdatasync of " + log_field(s_->name) + " (unlinked): " + std::strerror(e);
    return {};
  }

 private:
  std::shared_ptr<ProbeShared> s_;
};

// The directory of `path` ("." when it has none).
std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

std::optional<PageCacheState> cachestat_of(int fd, const ByteRange& r) {
  Cachestat cs{};
  if (!call_cachestat(fd, r.offset, r.length, cs)) return std::nullopt;
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return PageCacheState{cs.nr_dirty * page, cs.nr_writeback * page, true};
}

bool cachestat_available() {
  const UniqueFd fd(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return false;
  Cachestat cs{};
  // A directory has no page cache of its own: any answer but "no such call" will do.
  return call_cachestat(fd.get(), 0, 0, cs) || !cachestat_missing(errno);
}

std::optional<std::chrono::milliseconds> dirty_expire() {
  std::ifstream f("/proc/sys/vm/dirty_expire_centisecs");
  long long cs = -1;
  if (!(f >> cs) || cs < 0) return std::nullopt;
  return std::chrono::milliseconds(cs * 10);
}

std::unique_ptr<TargetFile> SystemTargetFiles::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    tell("target " + path + ": cannot open it (" + std::strerror(err) +
         "): its page cache is not counted and its writeback not paced (a sandbox that hides it?)");
    return nullptr;
  }
  const bool without = source_ == PageCacheSource::kNoCachestat ||
                       source_ == PageCacheSource::kNoCachestatShadow ||
                       (source_ == PageCacheSource::kAuto && !cachestat_available());
  if (without) return open_without_cachestat(fd, path);
  return std::make_unique<SystemTargetFile>(fd, source_);
}

ProbeOpening SystemTargetFiles::open_probe(const std::string& path) {
  // Only beside a regular file, in a directory of the same filesystem: a probe in /dev (an LV's
  // node) or on another mount would measure some other storage.
  // errno first: building the message may change it.
  const auto failed = [](int err, const std::string& what) {
    return ProbeOpening{nullptr, what + ": " + std::strerror(err)};
  };
  struct stat target = {};
  struct stat dir = {};
  const std::string d = directory_of(path);
  if (::stat(path.c_str(), &target) != 0) {
    const int err = errno;
    return failed(err, "cannot stat the target " + log_field(path));
  }
  if (!S_ISREG(target.st_mode))
    return {nullptr, "the target " + log_field(path) +
                         " is not a regular file (a probe file elsewhere would measure other "
                         "storage)"};
  if (::stat(d.c_str(), &dir) != 0) {
    const int err = errno;
    return failed(err, "cannot stat the target's directory " + log_field(d));
  }
  if (dir.st_dev != target.st_dev)
    return {nullptr, "the target's directory " + log_field(d) +
                         " is another filesystem than the target " + log_field(path) +
                         " (a probe file there would measure other storage)"};
  // Unnamed where the filesystem allows it, else under an unpredictable name unlinked at once:
  // nothing planted in the target's directory is opened (common/safe_file.h).
  safe_file::Opened opened = safe_file::create_scratch(d, ".qcommit-probe-", true);
  if (!opened.ok())
    return failed(opened.err, "cannot create the probe file in " + log_field(d));
  const std::string name = opened.name.empty() ? d + "/(unnamed probe file)" : opened.name;
  const int fd = opened.fd.release();  // ProbeShared owns it from here
  auto shared = std::make_shared<ProbeShared>(fd, name);
  if (::posix_memalign(&shared->page, kProbeWriteBytes, kProbeWriteBytes) != 0) {
    shared->page = nullptr;
    return {nullptr, "no memory for the probe's page (" + log_field(name) + ")"};
  }
  std::memset(shared->page, 0, kProbeWriteBytes);
  return {std::make_unique<SystemProbeFile>(std::move(shared)), {}};
}

std::unique_ptr<TargetFile> SystemTargetFiles::open_without_cachestat(int fd,
                                                                      const std::string& path) {
  const std::optional<pid_t> pid = writer_of(path);
  if (!pid) {
    tell("target " + path +
         ": no QEMU holds it open for writing, its page cache is read host-wide from "
         "/proc/meminfo (fdatasync pacing)");
    return std::make_unique<SystemTargetFile>(fd, PageCacheSource::kMeminfo);
  }
  const std::optional<std::filesystem::path> memcg = memcg_dir_of(*pid);
  if (!memcg) {
    tell("target " + path + ": QEMU pid " + std::to_string(*pid) +
         " has no memory cgroup with memory.stat, its page cache is read host-wide from "
         "/proc/meminfo (fdatasync pacing)");
    return std::make_unique<SystemTargetFile>(fd, PageCacheSource::kMeminfo);
  }
  tell("target " + path + ": page cache from the memory cgroup " + memcg->string() +
       " of QEMU pid " + std::to_string(*pid) + " and completion-clocked writeback");
  ShadowLog shadow;
  if (source_ == PageCacheSource::kNoCachestatShadow) {
    shadow = [note = note_, path](const PageCacheState& est, const PageCacheState& truth) {
      if (note)
        note("shadow " + path + ": estimate dirty " + std::to_string(est.dirty_bytes) +
             " writeback " + std::to_string(est.writeback_bytes) + ", cachestat dirty " +
             std::to_string(truth.dirty_bytes) + " writeback " +
             std::to_string(truth.writeback_bytes));
    };
  }
  return open_memcg_target(fd, *memcg, std::move(shadow));
}

std::string describe_page_cache_source(PageCacheSource source) {
  switch (source) {
    case PageCacheSource::kMeminfo:
      return "meminfo (--page-cache meminfo): a job's own dirty pages cannot be counted; the "
             "host-wide /proc/meminfo count bounds them, and cache=writeback targets are written "
             "out with back-to-back fdatasync";
    case PageCacheSource::kNoCachestat:
    case PageCacheSource::kNoCachestatShadow:
      return std::string(page_cache_source_name(source)) +
             " (forced): a target's writeback is counted by completion (sync_file_range per "
             "piece) and its dirty pages bounded by QEMU's memory cgroup";
    case PageCacheSource::kAuto:
      break;
  }
  if (cachestat_available()) return "cachestat: per-file counts (cachestat(2), Linux >= 6.5)";
  return "no-cachestat: cachestat(2) is not there (a kernel before 6.5, or a system call filter, "
         "e.g. a container's, that does not know it); a target's writeback is "
         "counted by completion (sync_file_range per piece) and its dirty pages bounded by "
         "QEMU's memory cgroup (/proc/meminfo where neither is found)";
}

std::optional<std::string> SystemTargetFiles::commit_base(const std::string& active,
                                                          const std::vector<std::string>& chain) {
  return commit_base_in_use(active, chain);
}

std::optional<std::vector<ByteRange>> SystemTargetFiles::commit_extents(
    const std::vector<std::string>& layers) {
  std::vector<ByteRange> all;
  try {
    for (const std::string& path : layers) {
      std::unique_ptr<qcow2::Image> img = qcow2::Image::open(qcow2::FileDevice::open(path));
      for (const qcow2::GuestExtent& e : qcow2::own_extents(*img))
        all.push_back({e.offset, e.length});
    }
  } catch (const std::exception&) {  // raw, gone, unreadable: the job's own end is used
    return std::nullopt;
  }
  std::sort(all.begin(), all.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> merged;
  for (const ByteRange& r : all) {
    if (!merged.empty() && r.offset <= merged.back().offset + merged.back().length)
      merged.back().length =
          std::max(merged.back().offset + merged.back().length, r.offset + r.length) -
          merged.back().offset;
    else
      merged.push_back(r);
  }
  return merged;
}

}  // namespace qcommit::plugin
