// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/daemon/daemon_log.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <utility>

namespace qcommit::plugin {

namespace {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

// "domain D disk K"
std::string job_name(const std::string& domain, const std::string& disk) {
  return "domain " + log_field(domain) + " disk " + log_field(disk);
}

// The decision a status shows: the phase, except that a periodic slowdown keeps the previous one.
std::string decision_of(const JobStatus& j, const std::string& previous) {
  if (j.phase == throttle::to_string(throttle::Phase::Slowdown)) return previous;
  return j.phase;
}

std::string figures(const JobStatus& j) {
  char buf[160];
  int n = std::snprintf(buf, sizeof buf, "speed %.1f MiB/s, window %llu KiB",
                        static_cast<double>(j.speed_bytes_per_s) / kBytesPerMiB,
                        static_cast<unsigned long long>(j.window_bytes / 1024));
  std::string s(buf, static_cast<size_t>(n));
  if (j.latency_p99) {
    n = std::snprintf(buf, sizeof buf, ", guests' p99 %.1f ms",
                      std::chrono::duration<double, std::milli>(*j.latency_p99).count());
    s.append(buf, static_cast<size_t>(n));
  }
  return s;
}

}  // namespace

void DaemonLog::record(std::string_view message) {
  sink_(log_escape_controls(message));
}

void DaemonLog::log_probe(const JobStatus& j, Known& k) {
  if (j.probe != ProbeState::kOff || j.probe_off_reason == k.probe_off) return;
  record(job_name(j.domain, j.disk) + ": shared-queue probe off: " + j.probe_off_reason);
  k.probe_off = j.probe_off_reason;
}

void DaemonLog::log_target_throttle(const JobStatus& j, Known& k) {
  if (j.target_throttle == k.target_throttle) return;
  if (j.target_throttle == "on")
    record(job_name(j.domain, j.disk) + ": throttle filter under " + j.target + " in");
  else if (!j.target_throttle.empty())
    record(job_name(j.domain, j.disk) + ": throttle filter under " + j.target + " " +
           j.target_throttle);
  else if (k.target_throttle == "on")
    record(job_name(j.domain, j.disk) + ": throttle filter under " + j.target + " out");
  k.target_throttle = j.target_throttle;
}

void DaemonLog::log_floor(const JobStatus& j, Known& k) {
  if (k.floor_logged || j.floor.empty()) return;
  k.floor_logged = true;
  record(job_name(j.domain, j.disk) + ": floor-limited: " + j.floor);
}

void DaemonLog::log_convergence(const JobStatus& j, Known& k) {
  const Convergence now = j.converge_floor_bytes_per_s > 0 ? Convergence::kFloorOn
                          : j.converging == false          ? Convergence::kNotConverging
                                                           : Convergence::kConverging;
  if (now == k.convergence) return;
  const Convergence was = std::exchange(k.convergence, now);
  char buf[320];
  int n = 0;
  if (now == Convergence::kNotConverging)
    n = std::snprintf(buf, sizeof buf,
                      "not converging: the guests add %.1f MiB/s to what is left to copy, the "
                      "budget lets the copy run at %.1f MiB/s; a converge floor follows after %lld s",
                      j.added_bytes_per_s / kBytesPerMiB,
                      static_cast<double>(j.speed_bytes_per_s) / kBytesPerMiB,
                      static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(
                                                 kNotConvergingAfter).count()));
  else if (now == Convergence::kFloorOn)
    n = std::snprintf(buf, sizeof buf,
                      "converge floor on: at least %.1f MiB/s until ready (%.1fx what the guests "
                      "add, at least the policy's floor), above the budget where need be",
                      j.converge_floor_bytes_per_s / kBytesPerMiB, kConvergeFloorFactor);
  else if (was == Convergence::kNotConverging && j.converging == true)
    n = std::snprintf(buf, sizeof buf, "converging again");
  else
    return;  // ready (the floor went with it: "ready" says so), or not known any more
  record(job_name(j.domain, j.disk) + ": " + std::string(buf, static_cast<size_t>(std::clamp(n, 0, static_cast<int>(sizeof buf) - 1))));
}

