// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/job_pacing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace qcommit::plugin {

namespace {

double seconds(Duration d) {
  return std::chrono::duration<double>(d).count();
}

// The bytes of `extents` (ascending) at or beyond `offset`.
std::uint64_t bytes_beyond(const std::vector<ByteRange>& extents, std::uint64_t offset) {
  std::uint64_t n = 0;
  for (auto it = extents.rbegin(); it != extents.rend(); ++it) {
    const std::uint64_t end = it->offset + it->length;
    if (end <= offset) break;
    n += end - std::max(it->offset, offset);
  }
  return n;
}

}  // namespace

bool mirror_job(JobType t) {
  return t == JobType::ActiveCommit || t == JobType::Copy;
}

JobPacing::JobPacing(PacedJob job, const throttle::ControllerConfig& c)
    : job_(std::move(job)), ctl_(c) {}

PacingMeasure JobPacing::measure(const PacingReading& r) {
  PacingMeasure m;
  m.own_bound = own_backlog_bound(r);
  // The pacer pushes fresh dirty pages every `pace`: only dirty pages beyond one pace interval's
  // production at the current speed count as queued.
  const auto pace_production =
      static_cast<std::uint64_t>(static_cast<double>(r.speed_set) * seconds(job_.pace));
  m.backlog = queued_bytes(r.pc, pace_production, m.own_bound);
  m.drained = release_drain(r, m.backlog);
  m.own_queue = own_queue_bytes(r.pc);
  follow_convergence(r);
  return m;
}

// See kConvergeWindow.  A mirror that is ready copies what the guests write as they write it:
// converged.  QEMU's progress going back is another job: start over (libvirt shows a mirror that
// is not ready one byte below its end when QEMU has them equal: a step back by one is the same
// job).  QEMU reports a mirror's progress in bursts of up to 16 MiB, and at a low speed it sleeps
// each one off for many seconds: the window spans two bursts at the speed set (at least
// kConvergeWindow, at most kMaxConvergeWindow), so that a burst-free stretch of a slow mirror does
// not read as a stall.  A mirror the guests add nothing to finishes whenever the governor lets it
// copy, and one within kMirrorConvergeBytes of its end sprints to ready already: neither is
// said not to converge.
void JobPacing::follow_convergence(const PacingReading& r) {
  if (!mirror_job(job_.type) || r.ready) {
    progress_.clear();
    convergence_ = Convergence{};
    return;
  }
  if (!progress_.empty() && r.info.cur + 1 < progress_.back().cur) {
    progress_.clear();
    convergence_ = Convergence{};
  }
  progress_.push_back({r.now, r.info.cur, r.info.end});
  while (progress_.size() > 2 && r.now - progress_[1].at >= kMaxConvergeWindow)
    progress_.pop_front();
  const Duration window =
      std::clamp<Duration>(std::chrono::duration_cast<Duration>(std::chrono::duration<double>(
                               2.0 * static_cast<double>(kDirtyAllowanceBytes) /
                               static_cast<double>(std::max<std::uint64_t>(r.speed_set, 1)))),
                           kConvergeWindow, kMaxConvergeWindow);
  const ProgressSample& b = progress_.back();
  const ProgressSample* a = nullptr;
  for (auto it = progress_.rbegin(); it != progress_.rend(); ++it)
    if (b.at - it->at >= window) {
      a = &*it;
      break;
    }
  if (!a) return;
  Convergence& c = convergence_;
  const double secs = seconds(b.at - a->at);
  c.known = true;
  c.added_bytes_per_s = static_cast<double>(b.end - std::min(a->end, b.end)) / secs;
  c.copied_bytes_per_s = static_cast<double>(b.cur - std::min(a->cur, b.cur)) / secs;
  const std::uint64_t left_then = a->end - std::min(a->cur, a->end);
  const std::uint64_t left_now = b.end - std::min(b.cur, b.end);
  c.converging =
      left_now < left_then || left_now <= kMirrorConvergeBytes || c.added_bytes_per_s == 0;
  if (c.converging) {
    if (c.floor_bytes_per_s == 0) c.stalled_since.reset();
    return;
  }
  if (!c.stalled_since) c.stalled_since = r.now;
  if (r.now - *c.stalled_since < kNotConvergingAfter) return;
  const double floor =
      std::clamp(kConvergeFloorFactor * c.added_bytes_per_s, ctl_.config().floor_rate_bytes_per_s,
                 std::max(ctl_.config().floor_rate_bytes_per_s, job_.ceiling_bytes_per_s));
  c.floor_bytes_per_s = std::max(c.floor_bytes_per_s, floor);
}

