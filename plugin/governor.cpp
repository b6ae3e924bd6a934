#include "plugin/governor.h"

#include <algorithm>
#include <limits>
#include <cmath>

#include "plugin/cotenants.h"

namespace qcommit::plugin {

const char* to_string(JobType t) {
  switch (t) {
    case JobType::Pull: return "pull";
    case JobType::Copy: return "copy";
    case JobType::Commit: return "commit";
    case JobType::ActiveCommit: return "active-commit";
    case JobType::Backup: return "backup";
    case JobType::Unknown: break;
  }
  return "unknown";
}

const char* to_string(JobEventKind k) {
  switch (k) {
    case JobEventKind::StatusChange: return "status-change";
    case JobEventKind::Completed: return "completed";
    case JobEventKind::Failed: return "failed";
    case JobEventKind::Canceled: return "canceled";
    case JobEventKind::Ready: return "ready";
  }
  return "unknown";
}

std::optional<std::string> GovernorOptions::validate() const {
  if (tick <= Duration::zero()) return "governor tick must be > 0";
  if (pace <= Duration::zero() || pace > tick) return "governor pace interval must be in (0, tick]";
  if (poll <= Duration::zero() || poll > std::chrono::milliseconds(500))
    return "governor poll interval must be in (0, 500ms] (jobs are discovered within 0.5 s)";
  if (reconnect_min <= Duration::zero() || reconnect_max < reconnect_min)
    return "governor reconnect intervals: need 0 < min <= max";
  if (min_speed_bytes_per_s == 0) return "minimum job speed must be > 0 (0 is unlimited in QEMU)";
  if (settle_every < Duration::zero() || settle_max_hold <= Duration::zero())
    return "governor settle interval must be >= 0 (0: off) and its hold > 0";
  if (auto e = chunk_gate_config.validate()) return "chunk gate: " + *e;
  return writeback.validate();
}

Duration settle_interval_for(std::optional<std::chrono::milliseconds> expire) {
  constexpr Duration kMax = std::chrono::seconds(10), kMin = std::chrono::seconds(1);
  if (!expire || *expire <= std::chrono::milliseconds::zero()) return kMax;
  return std::clamp<Duration>(*expire / 3, kMin, kMax);
}

namespace {

bool governed(JobType t) {
  return t == JobType::Commit || t == JobType::ActiveCommit || t == JobType::Pull ||
         t == JobType::Copy;
}

// QEMU's mirror job (active commit, copy): 16 x 1 MiB bursts, ready when it has caught up.
bool mirror(JobType t) { return t == JobType::ActiveCommit || t == JobType::Copy; }

}  // namespace

struct Governor::Job {
  Job(DiskKey k, const Policy& p, JobType t, const std::string& cache)
      : key(std::move(k)),
        type(t),
        policy(p),
        ctl(controller_config(p, t, cache)),
        direct_io(direct_cache(cache)) {}
  // cache=none/directsync: the job's writes bypass the page cache.
  static bool direct_cache(const std::string& cache) {
    return cache == "none" || cache == "directsync";
  }
  // QEMU's commit and stream jobs write 512 KiB at a time (COMMIT_BUFFER_SIZE, STREAM_CHUNK);
  // with cache=none/directsync those writes reach the storage as they are.
  static bool direct_chunks(JobType t, const std::string& cache) {
    return direct_cache(cache) && (t == JobType::Commit || t == JobType::Pull);
  }
  static throttle::ControllerConfig controller_config(const Policy& p, JobType t,
                                                      const std::string& cache) {
    throttle::ControllerConfig c = p.controller_config();
    if (direct_chunks(t, cache)) c.copy_request_bytes = kQemuChunkBytes;
    return c;
  }
  DiskKey key;
  JobType type = JobType::Unknown;
  std::string target;
  std::string storage;
  std::string pool;
  Policy policy;
  std::string policy_error;
  throttle::Controller ctl;
  std::unique_ptr<TargetFile> file;
  WritebackPlanner planner;
  JobInfo info{};
  bool has_info = false;
  std::uint64_t backlog = 0;
  std::uint64_t speed_set = 0;  // gated: the paced rate (the gate alternates two speeds)
  // Chunk gate (direct_chunks jobs): the rate it spaces the chunks for and whether it may open.
  std::optional<throttle::ChunkGate> gate;
  double gate_rate = 0;
  bool gate_allowed = true;
  // The pacer's view of the target's page cache: last whole-file reading, when, and bytes
  // issued since; the ranges it issued (re-read between whole-file readings) and what was under
  // writeback outside them at the last whole-file reading (the kernel's own writeback).
  std::optional<PageCacheState> pace_pc;
  std::optional<TimePoint> pace_pc_at;
  std::uint64_t issued_since_pc = 0;
  IssuedRanges issued;
  std::uint64_t writeback_elsewhere = 0;
  bool ranges_readable = true;  // false: cachestat of a range failed, count issued bytes instead
  // Settling (see GovernorOptions::settle_every): dirty without a settle since, holding since,
  // fdatasync started.
  std::optional<TimePoint> dirty_since;
  std::optional<TimePoint> hold_since;
  bool settle_started = false;
  std::uint32_t settles = 0;
  // Without per-file page-cache counts (no cachestat): fdatasyncs of the target while the job
  // copies; the job's progress at the last tick and whether it moved in it, the progress (as of
  // the last tick) when the running sync started and when the last completed one did.
  bool direct_io;  // direct_cache(): its writes bypass the page cache
  std::optional<std::uint64_t> tick_cur;
  bool tick_progressed = false;
  std::optional<std::uint64_t> sync_start_cur;
  std::optional<std::uint64_t> synced_cur;
  std::optional<TimePoint> sync_started_at;
  void reset_sync() {
    tick_cur.reset();
    tick_progressed = false;
    sync_start_cur.reset();
    synced_cur.reset();
  }

