// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/completion_clock.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

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
  const auto& [id, f] = *in_flight_.begin();
  return Pending{id, f.range, f.bytes};
}

void ServiceMeter::issued(Duration now) {
  if (in_flight_++ == 0) {
    start_ = now;
    bytes_ = 0;
    carried_ = 0;
  }
}

void ServiceMeter::completed(std::uint64_t bytes, Duration now) {
  if (in_flight_ == 0) return;  // never issued: nothing to time
  if (carried_ > 0)
    --carried_;  // served partly before this period began: its bytes would inflate the rate
  else
    bytes_ += bytes;
  if (--in_flight_ == 0 || now - start_ >= kMaxServicePeriod) end_period(now);
}

// Records the period up to `now` and starts the next one there.  The ranges still in flight
// (completed in issue order: the next ones) were partly served before `now`, so the next period
// counts their time but not their bytes: the rate it shows can only be low.
void ServiceMeter::end_period(Duration now) {
  if (bytes_ > 0 && now - start_ >= kMinServicePeriod && samples_.size() < kMaxServiceSamples)
    samples_.push_back({now - start_, bytes_});
  start_ = now;
  bytes_ = 0;
  carried_ = in_flight_;
}

std::vector<throttle::CopySample> ServiceMeter::take() { return std::exchange(samples_, {}); }

struct WritebackWaiter::State {
  Wait wait;
  mutable std::mutex mu;
  std::condition_variable cv;
  CompletionTracker tracker;
  ServiceMeter meter;
  std::function<std::chrono::nanoseconds()> now = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch());
  };
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

void WritebackWaiter::issued(const ByteRange& r, std::optional<std::uint64_t> bytes,
                             std::optional<std::chrono::nanoseconds> at) {
  {
    std::lock_guard lk(st_->mu);
    (void)st_->tracker.issue(r, bytes);
    st_->meter.issued(at.value_or(st_->now()));
  }
  st_->cv.notify_all();
}

std::chrono::nanoseconds WritebackWaiter::now() const {
  std::lock_guard lk(st_->mu);
  return st_->now();
}

std::vector<throttle::CopySample> WritebackWaiter::take_service_samples() {
  std::lock_guard lk(st_->mu);
  return st_->meter.take();
}

void WritebackWaiter::set_clock(std::function<std::chrono::nanoseconds()> now) {
  std::lock_guard lk(st_->mu);
  st_->now = std::move(now);
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
    if (st->tracker.complete(p.id)) st->meter.completed(p.bytes, st->now());
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
