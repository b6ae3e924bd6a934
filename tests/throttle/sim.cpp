// SPDX-License-Identifier: GPL-2.0-or-later
#include "tests/throttle/sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <stdexcept>

namespace qcommit::throttle::sim {

namespace {
constexpr std::uint64_t kMinCopyIo = 64 * kKiB;
constexpr std::uint64_t kPageBytes = 4 * kKiB;
constexpr std::uint64_t kIosPerWindow = 8;  // copy I/O size ≈ window / 8 (pipelining)
constexpr double kUnlimitedRate = 1e15;
// A host whose guests completed nothing for this long and have nothing outstanding is reported
// idle (JobConfig::idle_signal), as qcommitd's kIdleStorageAfter.
constexpr Ns kHostIdleAfter = 1 * kSec;
TimePoint tp(Ns t) { return TimePoint(Duration(t)); }
}  // namespace

enum class ReqKind { Guest, Copy, Writeback, Probe };

struct Simulator::Req {
  std::uint64_t id = 0;
  ReqKind kind = ReqKind::Guest;
  int owner = 0;
  std::uint64_t bytes = 0;
  double work = 0;
  Ns submit = 0;
  Ns nominal = 0;
};

struct Simulator::Guest {
  GuestConfig cfg;
  Ns next_due = 0;
};

struct Simulator::Job {
  JobConfig cfg;
  int index = 0;
  std::optional<Controller> ctl;
  Pacer pacer{1.0};
  bool started = false;
  bool cancelled = false;
  bool finished = false;
  bool waiting_pacer = false;
  std::uint64_t submitted = 0;
  std::uint64_t inflight = 0;  // direct: in storage; buffered: being copied into the cache
  std::map<std::uint64_t, Ns> outstanding;
  Ns memcpy_free_at = 0;
  Decision decision{};
  std::vector<Duration> fg_inbox;
  std::vector<CopySample> copy_inbox;
  std::vector<CopySample> service_inbox;  // JobConfig::own_queue_visible
  Ns prev_completion = 0;                 // of the copy's previous request
  std::optional<ProbeSchedule> probe;
  std::vector<Duration> probe_inbox;
  std::uint64_t drained_since_tick = 0;
  Ns slice_end = 0;       // request_bytes: the end of the job's current rate-limit slice
  double slice_debt = 0;  // bytes sent beyond the quota of the slices gone by
  // The time this job's controller and probe are given (its host's clock).
  [[nodiscard]] TimePoint host_time(Ns now) const { return tp(now + cfg.clock_offset); }
  JobStats stats;
};

std::uint64_t JobStats::drained_at(Ns t) const {
  auto it = std::upper_bound(drained.begin(), drained.end(), t,
                             [](Ns v, const auto& p) { return v < p.first; });
  if (it == drained.begin()) return 0;
  return std::prev(it)->second;
}

double JobStats::throughput(Ns a, Ns b) const {
  if (b <= a) return 0;
  return static_cast<double>(drained_at(b) - drained_at(a)) / (static_cast<double>(b - a) / kSec);
}

Simulator::Simulator(StorageConfig storage, PageCacheConfig cache, std::uint64_t seed)
    : storage_(storage), cache_(cache), rng_(seed), bandwidth_(storage.bandwidth),
      base_latency_(storage.base_latency) {}

Simulator::~Simulator() = default;

void Simulator::schedule(Ns t, std::function<void()> fn) {
  events_.push(Event{std::max(t, now_), seq_++, std::move(fn)});
}

// ---- storage server --------------------------------------------------------------------------
double Simulator::server_rate() const {
  if (stalled_) return 0;
  double r = bandwidth_;
  if (storage_.depth_knee > 0) {
    const double n = static_cast<double>(fifo_.size() - fifo_head_);
    const double f = storage_.depth_min_fraction;
    r *= std::min(1.0, f + (1.0 - f) * n / storage_.depth_knee);
  }
  return r;
}

void Simulator::server_advance() {
  if (fifo_head_ < fifo_.size()) {
    head_work_left_ -= cur_rate_ * static_cast<double>(now_ - server_last_) / kSec;
  }
  server_last_ = now_;
}

void Simulator::server_reschedule() {
  const double r = server_rate();
  cur_rate_ = r;
  ++server_gen_;
  if (fifo_head_ < fifo_.size() && r > 0) {
    const double secs = std::max(0.0, head_work_left_) / r;
    const Ns eta = now_ + static_cast<Ns>(std::ceil(secs * kSec));
    const std::uint64_t g = server_gen_;
    schedule(eta, [this, g] { server_done(g); });
  }
}

void Simulator::server_done(std::uint64_t gen) {
  if (gen != server_gen_) return;
  server_advance();
  Req r = fifo_[fifo_head_++];
  if (fifo_head_ > 4096 && fifo_head_ * 2 > fifo_.size()) {
    fifo_.erase(fifo_.begin(), fifo_.begin() + static_cast<std::ptrdiff_t>(fifo_head_));
    fifo_head_ = 0;
  }
  if (fifo_head_ < fifo_.size()) head_work_left_ = fifo_[fifo_head_].work;
  server_reschedule();
  schedule(now_ + base_latency_, [this, r] { on_complete(r); });
}

void Simulator::submit(Req r) {
  server_advance();
  r.id = next_req_id_++;
  r.submit = now_;
  double noise = 1.0;
  if (storage_.noise_sigma > 0) {
    std::normal_distribution<double> z(0.0, 1.0);
    const double s = storage_.noise_sigma;
    noise = std::exp(s * z(rng_) - s * s / 2);
  }
  r.work = static_cast<double>(r.bytes) * noise;
  double single_rate = bandwidth_;
  if (storage_.depth_knee > 0)
    single_rate *= std::min(1.0, storage_.depth_min_fraction +
                                     (1.0 - storage_.depth_min_fraction) / storage_.depth_knee);
  r.nominal = base_latency_ + static_cast<Ns>(static_cast<double>(r.bytes) / single_rate * kSec);
  if (r.kind == ReqKind::Guest)
    guest_outstanding_[r.id] = {now_, guests_[static_cast<std::size_t>(r.owner)]->cfg.host};
  if (r.kind == ReqKind::Copy) jobs_[static_cast<std::size_t>(r.owner)]->outstanding[r.id] = now_;
  const bool was_empty = fifo_head_ >= fifo_.size();
  fifo_.push_back(r);
  if (was_empty) head_work_left_ = r.work;
  if (was_empty || storage_.depth_knee > 0) server_reschedule();
}

void Simulator::on_complete(const Req& r) {
  switch (r.kind) {
    case ReqKind::Guest: {
      guest_outstanding_.erase(r.id);
      const Ns lat = now_ - r.submit;
      guest_samples_.push_back({r.submit, now_, lat, lat - r.nominal, r.bytes, r.owner});
      const int host = guests_[static_cast<std::size_t>(r.owner)]->cfg.host;
      host_last_completion_[host] = now_;
      std::uniform_real_distribution<double> u(0, 1);
      for (auto& j : jobs_) {
        if (!j->started || j->cancelled || j->finished || !j->ctl) continue;
        if (j->cfg.host != host) continue;  // a guest on another host is not seen
        if (j->cfg.sample_loss > 0 && u(rng_) < j->cfg.sample_loss) continue;
        j->fg_inbox.push_back(Duration(lat));
      }
      Guest& g = *guests_[static_cast<std::size_t>(r.owner)];
      if (g.cfg.kind == GuestKind::SyncPeriodic) {
        const Ns next = std::max(g.next_due, now_);
        const int gi = r.owner;
        if (next < g.cfg.end) schedule(next, [this, gi] { guest_issue(gi); });
      }
      break;
    }
    case ReqKind::Copy: {
      Job& j = *jobs_[static_cast<std::size_t>(r.owner)];
      j.outstanding.erase(r.id);
      j.inflight -= r.bytes;
      j.drained_since_tick += r.bytes;
      j.stats.drained_total += r.bytes;
      j.stats.drained.emplace_back(now_, j.stats.drained_total);
      j.stats.last_completion = now_;
      if (j.ctl && !j.cancelled && j.cfg.copy_latency_visible) {
        std::uniform_real_distribution<double> u(0, 1);
        if (!(j.cfg.sample_loss > 0 && u(rng_) < j.cfg.sample_loss))
          j.copy_inbox.push_back({Duration(now_ - r.submit), r.bytes});
      }
      // Its time at storage: from its submission, or from the completion of the copy's request
      // before it if that came later (it waited behind the copy's own), to its completion.
      if (j.ctl && !j.cancelled && j.cfg.own_queue_visible)
        j.service_inbox.push_back({Duration(now_ - std::max(r.submit, j.prev_completion)), r.bytes});
      j.prev_completion = now_;
      if (j.stats.drained_total >= j.cfg.total_bytes) {
        j.finished = true;
        j.stats.finished_at = now_;
      }
      note_backlog();
      job_try_issue(r.owner);
      break;
    }
    case ReqKind::Writeback: {
      const auto o = static_cast<std::size_t>(r.owner);
      writeback_[o] -= r.bytes;
      wb_total_ -= r.bytes;
      Job& j = *jobs_[o];
      j.drained_since_tick += r.bytes;
      j.stats.drained_total += r.bytes;
      j.stats.drained.emplace_back(now_, j.stats.drained_total);
      j.stats.last_completion = now_;
      if (j.stats.drained_total >= j.cfg.total_bytes) {
        j.finished = true;
        j.stats.finished_at = now_;
      }
      cache_pump();
      note_backlog();
      for (std::size_t i = 0; i < jobs_.size(); ++i) job_try_issue(static_cast<int>(i));
      break;
    }
    case ReqKind::Probe: {
      Job& j = *jobs_[static_cast<std::size_t>(r.owner)];
      const Duration lat = j.probe->completed(j.host_time(now_));
      ++j.stats.probes;
      j.stats.probe_bytes += r.bytes;
      if (job_active(j)) j.probe_inbox.push_back(lat);
      probe_schedule(r.owner);
      break;
    }
  }
}

// ---- shared-queue probe ----------------------------------------------------------------------
bool Simulator::job_active(const Job& j) const {
  return j.started && !j.cancelled && !j.finished;
}

void Simulator::probe_schedule(int ji) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  if (!j.probe || !job_active(j)) return;
  const std::optional<Duration> wait =
      j.probe->until_next(j.host_time(now_), j.decision.drain_estimate_bytes_per_s);
  if (!wait) return;
  schedule(now_ + wait->count(), [this, ji] { probe_issue(ji); });
}