  // Whole-file reading (cachestat over the target: CPU in proportion to its cached pages).
  void read_page_cache(TimePoint now) {
    pace_pc = file->page_cache();
    pace_pc_at = now;
    issued_since_pc = 0;
    writeback_elsewhere = 0;
    if (!pace_pc || !pace_pc->per_file) {
      issued.clear();
      return;
    }
    const std::optional<std::uint64_t> ours = issued_writeback();
    ranges_readable = ours.has_value();
    if (!ours) issued.clear();
    writeback_elsewhere = pace_pc->writeback_bytes - std::min(pace_pc->writeback_bytes, ours.value_or(0));
  }
  // What is under writeback in the ranges the pacer issued (cachestat of each).
  // Ranges whose writeback completed and that stayed clean leave the page cache.
  std::optional<std::uint64_t> issued_writeback() {
    std::vector<ByteRange> clean;
    const std::optional<std::uint64_t> wb =
        issued.under_writeback([this](const ByteRange& r) { return file->page_cache_in(r); }, &clean);
    for (const ByteRange& r : clean) file->drop_cached(r);
    return wb;
  }
  std::optional<throttle::Decision> decision;
  std::deque<std::pair<TimePoint, Duration>> latencies;
  std::deque<std::pair<TimePoint, std::uint64_t>> progress;
  bool ready = false;
  bool seen_in_poll = true;
  double drain_credit = 0;  // bytes of progress not yet reported to the controller
  std::optional<TimePoint> last_tick;
};

Governor::Governor(Hypervisor& hv, TargetFiles& files, DaemonConfig cfg, GovernorOptions opt)
    : hv_(hv), files_(files), cfg_(std::move(cfg)), opt_(opt), reconnect_backoff_(opt.reconnect_min) {
  hv_.set_event_sink([this](const JobEvent& e) { pending_events_.push_back(e); });
}

Governor::~Governor() { hv_.set_event_sink(nullptr); }

TimePoint Governor::step(TimePoint now) {
  if (connected_ && !hv_.connected()) lost_connection(now);
  if (!connected_) {
    if (now >= next_reconnect_) {
      if (hv_.connect()) {
        connected_ = true;
        was_ever_connected_ = true;
        reconnect_backoff_ = opt_.reconnect_min;
        next_poll_ = now;  // adopt running jobs right away
      } else {
        next_reconnect_ = now + reconnect_backoff_;
        reconnect_backoff_ = std::min(reconnect_backoff_ * 2, opt_.reconnect_max);
      }
    }
    if (!connected_) return next_reconnect_;
  }
  try {
    handle_events(now);
    // Chunk gates first: one the previous step opened closes now, before this step's hypervisor
    // round trips (poll and tick: tens of ms on a busy host) would hold it open for more than
    // one chunk; and while a gate is open nothing else runs (it closes at the next pace).
    const bool pace_due = !next_pace_ || now >= *next_pace_;
    if (pace_due) pace_gates(now);
    if (!next_pace_) next_pace_ = now;
    if (!next_poll_) next_poll_ = now;
    if (!next_tick_) next_tick_ = now;
    if (std::any_of(jobs_.begin(), jobs_.end(),
                    [](const auto& kj) { return kj.second->gate && kj.second->gate->is_open(); })) {
      if (pace_due)
        next_pace_ = now + opt_.pace;  // a step between two paces keeps the close's time
      return *next_pace_;
    }
    if (!scan_domains_.empty()) {
      std::set<std::string> only;
      only.swap(scan_domains_);
      poll(now, &only);
    }
    if (now >= *next_poll_) {
      poll(now, nullptr);
      next_poll_ = now + opt_.poll;
    }
    if (now >= *next_tick_) {
      tick(now);
      next_tick_ = now + opt_.tick;
    }
    if (pace_due) {
      pace(now);  // writeback (after the tick, which has just read the page cache)
      next_pace_ = now + opt_.pace;
    }
  } catch (const HypervisorDisconnected&) {
    lost_connection(now);
    return next_reconnect_;
  }
  return std::min({*next_poll_, *next_tick_, *next_pace_});
}

void Governor::lost_connection(TimePoint now) {
  connected_ = false;
  guests_.clear();
  pool_cache_.clear();
  domains_.clear();
  pending_events_.clear();
  scan_domains_.clear();
  next_poll_.reset();
  next_tick_.reset();
  next_pace_.reset();
  for (auto& [k, j] : jobs_) {
    j->has_info = false;  // progress baseline restarts after the reconnect
    j->drain_credit = 0;
    j->last_tick.reset();
    j->seen_in_poll = false;
    j->reset_sync();  // it may be another job when we are back
  }
  next_reconnect_ = now;  // first retry immediately, then back off
}

void Governor::handle_events(TimePoint now) {
  std::vector<JobEvent> events;
  events.swap(pending_events_);
  for (const auto& e : events) {
    if (e.kind == JobEventKind::StatusChange) {
      scan_domains_.insert(e.domain);
      continue;
    }
    // BLOCK_JOB_2 names the disk by target; accept a source path too.
    auto it = jobs_.find(DiskKey{e.domain, e.disk});
    if (it == jobs_.end()) {
      for (const auto& d : domains_) {
        if (d.name != e.domain) continue;
        for (const auto& disk : d.disks)
          if (disk.source == e.disk) it = jobs_.find(DiskKey{e.domain, disk.target});
      }
    }
    if (it == jobs_.end()) continue;
    switch (e.kind) {
      case JobEventKind::Ready: it->second->ready = true; break;
      case JobEventKind::Completed: release(it->first, "completed", now); break;
      case JobEventKind::Canceled: release(it->first, "canceled", now); break;
      case JobEventKind::Failed:
        release(it->first,
                it->second->ready ? "failed after ready (pivot failed)" : "failed", now);
        break;
      case JobEventKind::StatusChange: break;
    }
  }
}

std::optional<PoolInfo> Governor::resolve_pool(const std::string& path) {
  if (auto it = pool_cache_.find(path); it != pool_cache_.end()) return it->second;
  std::optional<PoolInfo> found = pool_holding(hv_, pools_, path);
  pool_cache_.emplace(path, found);
  return found;
}

std::string Governor::storage_key(const std::string& path, std::optional<std::uint64_t> dev,
                                  std::optional<PoolInfo>* pool_out) {
  std::optional<PoolInfo> pool = resolve_pool(path);
  if (pool_out) *pool_out = pool;
  if (pool) return "pool:" + (pool->uuid.empty() ? pool->name : pool->uuid);
  if (dev) return "dev:" + std::to_string(*dev);
  return "path:" + path;
}

void Governor::poll(TimePoint now, const std::set<std::string>* only) {
  std::vector<DomainInfo> doms = hv_.running_domains();
  if (!only) pools_ = hv_.pools();
  std::set<DiskKey> listed;
  for (const auto& dom : doms) {
    if (only && !only->count(dom.name)) continue;
    for (const auto& disk : dom.disks) {
      if (opt_.only_disk &&
          (opt_.only_disk->first != dom.name || opt_.only_disk->second != disk.target))
        continue;
      std::optional<JobInfo> info = hv_.job_info(dom.name, disk.target);
      if (!info || !governed(info->type)) continue;
      DiskKey k{dom.name, disk.target};
      listed.insert(k);
      if (auto it = jobs_.find(k); it != jobs_.end()) {
        it->second->seen_in_poll = true;
      } else {
        adopt(dom, disk, *info, now);
      }
    }
  }
  // Jobs that are no longer listed in the scanned domains ended without an event we saw.
  std::vector<DiskKey> gone;
  for (const auto& [k, j] : jobs_) {
    if (only && !only->count(k.domain)) continue;
    if (!listed.count(k)) gone.push_back(k);
  }
  for (const auto& k : gone) {
    release(k, jobs_[k]->seen_in_poll ? "no longer listed" : "ended while disconnected", now);
  }
  if (only) {
    for (auto& d : doms) {
      if (!only->count(d.name)) continue;
      auto it = std::find_if(domains_.begin(), domains_.end(),
                             [&](const DomainInfo& x) { return x.name == d.name; });
      if (it == domains_.end()) domains_.push_back(d);
      else *it = d;
    }
    // Scanned domains that are no longer running (stopped since): forget them.
    std::erase_if(domains_, [&](const DomainInfo& x) {
      return only->count(x.name) &&
             std::none_of(doms.begin(), doms.end(), [&](const DomainInfo& d) { return d.name == x.name; });
    });
  } else {
    domains_ = std::move(doms);
  }
}

void Governor::domain_event(const std::string& domain, const std::string& event) {
  (void)event;  // every lifecycle change means the same: look at this domain now
  // Its counters restart with a new QEMU process: no delta across the change.
  std::erase_if(guests_, [&](const auto& kv) { return kv.first.domain == domain; });
  if (connected_) scan_domains_.insert(domain);
}

void Governor::adopt(const DomainInfo& dom, const DiskInfo& disk, const JobInfo& info,
                     TimePoint now) {
  DiskKey k{dom.name, disk.target};
  std::string target;
  if (disk.mirror) target = *disk.mirror;
  else if (info.type == JobType::Commit && !disk.backing_chain.empty())
    // libvirt names no base for a non-active commit (`--base` may be an intermediate image);
    // the bottom image is the guess when the host cannot tell.
    target =
        files_.commit_base(disk.source, disk.backing_chain).value_or(disk.backing_chain.back());
  else if (info.type == JobType::ActiveCommit && !disk.backing_chain.empty())
    target = disk.backing_chain.back();
  else if (info.type == JobType::Pull) target = disk.source;

  std::unique_ptr<TargetFile> file = target.empty() ? nullptr : files_.open(target);
  std::optional<PoolInfo> pool;
  std::string storage =
      target.empty() ? storage_key(disk.source, disk.device, &pool)
                     : storage_key(target, file ? file->device() : std::nullopt, &pool);
  // The same order as an offline merge's (qcommit merge): domain metadata, pool, [default].
  PolicyQuery query;
  if (pool) {
    query.pool_name = pool->name;
    query.pool_uuid = pool->uuid;
  }
  query.domain_policy_xml = dom.policy_xml;
  const PolicyResolution resolved = resolve_policy(cfg_, query);
  const Policy policy = resolved.policy;
  const std::string policy_error = resolved.metadata_error.value_or("");
  auto j = std::make_unique<Job>(k, policy, info.type, disk.cache);
  j->target = target;
  j->storage = storage;
  j->pool = pool ? pool->name : "";
  j->policy_error = policy_error;
  j->file = std::move(file);
  j->planner = WritebackPlanner(opt_.writeback);
  j->info = info;
  j->has_info = false;
  (void)now;
  Job& ref = *j;
  jobs_.emplace(k, std::move(j));
  // Start slowly right away: an unlimited job (speed 0) fills the page cache within a tick.
  const double initial = ref.ctl.config().initial_rate_bytes_per_s;
  const std::optional<std::uint64_t> qemu = hv_.qemu_version();
  if (opt_.chunk_gate && Job::direct_chunks(info.type, disk.cache) && qemu &&
      *qemu < kChunkGateBeforeQemuVersion) {
    ref.gate.emplace(opt_.chunk_gate_config);
    ref.gate_rate = initial;
    set_gate_speed(ref, false);
  } else {
    set_speed(ref, static_cast<std::uint64_t>(initial));
  }
}

void Governor::release(const DiskKey& k, const std::string& reason, TimePoint now) {
  auto it = jobs_.find(k);
  if (it == jobs_.end()) return;
  released_.push_front(ReleasedJob{k.domain, k.disk, it->second->type, reason, now});
  while (released_.size() > kMaxReleasedHistory) released_.pop_back();
  jobs_.erase(it);
}

void Governor::set_speed(Job& j, std::uint64_t speed) {
  speed = std::max(speed, opt_.min_speed_bytes_per_s);  // never 0 (unlimited)
  if (hv_.set_job_speed(j.key.domain, j.key.disk, speed)) j.speed_set = speed;
}

void Governor::set_gate_speed(Job& j, bool open) {
  // Not allowed (paused, held): the floor, as for an ungated job.
  const auto closed = j.gate_allowed
                          ? static_cast<std::uint64_t>(j.gate_rate * kChunkGateClosedRateFraction)
                          : opt_.min_speed_bytes_per_s;
  if (hv_.set_job_speed(
          j.key.domain, j.key.disk,
          open ? kChunkGateOpenSpeedBytesPerS : std::max(closed, opt_.min_speed_bytes_per_s)))
    j.speed_set = std::max(static_cast<std::uint64_t>(j.gate_rate), opt_.min_speed_bytes_per_s);
}

void Governor::tick(TimePoint now) {
  if (jobs_.empty()) return;
  // Foreground signals, per storage key, from every running domain's disks.
  std::set<std::string> wanted;
  for (const auto& [k, j] : jobs_) wanted.insert(j->storage);
  std::map<std::string, throttle::ForegroundSignals> sig;
  // Storage not idle: a guest disk on it was active within kIdleStorageAfter, or its activity is
  // not known this tick.
  std::set<std::string> not_idle;
  for (const auto& dom : domains_) {
    for (const auto& disk : dom.disks) {
      const std::string key = storage_key(disk.source, disk.device, nullptr);
      if (!wanted.count(key)) continue;
      std::optional<BlockStats> st = hv_.block_stats(dom.name, disk.target);
      if (!st) {
        not_idle.insert(key);
        continue;
      }
      throttle::IoCounterSampler& sampler = guests_[DiskKey{dom.name, disk.target}];
      if (!sampler.primed()) not_idle.insert(key);
      sampler.sample(now, *st, opt_.tick, sig[key]);
      if (!sampler.quiet_for(now, kIdleStorageAfter)) not_idle.insert(key);  // active lately
    }
  }
  std::vector<DiskKey> keys;
  for (const auto& [k, j] : jobs_) keys.push_back(k);
  for (const auto& k : keys) {
    auto it = jobs_.find(k);
    if (it == jobs_.end()) continue;
    Job& j = *it->second;
    std::optional<JobInfo> info = hv_.job_info(k.domain, k.disk);
    if (!info || !governed(info->type)) {
      release(k, "no longer listed", now);
      continue;
    }
    const throttle::ForegroundSignals& s = sig[j.storage];
    // Backlog: the target's dirty + writeback pages.
    std::optional<PageCacheState> pc;
    if (j.file) {
      j.read_page_cache(now);  // the pacer works from this reading until the next one
      pc = j.pace_pc;
    }
    // Without per-file counts the reading is host-wide: other writers' pages too.  A job whose
    // writes bypass the page cache has none of them.  Another job's own pages are at most what
    // it copied since the start of the last completed fdatasync of its target (pace() runs them
    // while the job copies: everything dirtied before that start is on storage).  Progress is
    // only known per tick and a sync's start is stamped with the last tick's, so of this tick's
    // progress the count leaves out what the set speed allows in a tick (it went out with the
    // syncs of this tick unless storage held it up); beyond that (QEMU's bursts: a mirror
    // copies 16 MiB whatever its speed) it counts.
    std::uint64_t own_bound = std::numeric_limits<std::uint64_t>::max();  // no bound: per file
    if (pc && !pc->per_file) {
      if (j.tick_cur && info->cur < *j.tick_cur) j.reset_sync();  // a new job: start over
      const std::optional<std::uint64_t> before = j.tick_cur;
      j.tick_cur = info->cur;
      j.tick_progressed = before && info->cur > *before;
      if (j.direct_io) {
        own_bound = 0;
      } else if (j.synced_cur && before) {
        const std::uint64_t since = info->cur > *j.synced_cur ? info->cur - *j.synced_cur : 0;
        const std::uint64_t progressed = info->cur > *before ? info->cur - *before : 0;
        const auto allowed = static_cast<std::uint64_t>(
            static_cast<double>(j.speed_set) * std::chrono::duration<double>(opt_.tick).count());
        own_bound = since - std::min({since, progressed, allowed});
      }
    }
    const auto pace_production = static_cast<std::uint64_t>(
        static_cast<double>(j.speed_set) * std::chrono::duration<double>(opt_.pace).count());
    const std::uint64_t backlog = std::min(
        pc ? pc->writeback_bytes +
                 (pc->dirty_bytes > pace_production ? pc->dirty_bytes - pace_production : 0)
           : 0,
        own_bound);
    // QEMU reports progress in bursts (the mirror: 16 MiB at once, then it sleeps the burst off
    // at the set speed; commit.c counts unallocated stretches without copying).  Per tick that
    // looks like "idle" most of the time, so the controller would never see the job use its
    // allowance and never raise the rate (cache=none: stuck at the floor).  Bursts go into a
    // credit that is released at up to kDrainCreditRateFactor × the paced rate per tick.
    std::uint64_t drained = 0;
    if (j.has_info && info->cur >= j.info.cur) {
      const auto written = static_cast<std::int64_t>(info->cur - j.info.cur);
      const std::int64_t growth =
          static_cast<std::int64_t>(backlog) - static_cast<std::int64_t>(j.backlog);
      j.drain_credit += static_cast<double>(std::max<std::int64_t>(0, written - growth));
    }
    if (j.last_tick) {
      const double dt = std::chrono::duration<double>(now - *j.last_tick).count();
      const double rate = std::max({j.decision ? j.decision->rate_bytes_per_s : 0.0,
                                    static_cast<double>(j.speed_set),
                                    static_cast<double>(opt_.min_speed_bytes_per_s)});
      const double release = std::min(j.drain_credit, kDrainCreditRateFactor * rate * dt);
      drained = static_cast<std::uint64_t>(release);
      j.drain_credit = std::min(j.drain_credit - release,
                                rate * std::chrono::duration<double>(kMaxDrainCredit).count());
    }
    j.last_tick = now;
    throttle::TickInput in;
    in.now = now;
    in.foreground_latencies = s.latencies;
    in.foreground_outstanding = s.outstanding;
    in.foreground_oldest_outstanding = s.oldest_outstanding;
    in.foreground_idle = !not_idle.count(j.storage) && s.latencies.empty() && s.outstanding == 0;
    in.backlog_bytes = backlog;
    in.drained_bytes = drained;
    // While the job is held for a settle, its progress and backlog say nothing about the storage
    // (the hold made them): the controller is not fed and keeps its last decision.
    const bool holding = settle(j, pc, now);
    // After the hold, the controller's next interval starts now: taken from before the hold
    // with one tick's progress, it read as a collapsed drain rate (window at the minimum for
    // ~1.5 s after every settle in the lab).  What drained during the hold is not credited
    // to the ticks after it either.
    if (holding) {
      j.ctl.skip_until(now);
      j.drain_credit = 0;
    }
    const throttle::Decision d = holding && j.decision ? *j.decision : j.ctl.tick(in);
    j.decision = d;

    // Hold the job at the minimum while more is queued at storage than the window allows.  Dirty
    // pages the pacer has not pushed yet are not queued anywhere: up to one QEMU request burst of
    // them (kDirtyAllowanceBytes) lets the job copy its next burst while the pacer drains the
    // previous one, instead of idling the storage between bursts.
    // Near its end a mirror copies its last burst and then flushes BASE (before ready): all it
    // left dirty is written at once (lab: 160 ms ahead of the guest).  There the allowance is 0:
    // the job is held at the floor until the pacer has written out its dirty pages, and QEMU
    // sleeps off its last burst at the floor speed meanwhile; raising the speed wakes it.
    const bool mirror_unready = mirror(j.type) && !j.ready;
    const bool near_end =
        mirror_unready && info->end >= info->cur && info->end - info->cur <= kDirtyAllowanceBytes;
    const std::uint64_t allowance = near_end ? 0 : kDirtyAllowanceBytes;
    const std::uint64_t queued = std::min(
        pc ? pc->writeback_bytes + (pc->dirty_bytes > allowance ? pc->dirty_bytes - allowance : 0)
           : 0,
        own_bound);
    // Held: the job may not copy at all (the floor speed; a gated job's gate stays closed).
    const bool held = d.paused || queued > d.window_bytes || holding;
    std::uint64_t speed;
    if (held) {
      speed = opt_.min_speed_bytes_per_s;
    } else {
      const auto lo = static_cast<double>(opt_.min_speed_bytes_per_s);
      speed = static_cast<std::uint64_t>(std::llround(
          std::clamp(d.rate_bytes_per_s, lo, std::max(lo, j.policy.ceiling_bytes_per_s))));
    }
    // A mirror (active commit, copy) becomes ready only when nothing is left to copy; the
    // guest keeps dirtying clusters, and at a low speed the mirror sleeps off every small copy
    // and may never get there (seen in the lab: 1 byte left for minutes at the 1 MiB/s floor).
    // What is left is at most kMirrorConvergeBytes, so finishing it unpaced queues at most that.
    if (mirror_unready && info->end > info->cur && info->end - info->cur <= kMirrorConvergeBytes &&
        !held)
      speed = static_cast<std::uint64_t>(j.policy.ceiling_bytes_per_s);
    if (j.gate) {  // pace() opens and closes it
      const bool was_allowed = j.gate_allowed;
      j.gate_allowed = !held;
      j.gate_rate = static_cast<double>(speed);
      // Closed already: from now on at the floor (an open gate closes at the next pace).  And a
      // closed gate whose job still runs at the open speed (the close did not reach QEMU: a
      // refused call, a lost connection) is closed again.
      if (!j.gate->is_open() && ((was_allowed && !j.gate_allowed) ||
                                 info->bandwidth_bytes_per_s == kChunkGateOpenSpeedBytesPerS))
        set_gate_speed(j, false);
    }
    const double off = std::fabs(static_cast<double>(speed) - static_cast<double>(j.speed_set));
    if (!j.gate &&
        (j.speed_set == 0 || off > kSpeedChangeFraction * static_cast<double>(j.speed_set) ||
         info->bandwidth_bytes_per_s != j.speed_set ||
         (speed == opt_.min_speed_bytes_per_s && j.speed_set != speed))) {
      set_speed(j, speed);
    }

    for (Duration l : s.latencies) j.latencies.emplace_back(now, l);
    if (s.oldest_outstanding) j.latencies.emplace_back(now, *s.oldest_outstanding);
    while (!j.latencies.empty() &&
           (j.latencies.front().first < now - kLatencyHistory ||
            j.latencies.size() > kMaxLatencySamples))
      j.latencies.pop_front();
    j.progress.emplace_back(now, info->cur);
    while (!j.progress.empty() && j.progress.front().first < now - kEtaHistory)
      j.progress.pop_front();
    j.info = *info;
    j.has_info = true;
    j.backlog = backlog;
  }
}

bool Governor::settle(Job& j, const std::optional<PageCacheState>& pc, TimePoint now) {
  if (opt_.settle_every == Duration::zero() || !j.file || !pc || !pc->per_file) return false;
  if (!j.hold_since) {
    if (pc->dirty_bytes > 0 && !j.dirty_since) j.dirty_since = now;
    if (!j.dirty_since || now - *j.dirty_since < opt_.settle_every) return false;
    j.hold_since = now;
    j.settle_started = false;
  }
  if (!j.settle_started) {
    if (pc->dirty_bytes == 0 && j.file->start_settle()) {
      j.settle_started = true;
    } else if (now - *j.hold_since >= opt_.settle_max_hold) {
      j.hold_since.reset();  // the job kept dirtying (or storage is slow): retry later
      j.dirty_since = now;
      return false;
    }
    return true;
  }
  if (j.file->settling()) return true;
  j.hold_since.reset();
  j.settle_started = false;
  j.dirty_since.reset();
  ++j.settles;
  return false;
}

void Governor::pace_gates(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (!j->gate) continue;
    switch (j->gate->step(now, j->gate_rate, j->gate_allowed)) {
      case throttle::ChunkGate::Action::kOpen:
        set_gate_speed(*j, true);
        break;
      case throttle::ChunkGate::Action::kClose:
        set_gate_speed(*j, false);
        break;
      case throttle::ChunkGate::Action::kNone:
        break;
    }
  }
}

