// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/memcg_target.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "plugin/govern/completion_clock.h"
#include "plugin/host/memcg.h"
#include "qcow2/unique_fd.h"

namespace qcommit::plugin {

std::uint64_t memcg_lag_bytes() {
  const auto cpus = static_cast<std::uint64_t>(std::max(1L, ::sysconf(_SC_NPROCESSORS_CONF)));
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return kMemcgLagPagesPerCpu * cpus * page;
}

namespace {

// A read-only shared mapping of the file, remapped when the file outgrows it, for mincore(2).
class ResidentProbe {
 public:
  explicit ResidentProbe(int fd) : fd_(fd) {}
  ~ResidentProbe() { unmap(); }
  ResidentProbe(const ResidentProbe&) = delete;
  ResidentProbe& operator=(const ResidentProbe&) = delete;

  // Resident bytes of `r`; nullopt when the range cannot be mapped.
  [[nodiscard]] std::optional<std::uint64_t> resident_in(const ByteRange& r, std::uint64_t size) {
    const std::uint64_t end = std::min(r.offset + r.length, size);
    if (r.offset >= end) return 0;
    if (end > mapped_ && !map(size)) return std::nullopt;
    const std::uint64_t first = r.offset / page_ * page_;
    const std::uint64_t pages = (end - first + page_ - 1) / page_;
    vec_.resize(pages);
    if (::mincore(static_cast<char*>(addr_) + first, end - first, vec_.data()) != 0)
      return std::nullopt;
    const auto resident = static_cast<std::uint64_t>(
        std::count_if(vec_.begin(), vec_.end(), [](unsigned char v) { return (v & 1) != 0; }));
    return std::min(resident * page_, r.length);
  }

 private:
  bool map(std::uint64_t size) {
    unmap();
    void* a = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
    if (a == MAP_FAILED) return false;
    addr_ = a;
    mapped_ = size;
    return true;
  }
  void unmap() {
    if (addr_) ::munmap(addr_, mapped_);
    addr_ = nullptr;
    mapped_ = 0;
  }

  int fd_;
  void* addr_ = nullptr;
  std::uint64_t mapped_ = 0;
  std::uint64_t page_ = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec_;
};

class MemcgTargetFile final : public TargetFile {
 public:
  MemcgTargetFile(int fd, std::filesystem::path memcg, ShadowLog shadow)
      : fd_(fd),
        memcg_(std::move(memcg)),
        shadow_(std::move(shadow)),
        waiter_(system_wait(fd)),
        probe_(fd) {
    drop_cache_at_adoption();
  }

  std::uint64_t size() override { return target_size(fd_.get()); }
  std::optional<std::uint64_t> device() override { return target_device(fd_.get()); }
  std::optional<PageCacheState> page_cache() override {
    // In this order: bytes in flight only fall and a cgroup's dirty pages only grow while nothing
    // is issued, so in shadow mode the truth read between them is compared with a consistent
    // estimate.
    const std::uint64_t in_flight = waiter_.in_flight_bytes();
    const std::optional<PageCacheState> truth =
        shadow_ ? cachestat_of(fd_.get(), ByteRange{0, 0}) : std::nullopt;
    const std::optional<MemcgPageCache> m = read_memcg_page_cache(memcg_);
    if (!m) return read_meminfo();  // the cgroup went away: host-wide, as without this source
    PageCacheState est{m->dirty_bytes, in_flight, true};
    est.dirty_upper_bound = true;
    if (truth) shadow_(est, *truth);
    return est;
  }
  std::optional<PageCacheState> page_cache_in(const ByteRange& r) override {
    // An issued range whose writeback completed is clean as far as the pacer knows.
    PageCacheState st{0, waiter_.in_flight_in(r), true};
    st.dirty_upper_bound = true;
    return st;
  }
  std::uint64_t dirty_in(const ByteRange& r) override {
    const std::optional<std::uint64_t> resident = probe_.resident_in(r, size());
    if (!resident) return r.length;  // unknown: assume dirty (sync_file_range of clean is cheap)
    const std::uint64_t ours = waiter_.in_flight_in(r);
    return *resident - std::min(*resident, ours);
  }
  void start_writeback(const ByteRange& r) override {
    // Best effort: a failure leaves the writeback to the kernel's flusher.
    if (::sync_file_range(fd_.get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                          SYNC_FILE_RANGE_WRITE) == 0)
      waiter_.issued(r);
  }
  void drop_cached(const ByteRange& r) override {
    (void)::posix_fadvise(fd_.get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                          POSIX_FADV_DONTNEED);
  }
  // The governor settles once a sweep of the whole target found nothing to write back.
  bool start_settle() override { return sync_.start(fd_.get()); }

  // Pages cached earlier (by other processes) are charged to their cgroups, not QEMU's: they are
  // dropped.  DONTNEED starts writeback of the dirty ones; what stays resident (at most those)
  // is counted in flight until a wait over the file sees it written.
  void drop_cache_at_adoption() {
    const std::uint64_t n = size();
    if (n == 0) return;
    (void)::posix_fadvise(fd_.get(), 0, 0, POSIX_FADV_DONTNEED);
    const ByteRange all{0, n};
    waiter_.issued(all, probe_.resident_in(all, n).value_or(n));
  }
  bool settling() override { return sync_.busy(); }
  std::vector<throttle::CopySample> take_service_samples() override {
    return waiter_.take_service_samples();
  }

 private:
  UniqueFd fd_;
  std::filesystem::path memcg_;
  ShadowLog shadow_;
  WritebackWaiter waiter_;
  ResidentProbe probe_;
  BackgroundDatasync sync_;
};

}  // namespace

std::unique_ptr<TargetFile> open_memcg_target(int fd, std::filesystem::path memcg,
                                              ShadowLog shadow) {
  return std::make_unique<MemcgTargetFile>(fd, std::move(memcg), std::move(shadow));
}

}  // namespace qcommit::plugin