void Simulator::probe_issue(int ji) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  if (!job_active(j)) return;
  j.probe->started(j.host_time(now_));
  Req r;
  r.kind = ReqKind::Probe;
  r.owner = ji;
  r.bytes = j.probe->config().bytes;
  submit(r);
}

// ---- page cache ------------------------------------------------------------------------------
void Simulator::cache_pump() {
  while (wb_total_ < cache_.writeback_inflight_max) {
    int owner = -1;
    for (std::size_t i = 0; i < jobs_.size(); ++i)
      if (kicked_[i] > 0 && dirty_[i] > 0) { owner = static_cast<int>(i); break; }
    // Background writeback starts above the background threshold and, like the kernel's
    // flusher, keeps going (in large batches) until well below it.
    if (dirty_total_ > cache_.background_bytes) bg_active_ = true;
    if (dirty_total_ < cache_.background_bytes / 2) bg_active_ = false;
    if (owner < 0 && bg_active_) {
      std::uint64_t best = 0;
      for (std::size_t i = 0; i < jobs_.size(); ++i)
        if (dirty_[i] > best) { best = dirty_[i]; owner = static_cast<int>(i); }
    }
    if (owner < 0) return;
    const auto o = static_cast<std::size_t>(owner);
    const std::uint64_t n = std::min(cache_.writeback_io, dirty_[o]);
    dirty_[o] -= n;
    dirty_total_ -= n;
    kicked_[o] -= std::min(kicked_[o], n);
    writeback_[o] += n;
    wb_total_ += n;
    Req r;
    r.kind = ReqKind::Writeback;
    r.owner = owner;
    r.bytes = n;
    submit(r);
  }
}

