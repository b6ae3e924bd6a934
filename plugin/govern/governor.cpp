// SPDX-License-Identifier: GPL-2.0-or-later
// The Governor's step (governor.h): reconnects, events and polls, each governed job's tick (its
// pacing's decision applied), the writeback pacers, chunk gates and probes, escapes and their
// kernel limits, and the stop.  Discovery, the throttle filter and status are in the files
// governor_job.h lists.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/log_field.h"
#include "plugin/govern/cotenants.h"
#include "plugin/govern/governor_job.h"

namespace qcommit::plugin {

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
    pc = j.pacer.read(*j.file, now);  // the pacer works from this reading until the next one
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
  const bool holding = j.file && j.pacer.settle(*j.file, pc, now);
  const throttle::Decision d = j.pacing.decide(in, holding);
  j.probe_samples.clear();
  const bool escape_hold = track_escape(j, pc, d, now);
  apply_speed(j, info,
              escape_hold ? JobSpeed{opt_.min_speed_bytes_per_s, true}
                          : j.pacing.speed(reading, m, d, holding));
  record_tick(j, s, info, m.backlog, now);
}

bool Governor::settled_for_pivot(const std::string& domain, const std::string& disk,
                                 TimePoint now) {
  const auto it = jobs_.find(DiskKey{domain, disk});
  if (it == jobs_.end()) return true;
  Job& j = *it->second;
  if (!j.pacer.settles_enabled() || !j.file || j.direct_io || j.gate) return true;
  return j.pacer.settled_for_pivot(now);
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

// Each job whose writes go through the page cache: its target's writeback within its window.
void Governor::pace(TimePoint now) {
  for (auto& [k, j] : jobs_) {
    if (j->gate) continue;  // its writes bypass the page cache: nothing to push (pace_gates)
    if (!j->file || !j->pacing.decision()) continue;
    j->pacer.pace(*j->file, j->pacing.writeback_window(*j->pacing.decision()), j->pacing.fallback(),
                  j->direct_io, now);
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

}  // namespace qcommit::plugin