// Without per-file counts the page-cache reading is host-wide: other writers' pages too.  A job
// whose writes bypass the page cache has none of them.  Another job's own pages are at most what
// it copied since the start of the last completed fdatasync of its target (Governor::pace runs
// them while the job copies: everything dirtied before that start is on storage).  Progress is
// only known per tick and a sync's start is stamped with the last tick's, so of this tick's
// progress the count leaves out what the set speed allows in a tick (it went out with the syncs
// of this tick unless storage held it up); beyond that (QEMU's bursts: a mirror copies 16 MiB
// whatever its speed) it counts.  No bound (the maximum) with per-file counts.
std::uint64_t JobPacing::own_backlog_bound(const PacingReading& r) {
  if (!r.pc || r.pc->per_file) return std::numeric_limits<std::uint64_t>::max();
  FallbackSync& fs = fallback_;
  if (fs.tick_cur && r.info.cur < *fs.tick_cur) fs.restart();  // a new job: start over
  const std::optional<std::uint64_t> before = fs.tick_cur;
  fs.tick_cur = r.info.cur;
  fs.tick_progressed = before && r.info.cur > *before;
  if (job_.direct_io) return 0;
  if (!fs.synced_cur || !before) return std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t since = r.info.cur > *fs.synced_cur ? r.info.cur - *fs.synced_cur : 0;
  const std::uint64_t progressed = r.info.cur > *before ? r.info.cur - *before : 0;
  const auto allowed =
      static_cast<std::uint64_t>(static_cast<double>(r.speed_set) * seconds(job_.tick));
  return since - std::min({since, progressed, allowed});
}

// The most of the job's own bytes ahead of a guest's request at storage (throttle::TickInput::
// own_queue_bytes): a job writing past the page cache, the requests QEMU keeps in flight (where
// their size is known); else the target's pages under writeback, where cachestat(2) counts them
// for the file -- started by the pacer or by the kernel, and after a mirror's ready the guest's
// writes it mirrors too: an upper bound.  nullopt where the count is host-wide or estimated (no
// bound: every delay measured is charged to the job).
std::optional<std::uint64_t> JobPacing::own_queue_bytes(
    const std::optional<PageCacheState>& pc) const {
  if (job_.direct_io) {
    const throttle::ControllerConfig& c = ctl_.config();
    if (c.copy_request_bytes == 0) return std::nullopt;
    return std::uint64_t{c.copy_requests_in_flight} * c.copy_request_bytes;
  }
  if (!pc || !pc->per_file || pc->dirty_upper_bound) return std::nullopt;
  return pc->writeback_bytes;
}

std::uint64_t JobPacing::queued_bytes(const std::optional<PageCacheState>& pc,
                                      std::uint64_t dirty_allowance, std::uint64_t own_bound) {
  if (!pc) return 0;
  const std::uint64_t dirty =
      pc->dirty_bytes > dirty_allowance ? pc->dirty_bytes - dirty_allowance : 0;
  return std::min(pc->writeback_bytes + dirty, own_bound);
}