// ---- guests ----------------------------------------------------------------------------------
int Simulator::add_guest(const GuestConfig& g) {
  guests_.push_back(std::make_unique<Guest>(Guest{g, g.start}));
  const int gi = static_cast<int>(guests_.size() - 1);
  schedule(g.start, [this, gi] { guest_issue(gi); });
  return gi;
}

void Simulator::guest_issue(int gi) {
  Guest& g = *guests_[static_cast<std::size_t>(gi)];
  if (now_ >= g.cfg.end) return;
  Req r;
  r.kind = ReqKind::Guest;
  r.owner = gi;
  r.bytes = g.cfg.io_bytes;
  switch (g.cfg.kind) {
    case GuestKind::SyncPeriodic:
      g.next_due = now_ + g.cfg.interval;
      submit(r);
      break;
    case GuestKind::OpenLoop: {
      submit(r);
      const Ns gap = static_cast<Ns>(static_cast<double>(g.cfg.io_bytes) / g.cfg.rate * kSec);
      schedule(now_ + std::max<Ns>(gap, 1), [this, gi] { guest_issue(gi); });
      break;
    }
    case GuestKind::Burst:
      for (int i = 0; i < g.cfg.burst_count; ++i) submit(r);
      schedule(now_ + g.cfg.interval, [this, gi] { guest_issue(gi); });
      break;
  }
}

