// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/target_pacer.h"

#include <algorithm>
#include <vector>

namespace qcommit::plugin {

const std::optional<PageCacheState>& TargetPacer::read(TargetFile& file, TimePoint now) {
  pc_ = file.page_cache();
  read_at_ = now;
  issued_since_read_ = 0;
  writeback_elsewhere_ = 0;
  if (!pc_ || !pc_->per_file) {
    issued_.clear();
    return pc_;
  }
  const std::optional<std::uint64_t> ours = issued_writeback(file);
  ranges_readable_ = ours.has_value();
  if (!ours) issued_.clear();
  writeback_elsewhere_ = pc_->writeback_bytes - std::min(pc_->writeback_bytes, ours.value_or(0));
  return pc_;
}

std::optional<std::uint64_t> TargetPacer::issued_writeback(TargetFile& file) {
  std::vector<ByteRange> clean;
  const std::optional<std::uint64_t> wb = issued_.under_writeback(
      [&file](const ByteRange& r) { return file.page_cache_in(r); }, &clean);
  for (const ByteRange& r : clean) file.drop_cached(r);
  return wb;
}

PageCacheState TargetPacer::current_reading(TargetFile& file, bool fresh) {
  PageCacheState pc = *pc_;
  pc.dirty_bytes -= std::min(pc.dirty_bytes, issued_since_read_);
  if (fresh) return pc;  // a fresh reading has just read the ranges and issued nothing since
  std::optional<std::uint64_t> ours;
  if (ranges_readable_) {
    ours = issued_writeback(file);
    if (!ours) {
      ranges_readable_ = false;
      issued_.clear();
    }
  }
  pc.writeback_bytes =
      ours ? writeback_elsewhere_ + *ours : pc.writeback_bytes + issued_since_read_;
  return pc;
}

// Without per-file counts the pacer cannot find the job's dirty pages: fdatasyncs of the whole
// target write them out (and tell the tick how much of the job's output is on storage), at most
// one per kFallbackSyncGap, while the job copies or until one has started after its last
// progress.  (A sync of a clean file may still flush the disk's cache.)
void TargetPacer::pace_by_fallback_sync(TargetFile& file, FallbackSync& fs, bool direct_io,
                                        TimePoint now) {
  if (direct_io || !fs.tick_cur) return;
  if (fs.sync_start_cur && !file.settling()) {
    fs.synced_cur = fs.sync_start_cur;
    fs.sync_start_cur.reset();
  }
  const bool behind = !fs.synced_cur || *fs.synced_cur != *fs.tick_cur;
  const bool due = !fs.sync_started_at || now - *fs.sync_started_at >= kFallbackSyncGap;
  if (!fs.sync_start_cur && due && (fs.tick_progressed || behind) && file.start_settle()) {
    fs.sync_start_cur = fs.tick_cur;
    fs.sync_started_at = now;
  }
}

void TargetPacer::pace(TargetFile& file, std::uint64_t window_bytes, FallbackSync& fallback,
                       bool direct_io, TimePoint now) {
  bool fresh = false;
  if (!read_at_ || now - *read_at_ >= refresh_) {
    (void)read(file, now);
    fresh = true;
  }
  if (!pc_) return;
  if (!pc_->per_file) {
    pace_by_fallback_sync(file, fallback, direct_io, now);
    return;
  }
  const PageCacheState pc = current_reading(file, fresh);
  if (pc.dirty_bytes == 0) return;  // nothing to push
  WritebackInput wi;
  wi.file_size = file.size();
  wi.writeback_bytes = pc.writeback_bytes;
  wi.window_bytes = window_bytes;
  wi.max_range_bytes = writeback_range_bytes(window_bytes, planner_.config().piece_bytes);
  const WritebackPlan plan =
      planner_.plan(wi, [&file](const ByteRange& r) { return file.dirty_in(r); });
  for (const auto& r : plan.ranges) {
    file.start_writeback(r);
    if (ranges_readable_) issued_.add(r);
  }
  issued_since_read_ += plan.dirty_bytes_issued;
  // A whole lap found less than the estimate (the kernel's flusher wrote some back): until the
  // next whole-file reading nothing is left to push.  Without this every pace interval swept the
  // whole file again (cachestat over every cached page: ~30 % of a core on a 2.5 GiB base in the
  // lab).
  if (plan.lapped) issued_since_read_ = std::max(issued_since_read_, pc_->dirty_bytes);
  if (plan.lapped && plan.dirty_bytes_issued == 0) clean_sweep_at_ = now;
}

bool TargetPacer::clean_for_settle(const PageCacheState& pc, TimePoint hold_since) const {
  if (pc.dirty_bytes == 0) return true;
  return pc.dirty_upper_bound && clean_sweep_at_ && *clean_sweep_at_ >= hold_since;
}

// The hold did not make the target clean in time: the storage drained the job's dirty pages more
// slowly than the limit allows (busy guests beside it).  The next hold may take as long as the
// drain seen in this one says a clean target takes, plus a quarter, where that is at most half an
// interval; a longer one would cost the job more than half its time, and a hold that saw no drain
// says nothing of how long one needs.  The kernel writes back the whole of an inode dirty for
// vm.dirty_expire_centisecs at once (lab, a guest writing 11 MiB/s beside a 1.5 GiB active
// commit, 2026-12-07: holds of 2 s did not clean 16-32 MiB, and at 31 s and 67 s the flusher
// queued 11-14 MiB ahead of the guests, 250 ms).
bool TargetPacer::give_up_hold(std::uint64_t dirty_now, bool exact, TimePoint now) {
  SettleState& st = settle_;
  const double held = std::chrono::duration<double>(now - *st.hold_since).count();
  st.dirty_since = now;
  ++st.given_up;
  st.hold_limit = settle_cfg_.max_hold;
  // An upper bound (a memory cgroup's count, the guests' pages too) says nothing of the target's
  // drain: such a hold ends on a clean sweep, not on the count.
  if (exact && dirty_now < st.dirty_at_hold && held > 0) {
    const double rate = static_cast<double>(st.dirty_at_hold - dirty_now) / held;
    const auto need = std::chrono::duration_cast<Duration>(
        std::chrono::duration<double>(kHoldMargin * static_cast<double>(st.dirty_at_hold) / rate));
    if (need <= settle_cfg_.every / 2) st.hold_limit = std::max(settle_cfg_.max_hold, need);
  }
  return end_hold();  // a pivot goes ahead as it would have
}

bool TargetPacer::settle_done() {
  settle_.dirty_since.reset();
  ++settle_.count;
  settle_.hold_limit = settle_cfg_.max_hold;
  return end_hold();
}

bool TargetPacer::end_hold() {
  settle_.hold_since.reset();
  settle_.started = false;
  if (settle_.pivot_asked) settle_.pivot_ready = true;
  return settle_.pivot_ready;
}

bool TargetPacer::settle(TargetFile& file, const std::optional<PageCacheState>& pc, TimePoint now) {
  if (!settles_enabled() || !pc || !pc->per_file) return false;
  SettleState& st = settle_;
  if (st.pivot_ready) return true;  // held until the pivot ends the job
  if (!st.hold_since) {
    if (pc->dirty_bytes > 0 && !st.dirty_since) st.dirty_since = now;
    const bool due = st.dirty_since && now - *st.dirty_since >= settle_cfg_.every;
    if (!due && !st.pivot_asked) return false;
    st.hold_since = now;
    st.started = false;
    st.dirty_at_hold = pc->dirty_bytes;
  }
  if (!st.started) {
    if (clean_for_settle(*pc, *st.hold_since) && file.start_settle())
      st.started = true;
    else if (now - *st.hold_since >= st.hold_limit)
      return give_up_hold(pc->dirty_bytes, !pc->dirty_upper_bound, now);
    return true;
  }
  if (file.settling()) return true;
  return settle_done();
}

bool TargetPacer::settled_for_pivot(TimePoint now) {
  if (!settle_.pivot_asked) settle_.pivot_asked = now;
  // No reading of the target arrives (it cannot be read): the pivot waits no longer than two
  // holds (as long as the current one may take).
  return settle_.pivot_ready ||
         now - *settle_.pivot_asked >= 2 * std::max(settle_cfg_.max_hold, settle_.hold_limit);
}

}  // namespace qcommit::plugin
