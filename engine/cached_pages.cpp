// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/cached_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "engine/copy_pool.h"
#include "engine/proc_walk.h"
#include "engine/storage_kind.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

using qcow2::Error;
using qcow2::IoError;

namespace {

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
  throw IoError(path,
                std::string("cannot write back cached pages before resuming: ") + strerror(errno),
                errno);
}

// Why BASE's cached pages could not be dropped, naming only what was seen: the processes that
// have it open, else the pages left and the filesystem they are on.
std::string undroppable_pages_problem(const std::string& path, uint64_t pages_left,
                                      const std::optional<StorageKind>& kind) {
  std::string problem =
      "cannot drop its cached pages to read it from storage before resuming an interrupted merge "
      "(" +
      std::to_string(pages_left) + " pages stayed after a write-back and a drop, on " +
      (kind ? kind->fs : std::string("a filesystem of unknown type")) + ")";
  if (const std::vector<Holder> holders = holders_of(path, Access::any); !holders.empty())
    return problem + "; it is open in " + describe(holders) + ": close it and run the merge again";
  return problem + "; no other process has it open";
}

}  // namespace

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

}  // namespace qcommit::engine