double Simulator::guest_throughput(Ns a, Ns b) const {
  double bytes = 0;
  for (const auto& s : guest_samples_)
    if (s.complete >= a && s.complete < b) bytes += static_cast<double>(s.bytes);
  return b > a ? bytes / (static_cast<double>(b - a) / kSec) : 0;
}

// ---- copy jobs -------------------------------------------------------------------------------
int Simulator::add_job(const JobConfig& cfg) {
  auto j = std::make_unique<Job>();
  j->cfg = cfg;
  j->index = static_cast<int>(jobs_.size());
  const std::uint64_t burst = std::max<std::uint64_t>(cfg.max_io, kDefaultBurstBytes);
  switch (cfg.policy) {
    case PolicyKind::Controller:
      j->ctl.emplace(cfg.controller);
      if (cfg.probe && cfg.probe->enabled) j->probe.emplace(*cfg.probe);
      j->pacer = Pacer(cfg.controller.initial_rate_bytes_per_s, burst);
      break;
    case PolicyKind::FixedRate:
      j->pacer = Pacer(cfg.fixed_rate, burst);
      j->decision.window_bytes = cfg.fixed_max_inflight;
      j->decision.rate_bytes_per_s = cfg.fixed_rate;
      break;
    case PolicyKind::Unlimited:
      j->pacer = Pacer(kUnlimitedRate, burst);
      j->decision.window_bytes = cfg.fixed_max_inflight;
      j->decision.rate_bytes_per_s = kUnlimitedRate;
      break;
  }
  jobs_.push_back(std::move(j));
  dirty_.push_back(0);
  writeback_.push_back(0);
  kicked_.push_back(0);
  const int ji = static_cast<int>(jobs_.size() - 1);
  schedule(cfg.start, [this, ji] {
    Job& job = *jobs_[static_cast<std::size_t>(ji)];
    job.started = true;
    if (job.ctl) job_tick(ji);
    else job_try_issue(ji);
    probe_schedule(ji);
  });
  if (cfg.cancel_at) {
    schedule(*cfg.cancel_at, [this, ji] { jobs_[static_cast<std::size_t>(ji)]->cancelled = true; });
  }
  return ji;
}

const JobStats& Simulator::job(int i) const { return jobs_.at(static_cast<std::size_t>(i))->stats; }

std::uint64_t Simulator::job_backlog(const Job& j) const {
  const auto k = static_cast<std::size_t>(j.index);
  return j.inflight + dirty_[k] + writeback_[k];
}

void Simulator::note_backlog() {
  std::uint64_t total = 0;
  for (auto& j : jobs_) {
    const std::uint64_t b = job_backlog(*j);
    j->stats.max_backlog = std::max(j->stats.max_backlog, b);
    if (j->ctl) total += b;
  }
  max_total_backlog_ = std::max(max_total_backlog_, total);
}