void Governor::pace(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (j->gate) continue;  // its writes bypass the page cache: nothing to push (pace_gates)
    if (!j->file || !j->decision) continue;
    bool fresh = false;
    if (!j->pace_pc_at || now - *j->pace_pc_at >= opt_.page_cache_refresh) {
      j->read_page_cache(now);
      fresh = true;
    }
    if (!j->pace_pc) continue;
    // Without per-file counts the pacer cannot find the job's dirty pages: fdatasyncs of the
    // whole target write them out (and tell tick how much of the job's output is on storage),
    // at most one per kFallbackSyncGap, while the job copies or until one has started after
    // its last progress.  (A sync of a clean file may still flush the disk's cache.)
    if (!j->pace_pc->per_file) {
      if (j->direct_io || !j->tick_cur) continue;
      if (j->sync_start_cur && !j->file->settling()) {
        j->synced_cur = j->sync_start_cur;
        j->sync_start_cur.reset();
      }
      const bool behind = !j->synced_cur || *j->synced_cur != *j->tick_cur;
      const bool due = !j->sync_started_at || now - *j->sync_started_at >= kFallbackSyncGap;
      if (!j->sync_start_cur && due && (j->tick_progressed || behind) && j->file->start_settle()) {
        j->sync_start_cur = j->tick_cur;
        j->sync_started_at = now;
      }
      continue;
    }
    PageCacheState pc = *j->pace_pc;
    // Between whole-file readings: what we issued is no longer dirty; what is under writeback is
    // the kernel's share from the last reading plus a fresh reading of the ranges we issued (few
    // and small: cheap) -- or, where ranges cannot be read, everything issued since.
    pc.dirty_bytes -= std::min(pc.dirty_bytes, j->issued_since_pc);
    if (!fresh) {  // a fresh reading has just read the ranges and issued nothing since
      std::optional<std::uint64_t> ours;
      if (pc.per_file && j->ranges_readable) {
        ours = j->issued_writeback();
        if (!ours) {
          j->ranges_readable = false;
          j->issued.clear();
        }
      }
      pc.writeback_bytes = ours ? j->writeback_elsewhere + *ours : pc.writeback_bytes + j->issued_since_pc;
    }
    if (pc.per_file && pc.dirty_bytes == 0) continue;  // nothing to push
    WritebackInput wi;
    wi.file_size = j->file->size();
    wi.writeback_bytes = pc.per_file ? pc.writeback_bytes : 0;
    wi.window_bytes = static_cast<std::uint64_t>(static_cast<double>(j->decision->window_bytes) *
                                                 (mirror(j->type) ? kMirrorPacerWindowFraction : 1.0));
    TargetFile& f = *j->file;
    WritebackPlan plan = j->planner.plan(wi, [&f](const ByteRange& r) { return f.dirty_in(r); });
    for (const auto& r : plan.ranges) {
      f.start_writeback(r);
      if (pc.per_file && j->ranges_readable) j->issued.add(r);
    }
    j->issued_since_pc += plan.dirty_bytes_issued;
    // A whole lap found less than the estimate (the kernel's flusher wrote some back): until
    // the next whole-file reading nothing is left to push.  Without this every pace interval
    // swept the whole file again (cachestat over every cached page: ~30 % of a core on a
    // 2.5 GiB base in the lab).
    if (plan.lapped && j->pace_pc) j->issued_since_pc = std::max(j->issued_since_pc, j->pace_pc->dirty_bytes);
  }
}

