// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/direct_batch.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace qcommit::engine {

namespace {
// Submissions refused as busy before the rest of a batch is left to the threads' copy.
constexpr int kMaxSubmitRetries = 100;
// Pages a batch's writes touched stay mapped, and count in the resident set, until the file pages
// this process maps have grown by this much; then every mapping's pages are unmapped at once. A
// fault maps the pages around the faulting one, or its whole large folio, so what a write maps is
// not known from its length (unmapping after every 16 MiB written, rand4g's 64 KiB writes took
// the peak RSS to 79 MiB). Unmapping after each batch instead (its span, or 2 MiB around each
// write) cost more system CPU than batching saved: every write faulted its pages in again.
constexpr uint64_t kMaxMappedBytes = 16ull << 20;
}  // namespace

std::unique_ptr<SourceMapping> SourceMapping::map(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) return nullptr;
  const auto size = uint64_t(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::unique_ptr<SourceMapping>(new SourceMapping(fd, static_cast<uint8_t*>(p), size));
}

SourceMapping::~SourceMapping() {
  ::munmap(base_, size_);
}

const uint8_t* SourceMapping::at(uint64_t offset, uint64_t length) const {
  if (offset > size_ || length > size_ - offset) return nullptr;
  return base_ + offset;
}

void SourceMapping::prefetch(uint64_t offset, uint64_t length) const {
  (void)::posix_fadvise(fd_, off_t(offset), off_t(length), POSIX_FADV_WILLNEED);
}

void SourceMapping::unmap_pages() const {
  (void)::madvise(base_, size_, MADV_DONTNEED);
}

SourceMappings::SourceMappings() : statm_(::open("/proc/self/statm", O_RDONLY | O_CLOEXEC)) {
  mapped_at_start_ = mapped_file_bytes().value_or(0);
}

SourceMappings::~SourceMappings() = default;

const SourceMapping* SourceMappings::of(int fd) {
  std::lock_guard lk(mu_);
  auto it = maps_.find(fd);
  if (it == maps_.end()) it = maps_.emplace(fd, SourceMapping::map(fd)).first;
  return it->second.get();
}

void SourceMappings::release_if_grown() {
  std::lock_guard lk(mu_);
  const std::optional<uint64_t> now = mapped_file_bytes();
  if (now && *now < mapped_at_start_ + kMaxMappedBytes) return;
  for (const auto& [fd, m] : maps_)
    if (m) m->unmap_pages();
}

std::optional<uint64_t> SourceMappings::mapped_file_bytes() const {
  char text[128];
  const ssize_t n = statm_.valid() ? ::pread(statm_.get(), text, sizeof text - 1, 0) : -1;
  if (n <= 0) return std::nullopt;
  text[n] = 0;
  unsigned long long size = 0, resident = 0, shared = 0;
  if (std::sscanf(text, "%llu %llu %llu", &size, &resident, &shared) != 3) return std::nullopt;
  return shared * uint64_t(::sysconf(_SC_PAGESIZE));
}

struct DirectBatch::Ring {
  io_uring ring{};
  bool up = false;  // set up (and not torn down after a failed submission)
  bool set_up() { return up = io_uring_queue_init(DirectBatch::kMaxWrites, &ring, 0) == 0; }
  void tear_down() {
    if (up) io_uring_queue_exit(&ring);
    up = false;
  }
  ~Ring() { tear_down(); }
};

DirectBatch::DirectBatch(std::unique_ptr<Ring> ring) : ring_(std::move(ring)) {
  expected_.reserve(kMaxWrites);
}
DirectBatch::~DirectBatch() = default;

std::unique_ptr<DirectBatch> DirectBatch::open() {
  auto ring = std::make_unique<Ring>();
  if (!ring->set_up()) return nullptr;
  return std::unique_ptr<DirectBatch>(new DirectBatch(std::move(ring)));
}

bool DirectBatch::add(int fd, std::span<const iovec> iov, uint64_t offset, uint64_t length) {
  if (!ring_->up || expected_.size() >= kMaxWrites) return false;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_->ring);
  if (!sqe) return false;
  io_uring_prep_writev(sqe, fd, iov.data(), unsigned(iov.size()), offset);
  io_uring_sqe_set_data64(sqe, expected_.size());
  expected_.push_back(length);
  ++prepared_;
  return true;
}

void DirectBatch::submit() {
  for (int busy = 0; submitted_ < prepared_;) {
    const int n = io_uring_submit(&ring_->ring);
    if ((n == -EINTR || n == -EAGAIN) && ++busy < kMaxSubmitRetries) continue;
    if (n <= 0) return;  // the rest stays unsubmitted: wait() reports it as not written
    submitted_ += size_t(n);
  }
}

std::vector<bool> DirectBatch::wait() {
  std::vector<bool> ok(expected_.size(), false);
  for (size_t done = 0; done < submitted_;) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(&ring_->ring, &cqe);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) {
      // A write may still be in flight and land after the flush that is to make it durable:
      // stopping here is the one safe way out (the next run finishes the merge).
      std::fprintf(stderr, "qcommit: io_uring: waiting for writes failed: %s\n", std::strerror(-r));
      std::abort();
    }
    const uint64_t i = io_uring_cqe_get_data64(cqe);
    if (i < ok.size()) ok[i] = cqe->res >= 0 && uint64_t(cqe->res) == expected_[i];
    io_uring_cqe_seen(&ring_->ring, cqe);
    ++done;
  }
  if (submitted_ < prepared_) {
    // Writes the kernel did not take are still in the submission ring, pointing at memory that
    // is about to be reused: a new ring, or none (add() refuses, the caller copies with threads).
    ring_->tear_down();
    (void)ring_->set_up();
  }
  expected_.clear();
  prepared_ = submitted_ = 0;
  return ok;
}

}  // namespace qcommit::engine