void Simulator::job_tick(int ji) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  if (j.cancelled || j.finished) return;
  std::uniform_real_distribution<double> u(0, 1);
  const bool deliver = !(j.cfg.tick_loss > 0 && u(rng_) < j.cfg.tick_loss);
  if (!deliver) {
    j.fg_inbox.clear();
    j.copy_inbox.clear();
  }
  if (!deliver) j.probe_inbox.clear();
  TickInput in;
  in.now = j.host_time(now_);
  in.foreground_latencies = j.fg_inbox;
  in.copy_samples = j.copy_inbox;
  in.probe_latencies = j.probe_inbox;
  if (j.probe) in.probe_outstanding = j.probe->outstanding_age(in.now);
  if (j.cfg.wall_clock_error) in.wall_clock = Duration(now_ + *j.cfg.wall_clock_error);
  // Only the guests of the job's own host: requests are in submission order, the first is the
  // oldest.
  for (const auto& [id, o] : guest_outstanding_) {
    if (o.host != j.cfg.host) continue;
    if (!in.foreground_oldest_outstanding)
      in.foreground_oldest_outstanding = Duration(now_ - o.submit);
    ++in.foreground_outstanding;
  }
  if (j.cfg.idle_signal && in.foreground_outstanding == 0) {
    const auto last = host_last_completion_.find(j.cfg.host);
    in.foreground_idle =
        last == host_last_completion_.end() || now_ - last->second >= kHostIdleAfter;
  }
  if (!j.outstanding.empty() && j.cfg.copy_latency_visible)
    in.copy_oldest_outstanding = Duration(now_ - j.outstanding.begin()->second);
  in.backlog_bytes = j.cfg.request_bytes > 0 ? 0 : job_backlog(j);
  in.drained_bytes = j.drained_since_tick;
  if (j.cfg.own_queue_visible) {
    in.own_queue_bytes = j.inflight + writeback_[static_cast<std::size_t>(j.index)];
    in.own_service_samples = j.service_inbox;
    // The largest request of each guest of the job's host (a write+fsync is one request here).
    std::uint64_t guests = 0;
    for (const auto& g : guests_)
      if (g->cfg.host == j.cfg.host && g->cfg.start <= now_ && now_ < g->cfg.end) guests += g->cfg.io_bytes;
    in.foreground_own_bytes = guests;
  }
  j.decision = j.ctl->tick(in);
  j.stats.ticks.push_back({now_, j.decision, in.backlog_bytes,
                           !in.foreground_latencies.empty() || !in.copy_samples.empty() ||
                               !in.probe_latencies.empty()});
  j.fg_inbox.clear();
  j.copy_inbox.clear();
  j.service_inbox.clear();
  j.probe_inbox.clear();
  j.drained_since_tick = 0;
  j.pacer.set_rate(tp(now_), j.decision.rate_bytes_per_s);
  Ns next = now_ + j.decision.next_tick.count();
  if (j.cfg.tick_jitter_max > 0) {
    std::uniform_int_distribution<Ns> jit(0, j.cfg.tick_jitter_max);
    next += jit(rng_);
  }
  schedule(next, [this, ji] { job_tick(ji); });
  job_try_issue(ji);
}

void Simulator::job_try_issue(int ji) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  if (j.cfg.request_bytes > 0) {
    job_issue_requests(ji);
    return;
  }
  for (;;) {
    if (!j.started || j.cancelled || j.finished || j.waiting_pacer || j.decision.paused) return;
    if (j.submitted >= j.cfg.total_bytes) return;
    std::uint64_t io = j.cfg.max_io;
    if (j.ctl) io = std::clamp<std::uint64_t>(j.decision.window_bytes / kIosPerWindow, kMinCopyIo, j.cfg.max_io);
    io = std::min(io, j.cfg.total_bytes - j.submitted);
    // The controller bounds everything the copy has queued (in flight + dirty + writeback);
    // the fixed/unlimited baselines only see their own in-flight requests (like QEMU).
    // An I/O is trimmed (4 KiB granularity) to what the window still allows.
    const std::uint64_t backlog = j.ctl ? job_backlog(j) : j.inflight;
    const std::uint64_t window = std::max<std::uint64_t>(j.decision.window_bytes, kPageBytes);
    if (backlog + kPageBytes > window) return;
    io = std::min(io, (window - backlog) / kPageBytes * kPageBytes);
    if (j.cfg.buffered && dirty_total_ + wb_total_ + io > cache_.dirty_limit) return;  // balance_dirty_pages
    const Duration wait = j.pacer.reserve(tp(now_), io);
    if (wait > Duration::zero()) {
      j.waiting_pacer = true;
      schedule(now_ + wait.count(), [this, ji, io] {
        Job& jj = *jobs_[static_cast<std::size_t>(ji)];
        jj.waiting_pacer = false;
        if (!jj.cancelled && !jj.finished && !jj.decision.paused) job_submit(ji, io);
        job_try_issue(ji);
      });
      return;
    }
    job_submit(ji, io);
  }
}