namespace {

// Where the time to govern went ("" when no step is known): "; scan began +A ms, job listed +B
// ms, speed taken +C ms", each from the job's discovery.  A long first step is the event's way
// from QEMU through libvirtd (or the daemon busy before it); the others are libvirt calls.
std::string govern_stages(const JobStatus& j) {
  std::string out;
  const auto add = [&out](const char* what, const std::optional<Duration>& d) {
    if (!d) return;
    char buf[64];
    const int n = std::snprintf(buf, sizeof buf, "%s%s +%.1f ms", out.empty() ? "; " : ", ", what,
                                std::chrono::duration<double, std::milli>(*d).count());
    out.append(buf, static_cast<size_t>(std::clamp(n, 0, static_cast<int>(sizeof buf) - 1)));
  };
  add("scan began", j.scan_began_after);
  add("job listed", j.job_listed_after);
  add("speed taken", j.speed_taken_after);
  return out;
}

}  // namespace

void DaemonLog::log_governed(const JobStatus& j, Known& k) {
  if (k.governed || !j.time_to_govern) return;
  k.governed = true;
  char buf[200];
  const int n = std::snprintf(
      buf, sizeof buf, "first speed read back from QEMU %.1f ms after the job was found (%s)",
      std::chrono::duration<double, std::milli>(*j.time_to_govern).count(), to_string(j.found_by));
  std::string m = job_name(j.domain, j.disk) + ": " + std::string(buf, static_cast<size_t>(n));
  m += govern_stages(j);
  if (j.late_adoption) {
    const int l = std::snprintf(buf, sizeof buf, "; late adoption: %.1f MiB copied unpaced",
                                static_cast<double>(j.copied_before_governed_bytes) / kBytesPerMiB);
    m.append(buf, static_cast<size_t>(l));
  }
  record(m);
}

void DaemonLog::observe(const GovernorStatus& st, std::string_view uri,
                        std::string_view last_error) {
  if (!connected_ || *connected_ != st.connected) {
    std::string m = (st.connected ? "connected to " : "not connected to ") + log_field(uri);
    if (!st.connected && !last_error.empty()) m += ": " + std::string(last_error);
    record(m);
    connected_ = st.connected;
  }
  std::set<std::pair<std::string, std::string>> listed;
  for (const auto& j : st.jobs) {
    const auto key = std::make_pair(j.domain, j.disk);
    listed.insert(key);
    auto it = jobs_.find(key);
    if (it != jobs_.end() && it->second.id != j.id) {  // the next job on this disk already
      log_end(key, it->second.id, st);
      jobs_.erase(it);
      it = jobs_.end();
    }
    if (it == jobs_.end()) {
      log_adopted(j);
      continue;
    }
    Known& k = it->second;
    log_probe(j, k);
    log_target_throttle(j, k);
    log_floor(j, k);
    log_convergence(j, k);
    log_governed(j, k);
    const std::string d = decision_of(j, k.decision);
    if (d != k.decision) {
      record(job_name(j.domain, j.disk) + ": " + d + " (was " + k.decision + "), " + figures(j));
      k.decision = d;
    }
    if (j.ready && !k.ready) record(job_name(j.domain, j.disk) + ": ready");
    k.ready = j.ready;
  }
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (listed.count(it->first)) {
      ++it;
      continue;
    }
    log_end(it->first, it->second.id, st);
    it = jobs_.erase(it);
  }
}

void DaemonLog::log_adopted(const JobStatus& j) {
  Known k{j.id, decision_of(j, "adopted"), j.ready, {}, {}, false, false,
          Convergence::kConverging};
  std::string m = "governing " + std::string(to_string(j.type)) + " job on " +
                  job_name(j.domain, j.disk) + " (target " + log_field(j.target) + ", storage " +
                  log_field(j.storage);
  if (!j.pool.empty()) m += ", pool " + log_field(j.pool);
  m += ", budget " +
       std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(j.budget).count()) +
       " ms): " + k.decision + ", " + figures(j);
  if (!j.policy_error.empty()) m += "; domain policy ignored: " + log_field(j.policy_error);
  record(m);
  Known& known = jobs_.insert_or_assign({j.domain, j.disk}, std::move(k)).first->second;
  log_probe(j, known);
  log_target_throttle(j, known);
  log_floor(j, known);
  log_governed(j, known);
}

void DaemonLog::log_end(const std::pair<std::string, std::string>& key, std::uint64_t id,
                        const GovernorStatus& st) {
  std::string reason = "released";
  for (const auto& r : st.released)  // newest first
    if (r.id == id) {
      reason = r.reason;
      break;
    }
  record(job_name(key.first, key.second) + ": " + reason);
}

}  // namespace qcommit::plugin