void Governor::release_all() {
  // A connection lost just before the stop (libvirtd restarted) is tried once more: a job left
  // at a closed gate's or a held job's speed would crawl to its end.
  bool reconnected = false;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const auto& [k, j] = *it;
    // Finishing speed: what the storage was seen to absorb, never below the floor.
    double rate = j->decision ? std::max(j->decision->rate_bytes_per_s,
                                         j->decision->drain_estimate_bytes_per_s)
                              : j->policy.floor_bytes_per_s;
    rate = std::max(rate, j->policy.floor_bytes_per_s);
    try {
      (void)hv_.set_job_speed(k.domain, k.disk,
                              std::max<std::uint64_t>(opt_.min_speed_bytes_per_s,
                                                      static_cast<std::uint64_t>(rate)));
    } catch (const HypervisorDisconnected&) {
      if (!reconnected) {
        reconnected = true;
        if (hv_.connect()) continue;  // the same job again
      }
      break;
    }
    ++it;
  }
  jobs_.clear();
}

GovernorStatus Governor::status(TimePoint now) const {
  GovernorStatus st;
  st.connected = connected_;
  st.released = released_;
  for (const auto& [k, j] : jobs_) {
    JobStatus js;
    js.domain = k.domain;
    js.disk = k.disk;
    js.type = j->type;
    js.target = j->target;
    js.storage = j->storage;
    js.pool = j->pool;
    js.budget = j->policy.budget;
    js.speed_bytes_per_s = j->speed_set;
    js.window_bytes = j->decision ? j->decision->window_bytes : 0;
    js.backlog_bytes = j->backlog;
    js.phase = j->decision ? throttle::to_string(j->decision->phase) : "adopted";
    js.settling = j->hold_since.has_value();
    js.settles = j->settles;
    js.ready = j->ready;
    js.policy_error = j->policy_error;
    std::vector<Duration> lat;
    for (const auto& [t, l] : j->latencies)
      if (t >= now - kLatencyHistory) lat.push_back(l);
    if (!lat.empty()) {
      const size_t idx = std::min(lat.size() - 1, (lat.size() * 99) / 100);
      std::nth_element(lat.begin(), lat.begin() + static_cast<std::ptrdiff_t>(idx), lat.end());
      js.latency_p99 = lat[idx];
    }
    js.bytes_left = j->info.end > j->info.cur ? j->info.end - j->info.cur : 0;
    if (j->progress.size() >= 2) {
      const auto& a = j->progress.front();
      const auto& b = j->progress.back();
      const double secs = std::chrono::duration<double>(b.first - a.first).count();
      if (secs > 0 && b.second > a.second) {
        const double rate = static_cast<double>(b.second - a.second) / secs;
        js.eta_s = static_cast<double>(js.bytes_left) / rate;
      }
    }
    st.jobs.push_back(std::move(js));
  }
  return st;
}

}  // namespace qcommit::plugin