// QEMU's mirror paced by its speed: whole requests while the job is within the quota of its
// 100 ms slices (what went out beyond it is owed by the next slices), at most
// fixed_max_inflight bytes in flight; a completion or the next slice tries again.
void Simulator::job_issue_requests(int ji) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  while (j.started && !j.cancelled && !j.finished && !j.waiting_pacer && !j.decision.paused &&
         j.submitted < j.cfg.total_bytes) {
    if (j.inflight + j.cfg.request_bytes > j.cfg.fixed_max_inflight) return;
    const double quota = j.decision.rate_bytes_per_s * static_cast<double>(j.cfg.rate_slice) / kSec;
    if (now_ >= j.slice_end) {
      const Ns slices = 1 + (now_ - j.slice_end) / j.cfg.rate_slice;
      j.slice_debt = std::max(0.0, j.slice_debt - quota * static_cast<double>(slices));
      j.slice_end += slices * j.cfg.rate_slice;
    }
    if (j.slice_debt >= quota) {
      j.waiting_pacer = true;
      schedule(j.slice_end, [this, ji] {
        jobs_[static_cast<std::size_t>(ji)]->waiting_pacer = false;
        job_try_issue(ji);
      });
      return;
    }
    j.slice_debt += static_cast<double>(j.cfg.request_bytes);
    job_submit(ji, j.cfg.request_bytes);
  }
}

void Simulator::job_submit(int ji, std::uint64_t bytes) {
  Job& j = *jobs_[static_cast<std::size_t>(ji)];
  bytes = std::min(bytes, j.cfg.total_bytes - j.submitted);
  if (bytes == 0) return;
  j.submitted += bytes;
  j.inflight += bytes;
  j.stats.submits.push_back(now_);
  if (!j.cfg.buffered) {
    Req r;
    r.kind = ReqKind::Copy;
    r.owner = ji;
    r.bytes = bytes;
    submit(r);
  } else {
    j.memcpy_free_at = std::max(j.memcpy_free_at, now_) +
                       static_cast<Ns>(static_cast<double>(bytes) / cache_.memcpy_rate * kSec);
    schedule(j.memcpy_free_at, [this, ji, bytes] {
      Job& jj = *jobs_[static_cast<std::size_t>(ji)];
      const auto o = static_cast<std::size_t>(ji);
      jj.inflight -= bytes;
      dirty_[o] += bytes;
      dirty_total_ += bytes;
      if (jj.ctl) kicked_[o] += bytes;  // sync_file_range(SYNC_FILE_RANGE_WRITE) right away
      // The last write is followed by fsync(target) (QEMU's mirror flushes at completion).
      if (jj.submitted >= jj.cfg.total_bytes && jj.inflight == 0) kicked_[o] = dirty_[o];
      cache_pump();
      note_backlog();
      job_try_issue(ji);
    });
  }
  note_backlog();
}

// ---- scheduled storage changes ---------------------------------------------------------------
void Simulator::at_capacity(Ns t, double bandwidth) {
  schedule(t, [this, bandwidth] {
    server_advance();
    bandwidth_ = bandwidth;
    server_reschedule();
  });
}

void Simulator::at_base_latency(Ns t, Ns base_latency) {
  schedule(t, [this, base_latency] { base_latency_ = base_latency; });
}

void Simulator::stall(Ns from, Ns to) {
  schedule(from, [this] {
    server_advance();
    stalled_ = true;
    server_reschedule();
  });
  schedule(to, [this] {
    server_advance();
    stalled_ = false;
    server_reschedule();
  });
}

bool Simulator::all_jobs_done() const {
  for (const auto& j : jobs_)
    if (!(j->finished || (j->cancelled && j->inflight == 0 && j->outstanding.empty()))) return false;
  return !jobs_.empty();
}

void Simulator::run(Ns until) {
  while (!events_.empty()) {
    if (events_.top().t > until) break;
    Event e = events_.top();
    events_.pop();
    now_ = e.t;
    e.fn();
    if (all_jobs_done()) break;
  }
  if (now_ < until && events_.empty()) now_ = until;
}

}  // namespace qcommit::throttle::sim
