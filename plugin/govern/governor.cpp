// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/governor.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>

#include "plugin/govern/cotenants.h"
#include "common/log_field.h"

namespace qcommit::plugin {

const char* to_string(JobType t) {
  switch (t) {
    case JobType::Pull:
      return "pull";
    case JobType::Copy:
      return "copy";
    case JobType::Commit:
      return "commit";
    case JobType::ActiveCommit:
      return "active-commit";
    case JobType::Backup:
      return "backup";
    case JobType::Unknown:
      break;
  }
  return "unknown";
}

const char* to_string(JobEventKind k) {
  switch (k) {
    case JobEventKind::StatusChange:
      return "status-change";
    case JobEventKind::Completed:
      return "completed";
    case JobEventKind::Failed:
      return "failed";
    case JobEventKind::Canceled:
      return "canceled";
    case JobEventKind::Ready:
      return "ready";
  }
  return "unknown";
}

const char* end_state(const ReleasedJob& r) {
  if (!r.from_event) return "ended";
  if (r.reason == kEndCompleted)
    return r.type == JobType::ActiveCommit || r.type == JobType::Copy ? "pivoted" : "completed";
  if (r.reason == kEndCanceled) return "canceled";
  if (r.reason == kEndPivotFailed) return "pivot-failed";
  return "failed";
}

const char* to_string(ProbeState s) {
  switch (s) {
    case ProbeState::kDisabled:
      return "disabled";
    case ProbeState::kLocal:
      return "local";
    case ProbeState::kOn:
      return "on";
    case ProbeState::kOff:
      return "off";
  }
  return "off";
}

std::optional<std::string> GovernorOptions::validate() const {
  if (tick <= Duration::zero()) return "governor tick must be > 0";
  if (pace <= Duration::zero() || pace > tick) return "governor pace interval must be in (0, tick]";
  if (poll <= Duration::zero() || poll > std::chrono::milliseconds(500))
    return "governor poll interval must be in (0, 500ms] (jobs are discovered within 0.5 s)";
  if (reconnect_min <= Duration::zero() || reconnect_max < reconnect_min)
    return "governor reconnect intervals: need 0 < min <= max";
  if (min_speed_bytes_per_s == 0) return "minimum job speed must be > 0 (0 is unlimited in QEMU)";
  if (max_rate_bytes_per_s &&
      !(*max_rate_bytes_per_s >= static_cast<double>(min_speed_bytes_per_s)))
    return "a job speed cap must be at least the minimum job speed (" +
           std::to_string(min_speed_bytes_per_s / 1024) + " KiB/s)";
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

// JobStatus::floor for a job whose controller decided `d` with config `c`: "" unless it is
// floor-limited.
std::string floor_text(JobType type, const std::string& cache, const throttle::ControllerConfig& c,
                       const throttle::Decision& d) {
  if (!d.floor_limited) return {};
  const char* job = mirror_job(type)            ? "QEMU mirror"
                    : type == JobType::Pull ? "QEMU stream"
                                            : "QEMU commit";
  const std::uint64_t kib = c.copy_request_bytes / 1024;
  const std::string size =
      kib % 1024 == 0 ? std::to_string(kib / 1024) + " MiB" : std::to_string(kib) + " KiB";
  const auto ms = [](Duration x) { return std::chrono::duration<double, std::milli>(x).count(); };
  char buf[256];
  const int n = std::snprintf(
      buf, sizeof buf,
      "%s: %s requests (%u in flight) at cache=%s: %.0f ms per request at %.1f MiB/s, above the "
      "budget's %.0f ms per request; runs at >= %.0f %% of the storage",
      job, size.c_str(), c.copy_requests_in_flight, cache.c_str(), ms(d.floor_latency),
      d.storage_rate_bytes_per_s / throttle::kMiB, ms(c.latency_budget),
      100 * throttle::kFloorLimitedDrainShare);
  std::string s(buf, static_cast<std::size_t>(std::clamp(n, 0, static_cast<int>(sizeof buf) - 1)));
  // qcommit live merges with a non-active commit first: 512 KiB requests, one in flight.
  if (type == JobType::ActiveCommit) s += "; `qcommit live` would do better for this disk";
  return s;
}

// The layers a non-active commit into `base` copies: the backing images above it (the active
// layer stays: it is not part of a non-active commit).
std::vector<std::string> commit_layers(const DiskInfo& disk, const std::string& base) {
  std::vector<std::string> layers;
  for (const std::string& image : disk.backing_chain) {
    if (image == base) break;
    layers.push_back(image);
  }
  return layers;
}

}  // namespace

// The pacer's view of a target's page cache: the last whole-file reading, when, and bytes issued
// since; the ranges it issued (re-read between whole-file readings) and what was under writeback
// outside them at the last whole-file reading (the kernel's own writeback).
struct Governor::PacerView {
  std::optional<PageCacheState> pc;
  std::optional<TimePoint> at;
  std::uint64_t issued_since_pc = 0;
  IssuedRanges issued;
  std::uint64_t writeback_elsewhere = 0;
  bool ranges_readable = true;  // false: cachestat of a range failed, count issued bytes instead
  // When a sweep of the whole target last found nothing to write back: the target was clean
  // then, apart from what was in flight (the settle's signal where dirty counts are bounds).
  std::optional<TimePoint> clean_sweep_at;

