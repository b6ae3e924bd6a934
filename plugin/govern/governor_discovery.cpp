// SPDX-License-Identifier: GPL-2.0-or-later
// The Governor's discovery: QEMU's job events and the poll find jobs, each is held at its first
// speed at once, adopted (target, storage, policy, probe, filter or gate) and released at its end.
#include <algorithm>
#include <string>
#include <vector>

#include "common/log_field.h"
#include "plugin/govern/cotenants.h"
#include "plugin/govern/governor_job.h"

namespace qcommit::plugin {

namespace {

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

bool governed(JobType t) {
  return t == JobType::Commit || t == JobType::ActiveCommit || t == JobType::Pull ||
         t == JobType::Copy;
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
  const TimePoint scan_began = clock_now();
  std::vector<DomainInfo> doms = only ? scanned_domains(*only) : hv_.running_domains();
  std::set<DiskKey> listed;
  std::vector<Found> found = find_jobs(doms, only, listed, now, scan_began);
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
                                                 std::set<DiskKey>& listed, TimePoint now,
                                                 TimePoint scan_began) {
  std::vector<Found> found;
  for (const auto& dom : doms) {
    if (only && !only->count(dom.name)) continue;
    for (const auto& disk : dom.disks) {
      if (opt_.only_disk &&
          (opt_.only_disk->first != dom.name || opt_.only_disk->second != disk.target))
        continue;
      const DiskKey k{dom.name, disk.target};
      const JobQuery q = hv_.query_job(dom.name, disk.target);
      const TimePoint listed_at = clock_now();
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
      found.push_back(Found{&dom, disk, q.info,
                            hold_found_job(dom, disk, q.info, {scan_began, listed_at, {}})});
    }
  }
  // Job events count for the scan they caused: a job found later was found by a poll.
  std::erase_if(job_started_events_,
                [only](const auto& kv) { return !only || only->count(kv.first); });
  return found;
}

// How a job listed on `domain` was found, and from when its time to govern counts: QEMU's job
// event (its timestamp; every step after it), else the poll, which discovered it when libvirt
// listed it -- its origin, so neither the scan's beginning before it nor the listing itself is
// a step.
SpeedCheck Governor::discovery_of(const std::string& domain, const GovernStages& stages) const {
  SpeedCheck check;
  check.stages = stages;
  const auto ev = job_started_events_.find(domain);
  if (ev != job_started_events_.end()) {
    check.found_by = FoundBy::kEvent;
    check.found_at = ev->second;
    return check;
  }
  check.found_by = FoundBy::kPoll;
  check.found_at = stages.job_listed.value_or(clock_now());
  check.stages.scan_began.reset();
  check.stages.job_listed.reset();
  return check;
}

// The first call for a job found on a disk: the speed it will start at, where that does not
// depend on its pool (not looked up yet) at most the least initial speed any policy could give
// it; read back.  Its target, extents, pool, policy and probe come after (adopt).
SpeedCheck Governor::hold_found_job(const DomainInfo& dom, const DiskInfo& disk,
                                    const JobInfo& info, GovernStages stages) {
  SpeedCheck check = discovery_of(dom.name, stages);
  const double initial = safe_initial_speed(cfg_, dom.policy_xml, opt_.max_rate_bytes_per_s);
  const std::uint64_t speed =
      std::max(start_speed(disk, info.type, initial), opt_.min_speed_bytes_per_s);
  const bool accepted = hv_.set_job_speed(dom.name, disk.target, speed);
  if (accepted) check.stages.speed_taken = clock_now();
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
  auto j = std::make_unique<Job>(
      k, policy, info.type, disk.cache, std::move(paced),
      TargetPacer(opt_.writeback, SettleConfig{opt_.settle_every, opt_.settle_max_hold},
                  opt_.page_cache_refresh));
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

}  // namespace qcommit::plugin
