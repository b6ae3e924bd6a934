// SPDX-License-Identifier: GPL-2.0-or-later
// Completion-clocked writeback: the daemon starts writeback of a target in small ranges
// (sync_file_range WRITE) and a waiter waits for each issued range, in issue order
// (sync_file_range WAIT_AFTER: no I/O of its own, on a clean range it returns at once), and marks
// it done.  The bytes the daemon has in flight at storage are then known by construction, without
// any kernel counter: what a kernel without cachestat(2) cannot report per file.
//
// CompletionTracker is pure; WritebackWaiter is its thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "plugin/govern/writeback.h"
#include "throttle/controller.h"

namespace qcommit::plugin {

// Issued ranges and which of them completed.  Completions may come late, out of order, twice, or
// for ranges never issued: only the first completion of an issued range counts.
class CompletionTracker {
 public:
  using Id = std::uint64_t;
  // `bytes` (default: the range's length) is what the range puts in flight, when known to be less.
  [[nodiscard]] Id issue(const ByteRange& r, std::optional<std::uint64_t> bytes = std::nullopt);
  // False when `id` is unknown or already completed.
  bool complete(Id id);
  [[nodiscard]] std::uint64_t issued_bytes() const { return issued_; }
  [[nodiscard]] std::uint64_t completed_bytes() const { return completed_; }
  [[nodiscard]] std::uint64_t in_flight_bytes() const { return issued_ - completed_; }
  // Bytes of `r` in ranges still in flight (each range's overlap with `r`, at most its bytes).
  [[nodiscard]] std::uint64_t in_flight_in(const ByteRange& r) const;
  // The oldest range still in flight: the one a waiter waits for next.
  struct Pending {
    Id id = 0;
    ByteRange range;
    std::uint64_t bytes = 0;
  };
  [[nodiscard]] std::optional<Pending> oldest() const;

 private:
  struct InFlight {
    ByteRange range;
    std::uint64_t bytes = 0;
  };
  std::map<Id, InFlight> in_flight_;
  Id next_ = 0;
  std::uint64_t issued_ = 0;
  std::uint64_t completed_ = 0;
};

// The storage's rate as the target's own writeback shows it (throttle::TickInput::
// own_service_samples): a busy period runs from a range issued while none was in flight to the
// moment none is any more, or kMaxServicePeriod; its sample is the bytes completed in it over its
// length.  Guests' requests the storage served in between make the figure lower, and
// completions the kernel batched (adjacent ranges written as one request) fall in one period
// instead of reading as ranges that took no time.  A period cut at kMaxServicePeriod leaves the
// bytes of the ranges still in flight out of the next one (their service began before it).
// The figure can still be high where a range's writeback was under way before sync_file_range
// (the kernel's flusher had started it).  Pure: `now` is passed in.
inline constexpr std::chrono::milliseconds kMaxServicePeriod{100};
inline constexpr std::chrono::microseconds kMinServicePeriod{500};  // shorter: clock noise
inline constexpr std::size_t kMaxServiceSamples = 64;                // kept between takes

class ServiceMeter {
 public:
  using Duration = std::chrono::nanoseconds;  // since an arbitrary epoch
  void issued(Duration now);
  void completed(std::uint64_t bytes, Duration now);
  // The periods that ended since the previous call.
  [[nodiscard]] std::vector<throttle::CopySample> take();

 private:
  void end_period(Duration now);
  std::uint64_t in_flight_ = 0;  // ranges
  std::uint64_t carried_ = 0;    // of them, in flight when the period began (end_period)
  Duration start_{};
  std::uint64_t bytes_ = 0;
  std::vector<throttle::CopySample> samples_;
};

// Waits for each issued range in a thread of its own.  `wait` blocks until the range's writeback
// completed (SystemWait: sync_file_range WAIT_AFTER on a descriptor of the target).  The thread
// outlives the waiter while a wait is under way (storage may take its time); it then just ends.
class WritebackWaiter {
 public:
  using Wait = std::function<void(const ByteRange&)>;
  explicit WritebackWaiter(Wait wait);
  ~WritebackWaiter();
  WritebackWaiter(const WritebackWaiter&) = delete;
  WritebackWaiter& operator=(const WritebackWaiter&) = delete;

  // Records `r` as issued (the caller has started its writeback), at `at` on the waiter's clock
  // (now() taken before the call that started it; default: now).
  void issued(const ByteRange& r, std::optional<std::uint64_t> bytes = std::nullopt,
              std::optional<std::chrono::nanoseconds> at = std::nullopt);
  [[nodiscard]] std::chrono::nanoseconds now() const;
  [[nodiscard]] std::uint64_t in_flight_bytes() const;
  [[nodiscard]] std::uint64_t in_flight_in(const ByteRange& r) const;
  [[nodiscard]] std::uint64_t completed_bytes() const;
  // False when no thread could be started: ranges are then never marked done.
  [[nodiscard]] bool running() const;
  // The busy periods of the ranges waited for (ServiceMeter) since the previous call.
  [[nodiscard]] std::vector<throttle::CopySample> take_service_samples();
  // The clock the periods are timed with (default: steady_clock); tests set one before issuing.
  void set_clock(std::function<std::chrono::nanoseconds()> now);

  struct State;  // shared with the thread

 private:
  std::shared_ptr<State> st_;
};

// sync_file_range(fd, WAIT_AFTER) of the range on its own duplicate of `fd`; nullptr-equivalent
// (an empty function) when the descriptor cannot be duplicated.
[[nodiscard]] WritebackWaiter::Wait system_wait(int fd);

}  // namespace qcommit::plugin