  // Whole-file reading (cachestat over the target: CPU in proportion to its cached pages).
  void read_page_cache(TargetFile& file, TimePoint now) {
    pc = file.page_cache();
    at = now;
    issued_since_pc = 0;
    writeback_elsewhere = 0;
    if (!pc || !pc->per_file) {
      issued.clear();
      return;
    }
    const std::optional<std::uint64_t> ours = issued_writeback(file);
    ranges_readable = ours.has_value();
    if (!ours) issued.clear();
    writeback_elsewhere = pc->writeback_bytes - std::min(pc->writeback_bytes, ours.value_or(0));
  }
  // What is under writeback in the ranges the pacer issued (cachestat of each).
  // Ranges whose writeback completed and that stayed clean leave the page cache.
  std::optional<std::uint64_t> issued_writeback(TargetFile& file) {
    std::vector<ByteRange> clean;
    const std::optional<std::uint64_t> wb = issued.under_writeback(
        [&file](const ByteRange& r) { return file.page_cache_in(r); }, &clean);
    for (const ByteRange& r : clean) file.drop_cached(r);
    return wb;
  }
};

// Settling (see GovernorOptions::settle_every): dirty without a settle since, holding since,
// fdatasync started, settles done.
struct Governor::SettleState {
  std::optional<TimePoint> dirty_since;
  std::optional<TimePoint> hold_since;
  bool started = false;
  std::uint32_t count = 0;
  // settled_for_pivot: asked when, and whether its settle is over (done or given up).
  std::optional<TimePoint> pivot_asked;
  bool pivot_ready = false;
};

// Chunk gate (direct_chunks jobs): the gate, the rate it spaces the chunks for and whether it may
// open.
struct Governor::GateState {
  explicit GateState(const throttle::ChunkGateConfig& cfg) : gate(cfg) {}
  throttle::ChunkGate gate;
  double rate = 0;
  bool allowed = true;
};

// What status() shows over time: guests' latencies and the job's bytes left.
struct Governor::History {
  std::deque<std::pair<TimePoint, Duration>> latencies;
  std::deque<std::pair<TimePoint, std::uint64_t>> left;
};

struct Governor::Job {
  Job(DiskKey k, const Policy& p, JobType t, const std::string& cache, PacedJob paced)
      : key(std::move(k)),
        type(t),
        policy(p),
        cache_mode(cache),
        direct_io(direct_cache(cache)),
        pacing(std::move(paced), controller_config(p, t, cache)) {}
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
    // A mirror's requests reach the storage as they are, with or without a throttle filter
    // (which admits whole requests): no rate makes one of them shorter.
    if (direct_cache(cache) && mirror_job(t)) {
      c.copy_request_bytes = kQemuMirrorRequestBytes;
      c.copy_requests_in_flight = kQemuMirrorRequestsInFlight;
    }
    return c;
  }
  // Identity and policy.
  std::uint64_t id = 0;
  DiskKey key;
  JobType type = JobType::Unknown;
  std::string target;
  std::string storage;
  std::string pool;
  Policy policy;
  std::string cache_mode;  // the disk's <driver cache=...>
  std::string policy_error;
  bool direct_io;  // direct_cache(): its writes bypass the page cache
  // Control: its pacing (the controller and its last decision), the job as of the last tick,
  // the speed set.
  JobPacing pacing;
  JobInfo info{};
  bool has_info = false;
  bool ready = false;
  bool seen_in_poll = true;
  std::uint64_t speed_set = 0;  // as QEMU was read to have it; gated: the paced rate
  SpeedCheck check;             // its discovery, the speed asked for and read back, time to govern
  // The target's page cache and how it is pushed to storage.
  std::unique_ptr<TargetFile> file;
  WritebackPlanner planner;
  PacerView pacer;
  SettleState settle;
  std::optional<GateState> gate;
  // The throttle filter under the target, while it is in; why not, when it applies but is not.
  std::optional<TargetThrottle> throttle;
  FormatNodeOptions throttle_options;
  std::string throttle_off;
  // Held at the floor until its requests in flight are done, so that the reopen that puts the
  // filter in (which drains the target and with it the guest's disk) waits for nothing.
  std::optional<TimePoint> throttle_pending_since;
  History history;
  // The shared-queue probe: its file, schedule, latencies since the last tick, failures in a row,
  // and what status() shows.
  std::unique_ptr<ProbeFile> probe_file;
  std::optional<throttle::ProbeSchedule> probe;
  std::vector<Duration> probe_samples;
  std::uint32_t probe_failures = 0;
  std::deque<std::pair<TimePoint, Duration>> probe_history;
  std::optional<Duration> probe_last;
  bool probe_wanted = false;  // the policy asks for a probe on this job's storage
  std::string probe_local;    // probe=auto and the storage is not shared: why no probe is wanted
  // Its bytes at storage as last read (Governor::own_queue_bytes), for the other jobs on it.
  std::optional<std::uint64_t> own_queue;
  std::string probe_off;      // why there is none although wanted
  // Escaped governance (escape.h), and its storage's kernel dirty limit (JobStatus::bdi_limit).
  EscapeState escape;
  std::string bdi_limit;
};

Governor::Governor(Hypervisor& hv, TargetFiles& files, DaemonConfig cfg, GovernorOptions opt)
    : hv_(hv),
      files_(files),
      cfg_(std::move(cfg)),
      opt_(opt),
      reconnect_(opt.reconnect_min, opt.reconnect_max) {
  hv_.set_event_sink([this](const JobEvent& e) { pending_events_.push_back(e); });
  if (!opt_.bdi_state_path.empty())
    bdi_ = std::make_unique<BdiLimits>(BdiSysfs(opt_.sysfs_root), opt_.bdi_state_path);
}

void Governor::restore_recorded_limits() {
  if (bdi_) notice_all(bdi_->restore_recorded());
}

void Governor::notice_all(const std::vector<std::string>& lines) const {
  if (!opt_.notice) return;
  for (const std::string& line : lines) opt_.notice(line);
}

Governor::~Governor() {
  hv_.set_event_sink(nullptr);
}

