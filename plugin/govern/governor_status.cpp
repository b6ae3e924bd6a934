// SPDX-License-Identifier: GPL-2.0-or-later
// What the Governor shows of its jobs (GovernorStatus): a snapshot; daemon/control.cpp encodes it.
#include <algorithm>
#include <cstdio>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "plugin/govern/governor_job.h"
#include "throttle/percentile.h"

namespace qcommit::plugin {

namespace {

// JobStatus::floor for a job whose controller decided `d` with config `c`: "" unless it is
// floor-limited.
std::string floor_text(JobType type, const std::string& cache, const throttle::ControllerConfig& c,
                       const throttle::Decision& d) {
  if (!d.floor_limited) return {};
  const char* job = mirror_job(type)        ? "QEMU mirror"
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

// The 99th percentile of the latencies stamped at or after `since`; nullopt when there are none.
std::optional<Duration> p99_since(const std::deque<std::pair<TimePoint, Duration>>& stamped,
                                  TimePoint since) {
  std::vector<Duration> lat;
  for (const auto& [t, l] : stamped)
    if (t >= since) lat.push_back(l);
  return throttle::percentile(std::move(lat), throttle::kP99Percent);
}

}  // namespace

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
    const TimePoint found_at = j->check.found_at;
    const auto after = [found_at](const std::optional<TimePoint>& t) -> std::optional<Duration> {
      if (!t) return std::nullopt;
      return *t - found_at;
    };
    js.scan_began_after = after(j->check.stages.scan_began);
    js.job_listed_after = after(j->check.stages.job_listed);
    js.speed_taken_after = after(j->check.stages.speed_taken);
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
    js.settling = j->pacer.settling();
    js.settles = j->pacer.settles();
    js.settles_given_up = j->pacer.settles_given_up();
    js.probe = !j->probe_local.empty() ? ProbeState::kLocal
               : !j->probe_wanted      ? ProbeState::kDisabled
               : j->probe              ? ProbeState::kOn
                                       : ProbeState::kOff;
    if (js.probe == ProbeState::kOff) js.probe_off_reason = j->probe_off;
    if (js.probe == ProbeState::kLocal) js.probe_off_reason = j->probe_local;
    js.probe_last = j->probe_last;
    if (j->probe) js.probe_period = j->probe->config().period;
    js.probe_p99 = p99_since(j->probe_history, now - kLatencyHistory);
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
    js.latency_p99 = p99_since(j->history.latencies, now - kLatencyHistory);
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
