// SPDX-License-Identifier: GPL-2.0-or-later
// The page-cache side of one governed job, as steps that take `now` and work through the job's
// TargetFile: the Governor says when (every tick, every GovernorOptions::pace), this says what.
//   read()    the tick's whole-file reading of the target (cachestat over it: CPU in proportion
//             to its cached pages); the pacer works from it until the next one;
//   pace()    starts writeback of the target's dirty pages so that no more than the job's
//             window is at storage (WritebackPlanner); between whole-file readings it re-reads
//             only the ranges it issued (IssuedRanges).  Without per-file counts it runs an
//             fdatasync of the whole target instead, when FallbackSync says one is due;
//   settle()  the settle state machine (GovernorOptions::settle_every): hold the job at the floor
//             until the target has nothing dirty, fdatasync it, let go; a hold that does not get
//             there within its limit is given up and retried an interval later, for as long as
//             the dirty pages' drain during the hold says a clean target takes (with a margin),
//             where that is at most half an interval; else, and after a settle, max_hold;
//   settled_for_pivot()  a pivot's settle: asked once, over when it is done or given up.
// tests/plugin/test_target_pacer.cpp drives it with a scripted TargetFile and a manual clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "plugin/govern/job_pacing.h"
#include "plugin/govern/writeback.h"

namespace qcommit::plugin {

// A hold after one given up may last this multiple of the time the last one's drain says a clean
// target takes.
inline constexpr double kHoldMargin = 1.25;

struct SettleConfig {
  Duration every = std::chrono::seconds(10);  // zero: no settles
  Duration max_hold = std::chrono::seconds(2);
};

class TargetPacer {
 public:
  TargetPacer(const WritebackConfig& writeback, SettleConfig settle, Duration page_cache_refresh)
      : planner_(writeback), settle_cfg_(settle), refresh_(page_cache_refresh) {
    settle_.hold_limit = settle.max_hold;
  }

  // The tick's whole-file reading of `file`.
  const std::optional<PageCacheState>& read(TargetFile& file, TimePoint now);

  // One pace step for a job whose writes go through the page cache (`direct_io` false) or not.
  void pace(TargetFile& file, std::uint64_t window_bytes, FallbackSync& fallback, bool direct_io,
            TimePoint now);

  // True while the job is held for a settle (`pc`: this tick's reading).
  [[nodiscard]] bool settle(TargetFile& file, const std::optional<PageCacheState>& pc,
                            TimePoint now);
  // True once the settle a pivot asked for (at the first call) is over, or when no reading has
  // let one start within two holds (of the current hold limit).
  [[nodiscard]] bool settled_for_pivot(TimePoint now);

  [[nodiscard]] bool settles_enabled() const { return settle_cfg_.every != Duration::zero(); }
  [[nodiscard]] bool settling() const { return settle_.hold_since.has_value(); }
  [[nodiscard]] std::uint32_t settles() const { return settle_.count; }
  [[nodiscard]] std::uint32_t settles_given_up() const { return settle_.given_up; }
  // How long the next hold may take to make the target clean.
  [[nodiscard]] Duration hold_limit() const { return settle_.hold_limit; }

 private:
  // Settling: dirty without a settle since, holding since, fdatasync started, settles done and
  // given up, the current hold's limit; and a pivot's: asked when, and whether its settle is
  // over (done or given up).
  struct SettleState {
    std::optional<TimePoint> dirty_since;
    std::optional<TimePoint> hold_since;
    bool started = false;
    std::uint32_t count = 0;
    std::uint32_t given_up = 0;
    Duration hold_limit{};
    std::uint64_t dirty_at_hold = 0;  // the target's dirty bytes when the hold began
    std::optional<TimePoint> pivot_asked;
    bool pivot_ready = false;
  };

  // The reading between whole-file ones: what was issued is no longer dirty; what is under
  // writeback is the kernel's share from the last reading plus a fresh reading of the issued
  // ranges (or, where ranges cannot be read, everything issued since).
  [[nodiscard]] PageCacheState current_reading(TargetFile& file, bool fresh);
  void pace_by_fallback_sync(TargetFile& file, FallbackSync& fs, bool direct_io, TimePoint now);
  // What is under writeback in the ranges the pacer issued; ranges written and clean leave the
  // page cache.
  [[nodiscard]] std::optional<std::uint64_t> issued_writeback(TargetFile& file);
  // Nothing dirty for a settle begun at `hold_since`: the per-file count says so, or, where it is
  // an upper bound (a memory cgroup's), a sweep of the whole target since found nothing to push.
  [[nodiscard]] bool clean_for_settle(const PageCacheState& pc, TimePoint hold_since) const;
  // The hold could not start a settle in time: given up, retried an interval later.
  [[nodiscard]] bool give_up_hold(std::uint64_t dirty_now, bool exact, TimePoint now);
  [[nodiscard]] bool settle_done();
  // The hold is over (done or given up): the job is let go, unless a pivot asked for the settle
  // (it stays held until the pivot ends the job).  True while held.
  [[nodiscard]] bool end_hold();

  WritebackPlanner planner_;
  SettleConfig settle_cfg_;
  Duration refresh_;
  // The last whole-file reading, when, and dirty bytes issued since.
  std::optional<PageCacheState> pc_;
  std::optional<TimePoint> read_at_;
  std::uint64_t issued_since_read_ = 0;
  IssuedRanges issued_;
  std::uint64_t writeback_elsewhere_ = 0;  // the kernel's own writeback at the last reading
  bool ranges_readable_ = true;  // false: cachestat of a range failed, count issued bytes instead
  // When a sweep of the whole target last found nothing to write back.
  std::optional<TimePoint> clean_sweep_at_;
  SettleState settle_;
};

}  // namespace qcommit::plugin
