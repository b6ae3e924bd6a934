// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/completion_clock.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include "qcow2/unique_fd.h"

namespace qcommit::plugin {

CompletionTracker::Id CompletionTracker::issue(const ByteRange& r,
                                               std::optional<std::uint64_t> bytes) {
  const Id id = next_++;
  const std::uint64_t n = std::min(bytes.value_or(r.length), r.length);
  in_flight_.emplace(id, InFlight{r, n});
  issued_ += n;
  return id;
}

bool CompletionTracker::complete(Id id) {
  const auto it = in_flight_.find(id);
  if (it == in_flight_.end()) return false;
  completed_ += it->second.bytes;
  in_flight_.erase(it);
  return true;
}

std::uint64_t CompletionTracker::in_flight_in(const ByteRange& r) const {
  std::uint64_t total = 0;
  for (const auto& [id, f] : in_flight_) {
    const std::uint64_t lo = std::max(f.range.offset, r.offset);
    const std::uint64_t hi = std::min(f.range.offset + f.range.length, r.offset + r.length);
    if (hi > lo) total += std::min(hi - lo, f.bytes);
  }
  return total;
}

std::optional<CompletionTracker::Pending> CompletionTracker::oldest() const {
  if (in_flight_.empty()) return std::nullopt;
  return Pending{in_flight_.begin()->first, in_flight_.begin()->second.range};
}

struct WritebackWaiter::State {
  Wait wait;
  mutable std::mutex mu;
  std::condition_variable cv;
  CompletionTracker tracker;
  bool stop = false;
  bool running = false;
};

namespace {

void wait_loop(const std::shared_ptr<WritebackWaiter::State>& st);

}  // namespace

WritebackWaiter::WritebackWaiter(Wait wait) : st_(std::make_shared<State>()) {
  st_->wait = std::move(wait);
  if (!st_->wait) return;
  try {
    std::thread([st = st_] { wait_loop(st); }).detach();
    st_->running = true;
  } catch (const std::system_error&) {  // no thread: nothing is ever marked done
  }
}

WritebackWaiter::~WritebackWaiter() {
  {
    std::lock_guard lk(st_->mu);
    st_->stop = true;
  }
  st_->cv.notify_all();
}

void WritebackWaiter::issued(const ByteRange& r, std::optional<std::uint64_t> bytes) {
  {
    std::lock_guard lk(st_->mu);
    (void)st_->tracker.issue(r, bytes);
  }
  st_->cv.notify_all();
}

std::uint64_t WritebackWaiter::in_flight_bytes() const {
  std::lock_guard lk(st_->mu);
  return st_->tracker.in_flight_bytes();
}

std::uint64_t WritebackWaiter::in_flight_in(const ByteRange& r) const {
  std::lock_guard lk(st_->mu);
  return st_->tracker.in_flight_in(r);
}

std::uint64_t WritebackWaiter::completed_bytes() const {
  std::lock_guard lk(st_->mu);
  return st_->tracker.completed_bytes();
}

bool WritebackWaiter::running() const {
  std::lock_guard lk(st_->mu);
  return st_->running;
}

namespace {

// Waits for the oldest range in flight, marks it done, and so on until stopped.
void wait_loop(const std::shared_ptr<WritebackWaiter::State>& st) {
  std::unique_lock lk(st->mu);
  for (;;) {
    st->cv.wait(lk, [&] { return st->stop || st->tracker.oldest().has_value(); });
    if (st->stop) return;
    const CompletionTracker::Pending p = *st->tracker.oldest();
    lk.unlock();
    st->wait(p.range);
    lk.lock();
    (void)st->tracker.complete(p.id);
  }
}

}  // namespace

WritebackWaiter::Wait system_wait(int fd) {
  auto dup = std::make_shared<UniqueFd>(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!dup->valid()) return {};
  return [dup](const ByteRange& r) {
    // Best effort: a failed wait (EIO) still ends the range's writeback.
    (void)::sync_file_range(dup->get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length),
                            SYNC_FILE_RANGE_WAIT_AFTER);
  };
}

}  // namespace qcommit::plugin