// QEMU reports progress in bursts (the mirror: 16 MiB at once, then it sleeps the burst off at the
// set speed; commit.c counts unallocated stretches without copying).  Per tick that looks like
// "idle" most of the time, so the controller would never see the job use its allowance and never
// raise the rate (cache=none: stuck at the floor).  Progress (less the backlog's growth) goes into
// a credit released at up to kDrainCreditRateFactor × the paced rate per tick, carrying at most
// kMaxDrainCredit of it.  Returns the bytes released to this tick.
std::uint64_t JobPacing::release_drain(const PacingReading& r, std::uint64_t backlog) {
  std::uint64_t drained = 0;
  if (last_cur_ && r.info.cur >= *last_cur_) {
    const auto written = static_cast<std::int64_t>(r.info.cur - *last_cur_);
    const std::int64_t growth =
        static_cast<std::int64_t>(backlog) - static_cast<std::int64_t>(backlog_);
    drain_credit_ += static_cast<double>(std::max<std::int64_t>(0, written - growth));
  }
  if (last_tick_) {
    const double dt = seconds(r.now - *last_tick_);
    const double rate =
        std::max({decision_ ? decision_->rate_bytes_per_s : 0.0, static_cast<double>(r.speed_set),
                  static_cast<double>(job_.min_speed_bytes_per_s)});
    const double release = std::min(drain_credit_, kDrainCreditRateFactor * rate * dt);
    drained = static_cast<std::uint64_t>(release);
    drain_credit_ = std::min(drain_credit_ - release, rate * seconds(kMaxDrainCredit));
  }
  last_tick_ = r.now;
  return drained;
}

// While the job is held for a settle, its progress and backlog say nothing about the storage
// (the hold made them): the controller is not fed and the last decision stands; its next interval
// starts now (taken from before the hold with one tick's progress, it read as a collapsed drain
// rate: window at the minimum for ~1.5 s after every settle in the lab), and what drained during
// the hold is not credited to the ticks after it.
throttle::Decision JobPacing::decide(const throttle::TickInput& in, bool holding) {
  if (holding) {
    ctl_.skip_until(in.now);
    drain_credit_ = 0;
  }
  decision_ = holding && decision_ ? *decision_ : ctl_.tick(in);
  return *decision_;
}

// What is left to copy: a non-active commit's progress counts the unallocated parts of the image
// too, which QEMU skips without writing, so where its extents are known, their bytes beyond its
// progress.
std::uint64_t JobPacing::bytes_left(const JobInfo& info) const {
  if (job_.type == JobType::Commit && job_.commit_extents)
    return bytes_beyond(*job_.commit_extents, info.cur);
  return info.end > info.cur ? info.end - info.cur : 0;
}

// A mirror's last sprint to ready.  QEMU updates a mirror's end only as it iterates, and one held
// at the floor iterates seldom: what the guests wrote meanwhile is in its dirty bitmap but not in
// its end.  At the ceiling it copies all of that into BASE's page cache within a tick and then
// flushes BASE before it is ready (lab, a guest writing 11 MiB/s, 2026-12-07: 64 KiB left, then
// 11 MiB at storage at once, the probe's max 273 ms).  So where the guests add to it, the sprint
// goes at kSprintAddedFactor x their rate (at least the converge floor and kMinSprintBytesPerS,
// at most the ceiling): a tick copies a few MiB, which the near-end hold (no dirty allowance)
// lets the pacer push before the next, and it still outruns the guests.  Never slower than
// kMinSprintBytesPerS: a guest adding a little (a probe's 4 KiB writes dirty whole clusters) would
// otherwise set a speed at which the mirror sleeps off every small copy and may never be ready
// (lab: 1 byte left for minutes at the 1 MiB/s floor).  A mirror the guests add nothing to (an
// idle guest, or too few readings to tell) sprints at the ceiling.
std::uint64_t JobPacing::sprint_speed() const {
  const double ceiling = job_.ceiling_bytes_per_s;
  if (!convergence_.known || convergence_.added_bytes_per_s <= 0)
    return static_cast<std::uint64_t>(ceiling);
  const double lo =
      std::max({static_cast<double>(job_.min_speed_bytes_per_s), convergence_.floor_bytes_per_s,
                ctl_.config().floor_rate_bytes_per_s, kMinSprintBytesPerS});
  return static_cast<std::uint64_t>(
      std::min(ceiling, std::max(lo, kSprintAddedFactor * convergence_.added_bytes_per_s)));
}