TimePoint Governor::step(TimePoint now) {
  step_now_ = now;
  if (connected_ && !hv_.connected()) lost_connection(now);
  if (!connected_) {
    if (reconnect_.due(now)) {
      if (hv_.connect()) {
        connected_ = true;
        was_ever_connected_ = true;
        sweep_orphans_ = opt_.target_throttle;
        reconnect_.succeeded();
        next_poll_ = now;  // adopt running jobs right away
      } else {
        reconnect_.failed(now);
      }
    }
    if (!connected_) return reconnect_.next();
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
    if (std::any_of(jobs_.begin(), jobs_.end(), [](const auto& kj) {
          return kj.second->gate && kj.second->gate->gate.is_open();
        })) {
      if (pace_due)
        next_pace_ = now + opt_.pace;  // a step between two paces keeps the close's time
      return *next_pace_;
    }
    drive_probes(now);
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
    return reconnect_.next();
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
  job_started_events_.clear();
  next_poll_.reset();
  next_tick_.reset();
  next_pace_.reset();
  for (auto& [k, j] : jobs_) {
    j->has_info = false;  // progress baseline restarts after the reconnect
    j->pacing.restart();  // it may be another job when we are back
    j->seen_in_poll = false;
  }
  reconnect_.retry_now(now);  // first retry immediately, then back off
}

void Governor::handle_events(TimePoint now) {
  std::vector<JobEvent> events;
  events.swap(pending_events_);
  for (const auto& e : events) {
    if (e.kind == JobEventKind::StatusChange) {
      scan_domains_.insert(e.domain);
      if (e.started) {  // a job found by this scan was found at the event's time
        const TimePoint at = std::min(e.at.value_or(now), now);
        auto [it, fresh] = job_started_events_.emplace(e.domain, at);
        if (!fresh) it->second = std::min(it->second, at);
      }
      continue;
    }
    // BLOCK_JOB_2 names the disk by target; accept a source path too.
    JobEvent ev = e;
    if (!jobs_.count(DiskKey{e.domain, e.disk})) {
      for (const auto& d : domains_) {
        if (d.name != e.domain) continue;
        for (const auto& disk : d.disks)
          if (disk.source == e.disk) ev.disk = disk.target;
      }
    }
    if (ev.kind == JobEventKind::Ready) {
      auto it = jobs_.find(DiskKey{ev.domain, ev.disk});
      if (it != jobs_.end()) it->second->ready = true;
      continue;
    }
    job_ended(ev, now);
  }
}

// A released job that a late end event may still name: released by the daemon (no event) on
// that disk within kLateEndEvent.
ReleasedJob* Governor::late_end(const std::string& domain, const std::string& disk, TimePoint now) {
  for (ReleasedJob& r : released_)  // newest first
    if (r.domain == domain && r.disk == disk)
      return !r.from_event && now - r.at <= kLateEndEvent ? &r : nullptr;
  return nullptr;
}

// libvirt's end event (completed, canceled, failed) for a disk.  Events are dispatched after the
// calls in flight: a tick may have released the job already (then the event gives that release
// its reason), and a poll may already govern the next job on the disk (then the event is for the
// released one and the next job stays).  Whether a job still runs on the disk tells which.
void Governor::job_ended(const JobEvent& e, TimePoint now) {
  const DiskKey k{e.domain, e.disk};
  auto it = jobs_.find(k);
  auto reason = [&e](bool ready) -> std::string {
    if (e.kind == JobEventKind::Completed) return kEndCompleted;
    if (e.kind == JobEventKind::Canceled) return kEndCanceled;
    return ready ? kEndPivotFailed : kEndFailed;
  };
  ReleasedJob* late = late_end(e.domain, e.disk, now);
  if (it == jobs_.end()) {
    if (late) {
      late->reason = reason(late->ready);
      late->from_event = true;
    }
    return;
  }
  const JobQuery q = hv_.query_job(e.domain, e.disk);
  const bool next_runs = q.state == JobQuery::State::kRunning && governed(q.info.type);
  if (next_runs && late) {  // the governed job is the next one already
    late->reason = reason(late->ready);
    late->from_event = true;
    return;
  }
  release(k, reason(it->second->ready), now, true);
  if (next_runs) scan_domains_.insert(e.domain);  // adopt the next job in this step
}

bool Governor::same_job(const Job& j, const JobInfo& listed) {
  // QEMU's progress never goes back; libvirt shows a mirror that is not ready with cur one below
  // end when QEMU has them equal, so a step back by one is the same job.
  return listed.type == j.type && listed.cur + 1 >= j.info.cur;
}

std::string Governor::gone_reason(const Job& j) {
  return j.seen_in_poll ? kEndNotListed : kEndWhileDisconnected;
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

// New jobs are held at a safe speed as each is found (hold_found_job), before the pools, the
// orphan sweep and every adoption's file work (adopt): at page-cache speed, each 0.1 s a job runs
// unpaced is about 100 MB more for the guests to wait behind.
// The domains a job event named, each looked up alone: a new job's first speed waits for its own
// domain's description, not for every running domain's (three libvirt calls each).  Those not
// running any more are left out, as running_domains() would.
std::vector<DomainInfo> Governor::scanned_domains(const std::set<std::string>& names) {
  std::vector<DomainInfo> out;
  for (const std::string& n : names)
    if (std::optional<DomainInfo> d = hv_.running_domain(n)) out.push_back(std::move(*d));
  return out;
}

void Governor::poll(TimePoint now, const std::set<std::string>* only) {
  std::vector<DomainInfo> doms = only ? scanned_domains(*only) : hv_.running_domains();
  std::set<DiskKey> listed;
  std::vector<Found> found = find_jobs(doms, only, listed, now);
  if (!only) pools_ = hv_.pools();
  if (!only && sweep_orphans_) sweep_orphan_throttles(doms);
  for (Found& f : found) adopt(f, now);
  // Jobs that are no longer listed in the scanned domains ended without an event we saw.
  std::vector<DiskKey> gone;
  for (const auto& [k, j] : jobs_) {
    if (only && !only->count(k.domain)) continue;
    if (!listed.count(k)) gone.push_back(k);
  }
  for (const auto& k : gone) release(k, gone_reason(*jobs_[k]), now);
  if (only) {
    for (auto& d : doms) {
      if (!only->count(d.name)) continue;
      auto it = std::find_if(domains_.begin(), domains_.end(),
                             [&](const DomainInfo& x) { return x.name == d.name; });
      if (it == domains_.end())
        domains_.push_back(d);
      else
        *it = d;
    }
    // Scanned domains that are no longer running (stopped since): forget them.
    std::erase_if(domains_, [&](const DomainInfo& x) {
      return only->count(x.name) &&
             std::none_of(doms.begin(), doms.end(),
                          [&](const DomainInfo& d) { return d.name == x.name; });
    });
  } else {
    domains_ = std::move(doms);
  }
}

std::vector<Governor::Found> Governor::find_jobs(const std::vector<DomainInfo>& doms,
                                                const std::set<std::string>* only,
                                                std::set<DiskKey>& listed, TimePoint now) {
  std::vector<Found> found;
  for (const auto& dom : doms) {
    if (only && !only->count(dom.name)) continue;
    for (const auto& disk : dom.disks) {
      if (opt_.only_disk &&
          (opt_.only_disk->first != dom.name || opt_.only_disk->second != disk.target))
        continue;
      const DiskKey k{dom.name, disk.target};
      const JobQuery q = hv_.query_job(dom.name, disk.target);
      auto it = jobs_.find(k);
      if (q.state == JobQuery::State::kUnknown) {
        if (it != jobs_.end()) listed.insert(k);  // not known to have ended: kept as it is
        continue;
      }
      if (q.state != JobQuery::State::kRunning || !governed(q.info.type)) continue;
      listed.insert(k);
      if (it != jobs_.end() && same_job(*it->second, q.info)) {
        it->second->seen_in_poll = true;
        continue;
      }
      if (it != jobs_.end()) release(k, gone_reason(*it->second), now);  // another job now
      found.push_back(Found{&dom, disk, q.info, hold_found_job(dom, disk, q.info)});
    }
  }
  // Job events count for the scan they caused: a job found later was found by a poll.
  std::erase_if(job_started_events_,
                [only](const auto& kv) { return !only || only->count(kv.first); });
  return found;
}

// The first call for a job found on a disk: the speed it will start at, where that does not
// depend on its pool (not looked up yet) at most the least initial speed any policy could give
// it; read back.  Its target, extents, pool, policy and probe come after (adopt).
SpeedCheck Governor::hold_found_job(const DomainInfo& dom, const DiskInfo& disk,
                                    const JobInfo& info) {
  SpeedCheck check;
  const auto ev = job_started_events_.find(dom.name);
  check.found_by = ev != job_started_events_.end() ? FoundBy::kEvent : FoundBy::kPoll;
  check.found_at = ev != job_started_events_.end() ? ev->second : clock_now();
  const double initial = safe_initial_speed(cfg_, dom.policy_xml, opt_.max_rate_bytes_per_s);
  const std::uint64_t speed =
      std::max(start_speed(disk, info.type, initial), opt_.min_speed_bytes_per_s);
  const bool accepted = hv_.set_job_speed(dom.name, disk.target, speed);
  read_back(DiskKey{dom.name, disk.target}, speed, accepted, check, nullptr);
  return check;
}

bool Governor::throttle_filter_wanted(const DiskInfo& disk, JobType type) const {
  const std::optional<std::uint64_t> qemu = hv_.qemu_version();
  return opt_.target_throttle && type == JobType::ActiveCommit && Job::direct_cache(disk.cache) &&
         qemu && *qemu >= kThrottleFilterFromQemuVersion && disk.format_options_known;
}

bool Governor::gate_wanted(const DiskInfo& disk, JobType type) const {
  const std::optional<std::uint64_t> qemu = hv_.qemu_version();
  return opt_.chunk_gate && Job::direct_chunks(type, disk.cache) && qemu &&
         *qemu < kChunkGateBeforeQemuVersion;
}

std::uint64_t Governor::start_speed(const DiskInfo& disk, JobType type, double initial) const {
  if (throttle_filter_wanted(disk, type)) return opt_.min_speed_bytes_per_s;
  if (gate_wanted(disk, type))
    return std::max(static_cast<std::uint64_t>(initial * kChunkGateClosedRateFraction),
                    opt_.min_speed_bytes_per_s);
  return static_cast<std::uint64_t>(initial);
}

void Governor::domain_event(const std::string& domain, const std::string& event) {
  (void)event;  // every lifecycle change means the same: look at this domain now
  // Its counters restart with a new QEMU process: no delta across the change.
  std::erase_if(guests_, [&](const auto& kv) { return kv.first.domain == domain; });
  if (connected_) scan_domains_.insert(domain);
}

std::string Governor::unshared_storage(const std::string& target) {
  if (target.empty()) return "probe=auto: no target file known for this job";
  const std::optional<StorageKind> kind = files_.storage_kind(target);
  if (!kind) return "probe=auto: the filesystem of " + log_field(target) + " is not known";
  if (kind->shared) return {};
  return "probe=auto: " + log_field(target) + " is on " + kind->fs +
         ", which other hosts do not share";
}

void Governor::adopt(Found& f, TimePoint now) {
  const DomainInfo& dom = *f.dom;
  const DiskInfo& disk = f.disk;
  const JobInfo& info = f.info;
  DiskKey k{dom.name, disk.target};
  std::string target;
  if (disk.mirror)
    target = *disk.mirror;
  else if (info.type == JobType::Commit && !disk.backing_chain.empty())
    // libvirt names no base for a non-active commit (`--base` may be an intermediate image);
    // the bottom image is the guess when the host cannot tell.
    target =
        files_.commit_base(disk.source, disk.backing_chain).value_or(disk.backing_chain.back());
  else if (info.type == JobType::ActiveCommit && !disk.backing_chain.empty())
    target = disk.backing_chain.back();
  else if (info.type == JobType::Pull)
    target = disk.source;

  std::unique_ptr<TargetFile> file = target.empty() ? nullptr : files_.open(target);
  std::optional<PoolInfo> pool;
  std::string storage = target.empty()
                            ? storage_key(disk.source, disk.device, &pool)
                            : storage_key(target, file ? file->device() : std::nullopt, &pool);
  // The same order as an offline merge's (qcommit merge): domain metadata, pool, [default].
  PolicyQuery query;
  if (pool) {
    query.pool_name = pool->name;
    query.pool_uuid = pool->uuid;
  }
  query.domain_policy_xml = dom.policy_xml;
  const PolicyResolution resolved = resolve_policy(cfg_, query);
  const Policy policy = capped_policy(resolved.policy, opt_.max_rate_bytes_per_s);
  const std::string policy_error = resolved.metadata_error.value_or("");
  PacedJob paced;
  paced.type = info.type;
  paced.direct_io = Job::direct_cache(disk.cache);
  paced.min_speed_bytes_per_s = opt_.min_speed_bytes_per_s;
  paced.ceiling_bytes_per_s = policy.ceiling_bytes_per_s;
  paced.tick = opt_.tick;
  paced.pace = opt_.pace;
  if (info.type == JobType::Commit && !target.empty())
    paced.commit_extents = files_.commit_extents(commit_layers(disk, target));
  auto j = std::make_unique<Job>(k, policy, info.type, disk.cache, std::move(paced));
  j->id = ++adopted_;
  j->target = target;
  j->storage = storage;
  j->pool = pool ? pool->name : "";
  j->policy_error = policy_error;
  j->file = std::move(file);
  const throttle::ProbeConfig probe = policy.probe_config();
  if (probe.enabled && policy.probe == ProbeMode::kAuto) j->probe_local = unshared_storage(target);
  j->probe_wanted = probe.enabled && j->probe_local.empty();
  if (j->probe_wanted && target.empty()) {
    j->probe_off = "no target file known for this job";
  } else if (j->probe_wanted) {
    ProbeOpening opened = files_.open_probe(target);
    j->probe_file = std::move(opened.file);
    if (!j->probe_file)
      j->probe_off = opened.why_not.empty() ? "no probe file beside " + target : opened.why_not;
  }
  if (j->probe_file) j->probe.emplace(probe);
  j->planner = WritebackPlanner(opt_.writeback);
  j->info = info;
  j->has_info = false;
  j->check = f.check;  // held already (hold_found_job)
  j->speed_set = f.check.actual.value_or(0);
  Job& ref = *j;
  jobs_.emplace(k, std::move(j));
  // Its own start speed where its policy's differs from the hold's (the next tick retries one
  // QEMU did not take).
  const double initial = ref.pacing.config().initial_rate_bytes_per_s;
  const std::optional<std::uint64_t> qemu = hv_.qemu_version();
  if (opt_.target_throttle && info.type == JobType::ActiveCommit && ref.direct_io) {
    if (throttle_filter_wanted(disk, info.type)) {
      ref.throttle_options.discard = disk.discard == "unmap" ? "unmap" : "ignore";
      ref.throttle_pending_since = now;
    } else if (!qemu || *qemu < kThrottleFilterFromQemuVersion) {
      ref.throttle_off = "not used with QEMU before 8.1";
    } else {
      ref.throttle_off = "the disk's driver or source has options this cannot reopen its node with";
    }
  }
  if (gate_wanted(disk, info.type)) {
    ref.gate.emplace(opt_.chunk_gate_config);
    ref.gate->rate = initial;
    set_gate_speed(ref, false);
    return;
  }
  const std::uint64_t speed =
      std::max(start_speed(disk, info.type, initial), opt_.min_speed_bytes_per_s);
  if (ref.check.wanted != speed || ref.speed_set != speed) set_speed(ref, speed);
}

// QMP commands to `domain`'s QEMU through the hypervisor.
QmpCall Governor::qmp_for(const std::string& domain) {
  return [this, domain](std::string_view command, const json::Value& args, std::string* error) {
    return hv_.qmp_command(domain, command, args, error);
  };
}

// The filter goes in at the controller's initial rate.  The job's requests (1 MiB each) are what
// a guest's request may find ahead of it: the controller's delay target is never below one.
void Governor::insert_target_throttle(Job& j) {
  j.throttle_pending_since.reset();
  const auto initial = static_cast<std::uint64_t>(j.pacing.config().initial_rate_bytes_per_s);
  const std::uint64_t rate = throttle_rate_for(initial);
  const QmpCall qmp = qmp_for(j.key.domain);
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(j.id);
  auto r = plugin::insert_target_throttle(qmp, j.target, j.throttle_options, tag, rate);
  if (auto* e = std::get_if<std::string>(&r)) {
    j.throttle_off = *e;
    return;
  }
  j.throttle = std::get<TargetThrottle>(std::move(r));
  throttle::ControllerConfig c = j.pacing.config();
  c.copy_request_bytes = kQemuMirrorRequestBytes;
  j.pacing.reconfigure(c);
  set_speed(j, initial);
}

// The filter's rate for a job paced at `speed`: the job's bursts leave the filter at this rate.
std::uint64_t Governor::throttle_rate_for(std::uint64_t speed) const {
  return std::max(kMinThrottleRateBytesPerS,
                  static_cast<std::uint64_t>(kThrottleRateFactor * static_cast<double>(speed)));
}

// A new rate only when the job's speed has moved it by more than kThrottleRateHysteresis either
// way: QEMU restarts the group's buckets empty on every change, which lets out up to a tenth of a
// second's worth of requests at once.
void Governor::follow_target_throttle(Job& j) {
  const std::uint64_t want = throttle_rate_for(j.speed_set);
  const auto have = static_cast<double>(j.throttle->bytes_per_s);
  if (static_cast<double>(want) <= have * kThrottleRateHysteresis &&
      static_cast<double>(want) * kThrottleRateHysteresis >= have)
    return;
  const QmpCall qmp = qmp_for(j.key.domain);
  (void)plugin::set_target_throttle(qmp, *j.throttle, want);
}

// At ready and at the job's end QEMU's mirror has nothing in flight, so nothing waits in the
// filter when the reopen drains it.  Failures are not retried: the filter stays (at its last
// rate) until the domain stops; status says so.
void Governor::remove_target_throttle(Job& j) {
  if (!j.throttle) return;
  const QmpCall qmp = qmp_for(j.key.domain);
  try {
    if (auto e = plugin::remove_target_throttle(qmp, *j.throttle, j.throttle_options))
      j.throttle_off = "could not take the filter " + j.throttle->filter_node + " out: " + *e;
  } catch (const HypervisorDisconnected&) {
    j.throttle_off =
        "could not take the filter " + j.throttle->filter_node + " out: the connection was lost";
  }
  j.throttle.reset();
}

// Once per connection, before any job is adopted: a qcommit process killed while its filter was
// in left it there, and after the job's pivot it would keep metering the guest's own writes.
// Only domains with a cache=none/directsync disk whose node options are known can have one.
void Governor::sweep_orphan_throttles(const std::vector<DomainInfo>& doms) {
  sweep_orphans_ = false;
  for (const DomainInfo& dom : doms) {
    const auto direct = [](const DiskInfo& d) {
      return Job::direct_cache(d.cache) && d.format_options_known;
    };
    if (std::none_of(dom.disks.begin(), dom.disks.end(), direct)) continue;
    const QmpCall qmp = qmp_for(dom.name);
    const auto alive = [](long pid) {
      return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    };
    const auto options_for = [&dom](const std::string& file) -> std::optional<FormatNodeOptions> {
      for (const DiskInfo& d : dom.disks) {
        if (!d.format_options_known) continue;
        if (d.source == file || std::find(d.backing_chain.begin(), d.backing_chain.end(), file) !=
                                    d.backing_chain.end())
          return FormatNodeOptions{d.discard == "unmap" ? "unmap" : "ignore"};
      }
      return std::nullopt;
    };
    for (const std::string& line : remove_orphan_throttles(qmp, alive, options_for))
      if (opt_.notice) opt_.notice("domain " + dom.name + ": throttle filter " + line);
  }
}

void Governor::release(const DiskKey& k, const std::string& reason, TimePoint now,
                       bool from_event) {
  auto it = jobs_.find(k);
  if (it == jobs_.end()) return;
  remove_target_throttle(*it->second);
  release_target_bdi(it->second->id);
  released_.push_front(ReleasedJob{it->second->id, k.domain, k.disk, it->second->type, reason, now,
                                   from_event, it->second->ready});
  while (released_.size() > kMaxReleasedHistory) released_.pop_back();
  jobs_.erase(it);
}

// The job's speed is what QEMU reports right after the call, not what was asked for: a call the
// hypervisor accepted may still leave the job at another speed (0: unlimited), and the governor's
// figures (status, log, pacing) must not claim a speed QEMU does not have.
void Governor::set_speed(Job& j, std::uint64_t speed) {
  speed = std::max(speed, opt_.min_speed_bytes_per_s);  // never 0 (unlimited)
  const bool accepted = hv_.set_job_speed(j.key.domain, j.key.disk, speed);
  read_back(j.key, speed, accepted, j.check, &j.speed_set);
}

void Governor::read_back(const DiskKey& k, std::uint64_t wanted, bool accepted, SpeedCheck& check,
                         std::uint64_t* speed_set) {
  check.wanted = wanted;
  const JobQuery q = hv_.query_job(k.domain, k.disk);
  if (q.state != JobQuery::State::kRunning) return;  // nothing known: the next tick reads it
  if (speed_set) *speed_set = q.info.bandwidth_bytes_per_s;
  const std::optional<std::string> line =
      check.read_back(wanted, accepted, q.info.bandwidth_bytes_per_s, q.info.cur, clock_now());
  if (line && opt_.notice)
    opt_.notice("domain " + log_field(k.domain) + " disk " + log_field(k.disk) + ": " + *line);
}

void Governor::set_gate_speed(Job& j, bool open) {
  // Not allowed (paused, held): the floor, as for an ungated job.
  const auto closed = j.gate->allowed
                          ? static_cast<std::uint64_t>(j.gate->rate * kChunkGateClosedRateFraction)
                          : opt_.min_speed_bytes_per_s;
  if (hv_.set_job_speed(
          j.key.domain, j.key.disk,
          open ? kChunkGateOpenSpeedBytesPerS : std::max(closed, opt_.min_speed_bytes_per_s)))
    j.speed_set = std::max(static_cast<std::uint64_t>(j.gate->rate), opt_.min_speed_bytes_per_s);
}

// Foreground signals, per storage key, from every running domain's disks on the storage of some
// governed job; and which of those storages are not idle (a guest disk on it was active within
// kIdleStorageAfter, or its activity is not known this tick).
Governor::StorageSignals Governor::read_foreground(TimePoint now) {
  std::set<std::string> wanted;
  for (const auto& [k, j] : jobs_) wanted.insert(j->storage);
  StorageSignals out;
  for (const auto& dom : domains_) {
    for (const auto& disk : dom.disks) {
      const std::string key = storage_key(disk.source, disk.device, nullptr);
      if (!wanted.count(key)) continue;
      std::optional<BlockStats> st = hv_.block_stats(dom.name, disk.target);
      if (!st) {
        out.not_idle.insert(key);
        continue;
      }
      throttle::IoCounterSampler& sampler = guests_[DiskKey{dom.name, disk.target}];
      if (!sampler.primed()) out.not_idle.insert(key);
      sampler.sample(now, *st, opt_.tick, out.signals[key]);
      if (!sampler.quiet_for(now, kIdleStorageAfter)) out.not_idle.insert(key);  // active lately
    }
  }
  return out;
}

void Governor::tick(TimePoint now) {
  if (jobs_.empty()) return;
  StorageSignals fg = read_foreground(now);
  std::vector<DiskKey> keys;
  for (const auto& [k, j] : jobs_) keys.push_back(k);
  for (const auto& k : keys) {
    auto it = jobs_.find(k);
    if (it == jobs_.end()) continue;
    const JobQuery q = hv_.query_job(k.domain, k.disk);
    if (q.state == JobQuery::State::kUnknown) continue;  // this tick tells nothing of it
    Job& j = *it->second;
    if (q.state == JobQuery::State::kNone || !governed(q.info.type) || !same_job(j, q.info)) {
      release(k, gone_reason(j), now);
      if (q.state == JobQuery::State::kRunning) scan_domains_.insert(k.domain);  // its successor
      continue;
    }
    tick_job(j, q.info, fg.signals[j.storage], !fg.not_idle.count(j.storage), now);
  }
}

// The copies of this host on the job's storage share its budget: each is charged the queues of
// all of them (its own now, the others' as read at their last tick, unknown when that tick did
// not read it), so that none keeps the budget to itself where the guests' own requests explain
// the delay.  nullopt when one of them is unknown.
std::optional<std::uint64_t> Governor::local_copies_queue(const Job& j) const {
  if (!j.own_queue) return std::nullopt;
  std::uint64_t total = *j.own_queue;
  for (const auto& [k, other] : jobs_) {
    if (other.get() == &j || other->storage != j.storage) continue;
    if (!other->own_queue) return std::nullopt;
    total += *other->own_queue;
  }
  return total;
}

// Gives the job its speed: a gated job's gate learns the rate and whether it may open (pace_gates
// opens and closes it); another job's speed is set when it is off by more than
// kSpeedChangeFraction, differs from what QEMU reports, or must drop to the floor.
void Governor::apply_speed(Job& j, const JobInfo& info, JobSpeed js) {
  if (j.gate) {
    GateState& g = *j.gate;
    const bool was_allowed = g.allowed;
    g.allowed = !js.held;
    g.rate = static_cast<double>(js.speed);
    // Closed already: from now on at the floor (an open gate closes at the next pace).  And a
    // closed gate whose job still runs at the open speed (the close did not reach QEMU: a
    // refused call, a lost connection) is closed again.
    if (!g.gate.is_open() &&
        ((was_allowed && !g.allowed) || info.bandwidth_bytes_per_s == kChunkGateOpenSpeedBytesPerS))
      set_gate_speed(j, false);
    return;
  }
  const double off = std::fabs(static_cast<double>(js.speed) - static_cast<double>(j.speed_set));
  if (j.speed_set == 0 || off > kSpeedChangeFraction * static_cast<double>(j.speed_set) ||
      info.bandwidth_bytes_per_s != j.speed_set || j.check.wanted != j.speed_set ||
      (js.speed == opt_.min_speed_bytes_per_s && j.speed_set != js.speed))
    set_speed(j, js.speed);
  if (j.throttle) follow_target_throttle(j);
}

// What status() reports: the guests' latencies over kLatencyHistory and the job's progress over
// kEtaHistory; and the job's state as of this tick, for the next one.
void Governor::record_tick(Job& j, const throttle::ForegroundSignals& s, const JobInfo& info,
                           std::uint64_t backlog, TimePoint now) {
  for (Duration l : s.latencies) j.history.latencies.emplace_back(now, l);
  if (s.oldest_outstanding) j.history.latencies.emplace_back(now, *s.oldest_outstanding);
  auto& lat = j.history.latencies;
  while (!lat.empty() &&
         (lat.front().first < now - kLatencyHistory || lat.size() > kMaxLatencySamples))
    lat.pop_front();
  auto& left = j.history.left;
  left.emplace_back(now, info.end > info.cur ? info.end - info.cur : 0);
  while (!left.empty() && left.front().first < now - kEtaHistory) left.pop_front();
  j.info = info;
  j.has_info = true;
  j.pacing.record(info, backlog);
}

// One governed job's tick: its backlog from the page cache, the controller's decision, the
// job's speed, the history status() shows.
void Governor::tick_job(Job& j, const JobInfo& info, const throttle::ForegroundSignals& s,
                        bool storage_idle, TimePoint now) {
  j.own_queue.reset();  // unknown to the other jobs on its storage unless this tick reads it
  if (j.throttle_pending_since) {
    // Quiet (no progress over a tick at the floor: its last requests are done), or waited long
    // enough: the filter goes in; until then the job stays at the floor.
    const bool quiet = j.has_info && info.cur == j.info.cur;
    if (quiet || now - *j.throttle_pending_since >= kThrottleQuietWait || j.ready) {
      if (!j.ready)
        insert_target_throttle(j);
      else
        j.throttle_pending_since.reset();
      if (!j.throttle)
        set_speed(j, static_cast<std::uint64_t>(j.pacing.config().initial_rate_bytes_per_s));
    } else {
      // Held at the floor meanwhile: a hold QEMU does not have is set again.
      if (info.bandwidth_bytes_per_s != opt_.min_speed_bytes_per_s)
        set_speed(j, opt_.min_speed_bytes_per_s);
      record_tick(j, s, info, j.pacing.backlog(), now);
      return;
    }
  }
  if (j.throttle && (j.ready || info.cur >= info.end)) {
    // In sync: the mirror copies only what the guest writes now; the filter goes before the
    // pivot, and the job's speed paces it from here.
    remove_target_throttle(j);
  }
  std::optional<PageCacheState> pc;
  if (j.file) {
    j.pacer.read_page_cache(*j.file, now);  // the pacer works from this reading until the next one
    pc = j.pacer.pc;
  }
  const PacingReading reading{now, info, pc, j.speed_set, j.ready};
  const PacingMeasure m = j.pacing.measure(reading);
  throttle::TickInput in;
  in.now = now;
  in.foreground_latencies = s.latencies;
  in.foreground_outstanding = s.outstanding;
  in.foreground_oldest_outstanding = s.oldest_outstanding;
  in.foreground_idle = storage_idle && s.latencies.empty() && s.outstanding == 0;
  in.backlog_bytes = m.backlog;
  in.drained_bytes = m.drained;
  j.own_queue = m.own_queue;
  in.own_queue_bytes = local_copies_queue(j);
  in.foreground_own_bytes = s.own_bytes;
  const std::vector<throttle::CopySample> service =
      j.file ? j.file->take_service_samples() : std::vector<throttle::CopySample>{};
  in.own_service_samples = service;
  in.probe_latencies = j.probe_samples;
  if (j.probe) in.probe_outstanding = j.probe->outstanding_age(now);
  if (opt_.wall_clock) in.wall_clock = opt_.wall_clock();
  const bool holding = settle(j, pc, now);
  const throttle::Decision d = j.pacing.decide(in, holding);
  j.probe_samples.clear();
  const bool escape_hold = track_escape(j, pc, d, now);
  apply_speed(j, info,
              escape_hold ? JobSpeed{opt_.min_speed_bytes_per_s, true}
                          : j.pacing.speed(reading, m, d, holding));
  record_tick(j, s, info, m.backlog, now);
}

// Whether the target has nothing dirty for a settle started at `hold_since`: its per-file count
// says so, or, where the count is an upper bound (a memory cgroup's, which the guests' own cached
// writes keep above zero), a sweep of the whole target since the hold began found nothing to
// write back.
bool Governor::clean_for_settle(const Job& j, const PageCacheState& pc, TimePoint hold_since) {
  if (pc.dirty_bytes == 0) return true;
  return pc.dirty_upper_bound && j.pacer.clean_sweep_at && *j.pacer.clean_sweep_at >= hold_since;
}

bool Governor::settle(Job& j, const std::optional<PageCacheState>& pc, TimePoint now) {
  if (opt_.settle_every == Duration::zero() || !j.file || !pc || !pc->per_file) return false;
  SettleState& st = j.settle;
  if (st.pivot_ready) return true;  // held until the pivot ends the job
  if (!st.hold_since) {
    if (pc->dirty_bytes > 0 && !st.dirty_since) st.dirty_since = now;
    const bool due = st.dirty_since && now - *st.dirty_since >= opt_.settle_every;
    if (!due && !st.pivot_asked) return false;
    st.hold_since = now;
    st.started = false;
  }
  if (!st.started) {
    if (clean_for_settle(j, *pc, *st.hold_since) && j.file->start_settle()) {
      st.started = true;
    } else if (now - *st.hold_since >= opt_.settle_max_hold) {
      st.hold_since.reset();  // the job kept dirtying (or storage is slow): retry later
      st.dirty_since = now;
      if (st.pivot_asked) st.pivot_ready = true;  // the pivot goes ahead as it would have
      return st.pivot_ready;
    }
    return true;
  }
  if (j.file->settling()) return true;
  st.hold_since.reset();
  st.started = false;
  st.dirty_since.reset();
  ++st.count;
  if (st.pivot_asked) st.pivot_ready = true;
  return st.pivot_ready;
}

bool Governor::settled_for_pivot(const std::string& domain, const std::string& disk,
                                 TimePoint now) {
  const auto it = jobs_.find(DiskKey{domain, disk});
  if (it == jobs_.end()) return true;
  Job& j = *it->second;
  if (opt_.settle_every == Duration::zero() || !j.file || j.direct_io || j.gate) return true;
  SettleState& st = j.settle;
  if (!st.pivot_asked) st.pivot_asked = now;
  // No reading of the target arrives (it cannot be read): the pivot waits no longer than a hold.
  return st.pivot_ready || now - *st.pivot_asked >= 2 * opt_.settle_max_hold;
}

// Escaped jobs (escape.h) are told from exact per-file readings only: a memory cgroup's count (an
// upper bound the guests' own cached writes inflate) or the host-wide one would find escapes that
// are not the job's.  A job whose writes bypass the page cache leaves nothing dirty.  A tick
// without such a reading keeps a hold as it is.  The escape is found at the first tick after the
// adoption (within GovernorOptions::tick; the job is held at its first speed meanwhile), whose
// whole-file reading of the target it uses instead of one more.  Its storage's kernel limit goes
// on when the target is back within the window (limit_target_bdi); the escape says it will.
bool Governor::track_escape(Job& j, const std::optional<PageCacheState>& pc,
                            const throttle::Decision& d, TimePoint now) {
  EscapeState& e = j.escape;
  if (j.direct_io || !pc || !pc->per_file || pc->dirty_upper_bound) return e.hold_since.has_value();
  const EscapeNews news = observe_escape(e, pc->dirty_bytes + pc->writeback_bytes, d.window_bytes,
                                         d.drain_estimate_bytes_per_s, now);
  if (news == EscapeNews::kBackWithinWindow) limit_target_bdi(j, d.window_bytes);
  const bool limit_follows = news == EscapeNews::kEscaped && bdi_ && opt_.bdi_limits;
  if (news != EscapeNews::kNone && opt_.notice)
    opt_.notice("domain " + log_field(j.key.domain) + " disk " + log_field(j.key.disk) + ": " +
                escape_line(news, e, log_field(j.target), d.window_bytes,
                            limit_follows ? std::string(kBdiLimitPending) : j.bdi_limit));
  return e.hold_since.has_value();
}

// The kernel bound for an escaped job's storage: twice what a governed job may have there (its
// window queued plus one QEMU burst dirty, kDirtyAllowanceBytes), since the kernel throttles a
// strict-limited bdi's writers from about half its bound on: the bound stops what escapes the
// governor, not what the governor allows.  Set once, when the escaped job's target is back within
// its window, until the job is released: from then on it keeps the job from escaping again (a
// speed QEMU keeps not taking).  Not at the escape: a strict bound of a few tens of MiB on a
// device with hundreds of MiB dirty makes the kernel (balance_dirty_pages) throttle every
// buffered writer of that storage -- the guests' own cache=writeback writes through QEMU too, up
// to 200 ms a call -- until all of it is written back, and makes the flusher write it all out at
// once: the stall the paced drain at the minimum speed avoids.
void Governor::limit_target_bdi(Job& j, std::uint64_t window_bytes) {
  if (!bdi_ || !opt_.bdi_limits) return;
  const std::optional<std::uint64_t> dev = j.file ? j.file->device() : std::nullopt;
  if (!dev) {
    j.bdi_limit = "off: the storage device of " + log_field(j.target) + " is not known";
    return;
  }
  j.bdi_limit =
      bdi_->limit(j.id, *dev, kBdiLimitHeadroom * (window_bytes + kDirtyAllowanceBytes)).text;
}

void Governor::release_target_bdi(std::uint64_t id) {
  if (bdi_) notice_all(bdi_->release(id));
}

void Governor::pace_gates(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (!j->gate) continue;
    switch (j->gate->gate.step(now, j->gate->rate, j->gate->allowed)) {
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

// Each job's probe: a completed one gives its latency (a failed one counts towards giving the
// probe up), and the next starts when its schedule says (the storage's throughput known to us:
// the drain estimate).
void Governor::drive_probes(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (!j->probe_file || !j->probe) continue;
    if (j->probe->outstanding_age(now) && !j->probe_file->busy()) {
      (void)j->probe->completed(now);
      if (const std::optional<Duration> l = j->probe_file->take()) {
        j->probe_samples.push_back(*l);
        j->probe_history.emplace_back(now, *l);
        j->probe_last = *l;
        j->probe_failures = 0;
      } else if (++j->probe_failures >= kMaxProbeFailures) {
        const std::string last = j->probe_file->failure();
        j->probe_off = "given up after " + std::to_string(kMaxProbeFailures) +
                       " failed probes in a row" + (last.empty() ? "" : ", the last: " + last);
        j->probe_file.reset();
        j->probe.reset();
        continue;
      }
    }
    while (!j->probe_history.empty() && j->probe_history.front().first < now - kLatencyHistory)
      j->probe_history.pop_front();
    const std::optional<throttle::Decision>& d = j->pacing.decision();
    const double throughput =
        d ? d->drain_estimate_bytes_per_s : j->pacing.config().initial_rate_bytes_per_s;
    const std::optional<Duration> wait = j->probe->until_next(now, throughput);
    if (wait && *wait == Duration::zero() && j->probe_file->start()) j->probe->started(now);
  }
}

void Governor::pace(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (j->gate) continue;  // its writes bypass the page cache: nothing to push (pace_gates)
    if (!j->file || !j->pacing.decision()) continue;
    bool fresh = false;
    PacerView& pv = j->pacer;
    if (!pv.at || now - *pv.at >= opt_.page_cache_refresh) {
      pv.read_page_cache(*j->file, now);
      fresh = true;
    }
    if (!pv.pc) continue;
    // Without per-file counts the pacer cannot find the job's dirty pages: fdatasyncs of the
    // whole target write them out (and tell tick how much of the job's output is on storage),
    // at most one per kFallbackSyncGap, while the job copies or until one has started after
    // its last progress.  (A sync of a clean file may still flush the disk's cache.)
    if (!pv.pc->per_file) {
      FallbackSync& fs = j->pacing.fallback();
      if (j->direct_io || !fs.tick_cur) continue;
      if (fs.sync_start_cur && !j->file->settling()) {
        fs.synced_cur = fs.sync_start_cur;
        fs.sync_start_cur.reset();
      }
      const bool behind = !fs.synced_cur || *fs.synced_cur != *fs.tick_cur;
      const bool due = !fs.sync_started_at || now - *fs.sync_started_at >= kFallbackSyncGap;
      if (!fs.sync_start_cur && due && (fs.tick_progressed || behind) && j->file->start_settle()) {
        fs.sync_start_cur = fs.tick_cur;
        fs.sync_started_at = now;
      }
      continue;
    }
    PageCacheState pc = *pv.pc;
    // Between whole-file readings: what we issued is no longer dirty; what is under writeback is
    // the kernel's share from the last reading plus a fresh reading of the ranges we issued (few
    // and small: cheap) -- or, where ranges cannot be read, everything issued since.
    pc.dirty_bytes -= std::min(pc.dirty_bytes, pv.issued_since_pc);
    if (!fresh) {  // a fresh reading has just read the ranges and issued nothing since
      std::optional<std::uint64_t> ours;
      if (pc.per_file && pv.ranges_readable) {
        ours = pv.issued_writeback(*j->file);
        if (!ours) {
          pv.ranges_readable = false;
          pv.issued.clear();
        }
      }
      pc.writeback_bytes =
          ours ? pv.writeback_elsewhere + *ours : pc.writeback_bytes + pv.issued_since_pc;
    }
    if (pc.per_file && pc.dirty_bytes == 0) continue;  // nothing to push
    WritebackInput wi;
    wi.file_size = j->file->size();
    wi.writeback_bytes = pc.per_file ? pc.writeback_bytes : 0;
    wi.window_bytes = j->pacing.writeback_window(*j->pacing.decision());
    TargetFile& f = *j->file;
    WritebackPlan plan = j->planner.plan(wi, [&f](const ByteRange& r) { return f.dirty_in(r); });
    for (const auto& r : plan.ranges) {
      f.start_writeback(r);
      if (pc.per_file && pv.ranges_readable) pv.issued.add(r);
    }
    pv.issued_since_pc += plan.dirty_bytes_issued;
    // A whole lap found less than the estimate (the kernel's flusher wrote some back): until
    // the next whole-file reading nothing is left to push.  Without this every pace interval
    // swept the whole file again (cachestat over every cached page: ~30 % of a core on a
    // 2.5 GiB base in the lab).
    if (plan.lapped && pv.pc) pv.issued_since_pc = std::max(pv.issued_since_pc, pv.pc->dirty_bytes);
    if (plan.lapped && plan.dirty_bytes_issued == 0) pv.clean_sweep_at = now;
  }
}

void Governor::release_all() {
  // A connection lost just before the stop (libvirtd restarted) is tried once more: a job left
  // at a closed gate's or a held job's speed would crawl to its end.
  bool reconnected = false;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const auto& [k, j] = *it;
    // Finishing speed: what the storage was seen to absorb, never below the floor.
    const std::optional<throttle::Decision>& d = j->pacing.decision();
    double rate = d ? std::max(d->rate_bytes_per_s, d->drain_estimate_bytes_per_s)
                              : j->policy.floor_bytes_per_s;
    rate = std::clamp(rate, j->policy.floor_bytes_per_s, j->policy.ceiling_bytes_per_s);
    try {
      if (j->throttle) {  // let out what the filter holds, then take it out
        (void)plugin::set_target_throttle(
            qmp_for(k.domain), *j->throttle,
            static_cast<std::uint64_t>(j->policy.ceiling_bytes_per_s));
        remove_target_throttle(*j);
      }
      (void)hv_.set_job_speed(
          k.domain, k.disk,
          std::max<std::uint64_t>(opt_.min_speed_bytes_per_s, static_cast<std::uint64_t>(rate)));
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
  if (bdi_) notice_all(bdi_->release_all());
}

GovernorStatus Governor::status(TimePoint now) const {
  GovernorStatus st;
  st.connected = connected_;
  st.released = released_;
  for (const auto& [k, j] : jobs_) {
    JobStatus js;
    js.id = j->id;
    js.domain = k.domain;
    js.disk = k.disk;
    js.type = j->type;
    js.target = j->target;
    js.storage = j->storage;
    js.pool = j->pool;
    js.budget = j->policy.budget;
    js.speed_bytes_per_s = j->speed_set;
    js.speed_wanted_bytes_per_s = j->check.wanted;
    js.time_to_govern = j->check.time_to_govern;
    js.found_by = j->check.found_by;
    js.copied_before_governed_bytes = j->check.copied_when_governed;
    js.late_adoption = j->check.late();
    const std::optional<throttle::Decision>& d = j->pacing.decision();
    js.window_bytes = d ? d->window_bytes : 0;
    js.backlog_bytes = j->pacing.backlog();
    if (d) {
      js.delay_measured = d->measured_delay;
      js.delay_charged = d->queue_delay;
      js.own_queue_rate_bytes_per_s = d->own_queue_rate_bytes_per_s;
    }
    js.own_queue_bytes = j->own_queue;
    js.phase = d ? throttle::to_string(d->phase) : "adopted";
    js.settling = j->settle.hold_since.has_value();
    js.settles = j->settle.count;
    js.probe = !j->probe_local.empty() ? ProbeState::kLocal
               : !j->probe_wanted      ? ProbeState::kDisabled
               : j->probe              ? ProbeState::kOn
                                       : ProbeState::kOff;
    if (js.probe == ProbeState::kOff) js.probe_off_reason = j->probe_off;
    if (js.probe == ProbeState::kLocal) js.probe_off_reason = j->probe_local;
    js.probe_last = j->probe_last;
    if (j->probe) js.probe_period = j->probe->config().period;
    std::vector<Duration> probe_lat;
    for (const auto& [t, l] : j->probe_history)
      if (t >= now - kLatencyHistory) probe_lat.push_back(l);
    if (!probe_lat.empty()) {
      const size_t idx = std::min(probe_lat.size() - 1, (probe_lat.size() * 99) / 100);
      std::nth_element(probe_lat.begin(), probe_lat.begin() + static_cast<std::ptrdiff_t>(idx),
                       probe_lat.end());
      js.probe_p99 = probe_lat[idx];
    }
    js.ready = j->ready;
    js.policy_error = j->policy_error;
    if (j->throttle)
      js.target_throttle = "on";
    else if (!j->throttle_off.empty())
      js.target_throttle = "off: " + j->throttle_off;
    js.escaped = j->escape.escaped;
    js.escaped_bytes = j->escape.peak_bytes;
    js.escape_cost = j->escape.cost();
    js.escape_held = j->escape.hold_since.has_value();
    js.bdi_limit = j->bdi_limit;
    if (d) js.floor = floor_text(j->type, j->cache_mode, j->pacing.config(), *d);
    std::vector<Duration> lat;
    for (const auto& [t, l] : j->history.latencies)
      if (t >= now - kLatencyHistory) lat.push_back(l);
    if (!lat.empty()) {
      const size_t idx = std::min(lat.size() - 1, (lat.size() * 99) / 100);
      std::nth_element(lat.begin(), lat.begin() + static_cast<std::ptrdiff_t>(idx), lat.end());
      js.latency_p99 = lat[idx];
    }
    js.bytes_left = j->info.end > j->info.cur ? j->info.end - j->info.cur : 0;
    if (j->history.left.size() >= 2) {
      const auto& a = j->history.left.front();
      const auto& b = j->history.left.back();
      const double secs = std::chrono::duration<double>(b.first - a.first).count();
      if (secs > 0 && a.second > b.second) {
        const double rate = static_cast<double>(a.second - b.second) / secs;
        js.eta_s = static_cast<double>(js.bytes_left) / rate;
      }
    }
    const Convergence& conv = j->pacing.convergence();
    if (conv.known) js.converging = conv.converging;
    js.added_bytes_per_s = conv.added_bytes_per_s;
    js.converge_floor_bytes_per_s = conv.floor_bytes_per_s;
    st.jobs.push_back(std::move(js));
  }
  return st;
}

}  // namespace qcommit::plugin