// Held (paused, more queued than the window allows, or settling): the floor.  Dirty pages the
// pacer has not pushed yet are not queued anywhere: up to one QEMU request burst of them
// (kDirtyAllowanceBytes) lets the job copy its next burst while the pacer drains the previous
// one.  Near its end a mirror copies its last burst and then flushes BASE (before ready): all it
// left dirty is written at once (lab: 160 ms ahead of the guest), so there the allowance is 0 and
// QEMU sleeps off its last burst at the floor meanwhile.  The same near the end of a non-active
// commit's data, where BASE is flushed while the guest's requests are drained (lab, 512 MiB at
// 42 MB/s: the pacer 14 MiB behind, the guest frozen 0.39 s); there the job also runs no faster
// than the pacer keeps up with.  And a mirror with at most kMirrorConvergeBytes left runs at the
// ceiling: the guest keeps dirtying clusters, and at a low speed the mirror sleeps off every
// small copy and may never become ready (seen in the lab: 1 byte left for minutes at the 1 MiB/s
// floor); finishing it unpaced queues at most that.
JobSpeed JobPacing::speed(const PacingReading& r, const PacingMeasure& m,
                          const throttle::Decision& d, bool holding) const {
  const bool mirror_unready = mirror_job(job_.type) && !r.ready;
  const bool near_end = (mirror_unready || job_.type == JobType::Commit) &&
                        bytes_left(r.info) <= kDirtyAllowanceBytes;
  const std::uint64_t queued = queued_bytes(r.pc, near_end ? 0 : kDirtyAllowanceBytes, m.own_bound);
  JobSpeed out;
  out.held = d.paused || queued > d.window_bytes || holding;
  const auto converge_floor = static_cast<std::uint64_t>(convergence_.floor_bytes_per_s);
  if (out.held) {
    // A settle's hold is short (GovernorOptions::settle_max_hold) and makes the pivot's flush
    // short: it holds a mirror under its converge floor too.
    out.speed =
        holding ? job_.min_speed_bytes_per_s : std::max(job_.min_speed_bytes_per_s, converge_floor);
    return out;
  }
  const auto lo = static_cast<double>(job_.min_speed_bytes_per_s);
  out.speed = static_cast<std::uint64_t>(
      std::llround(std::clamp(d.rate_bytes_per_s, lo, std::max(lo, job_.ceiling_bytes_per_s))));
  if (mirror_unready && r.info.end > r.info.cur && r.info.end - r.info.cur <= kMirrorConvergeBytes)
    out.speed = std::max(out.speed, sprint_speed());  // never slower than it ran before
  else if (mirror_unready)
    out.speed = std::max(out.speed, converge_floor);
  else if (near_end && job_.type == JobType::Commit && !job_.direct_io)
    // One window per tick, what the pacer keeps up with: what is dirty when QEMU completes
    // stays about one window (not a burst the speed let through between two ticks).  At least
    // kFinishingSpeedBytesPerS (never above the controller's rate): where the controller has
    // shrunk the window to its minimum, one window per tick (640 KiB/s) took 25 s for the last
    // 16 MiB (lab, QEMU 10).  Not with cache=none: nothing of the job's is left dirty there.
    out.speed = std::min(out.speed,
                         std::max({job_.min_speed_bytes_per_s, kFinishingSpeedBytesPerS,
                                   static_cast<std::uint64_t>(static_cast<double>(d.window_bytes) /
                                                              seconds(job_.tick))}));
  return out;
}

std::uint64_t JobPacing::writeback_window(const throttle::Decision& d) const {
  const auto window =
      static_cast<std::uint64_t>(static_cast<double>(d.window_bytes) *
                                 (mirror_job(job_.type) ? kMirrorPacerWindowFraction : 1.0));
  if (convergence_.floor_bytes_per_s <= 0) return window;
  const auto carried = static_cast<std::uint64_t>(
      convergence_.floor_bytes_per_s * seconds(d.measured_delay + ctl_.config().latency_budget));
  return std::max(window, carried);
}

void JobPacing::record(const JobInfo& info, std::uint64_t backlog) {
  last_cur_ = info.cur;
  backlog_ = backlog;
}

// A mirror's convergence and its floor stay: when it is another job, its progress went back.
void JobPacing::restart() {
  last_cur_.reset();
  drain_credit_ = 0;
  last_tick_.reset();
  fallback_.restart();
}

void JobPacing::reconfigure(const throttle::ControllerConfig& c) {
  ctl_ = throttle::Controller(c);
}

}  // namespace qcommit::plugin
