// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd's log: one record per line, names as data.
//
// Domain, disk, pool and file names come from libvirt and from whoever defined the domain; they
// may hold spaces, quotes, `$(...)`, backticks, `;` and newlines.  They are written as fields
// (log_field): bare when harmless, else quoted with escapes, so a record stays one line and its
// fields stay separable.  Nothing in a record is ever passed to a shell.
//
// DaemonLog turns successive GovernorStatus snapshots into records: connection changes, one per
// job adopted, one per decision change, one per job released — never one per tick.  A job whose
// policy asks for the shared-queue probe but that runs without it gets one record saying why
// (when adopted, or when the probe is given up later); a job that is floor-limited
// (JobStatus::floor) gets one record naming the floor, the first time.  A decision is the
// controller's phase (slow-start, steady, paused) or the job becoming ready; the periodic slowdowns
// (throttle::ControllerConfig::slowdown_interval) are scheduled, not decided, and are not logged.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/log_field.h"
#include "plugin/govern/governor.h"

namespace qcommit::plugin {

// Receives one record: no trailing newline, no control characters.
using LogSink = std::function<void(std::string_view record)>;

class DaemonLog {
 public:
  explicit DaemonLog(LogSink sink) : sink_(std::move(sink)) {}

  // One record; control characters are escaped whatever the caller passed.
  void record(std::string_view message);

  // Records what changed since the previous call.  `uri` and `last_error` name the connection.
  void observe(const GovernorStatus& st, std::string_view uri, std::string_view last_error);

 private:
  // A mirror's convergence as the log tells it (JobStatus::converging, converge floor).
  enum class Convergence { kConverging, kNotConverging, kFloorOn };
  struct Known {
    std::uint64_t id = 0;  // JobStatus::id: a new id on the same disk is the next job
    std::string decision;
    bool ready = false;
    std::string probe_off;        // the reason logged for a probe that is off
    std::string target_throttle;  // the filter's state logged last
    bool governed = false;        // its time to govern was logged
    bool floor_logged = false;    // its floor (JobStatus::floor) was logged
    Convergence convergence = Convergence::kConverging;  // as logged last
  };
  // The record of a job adopted: its type, target, storage, budget, first decision and figures.
  void log_adopted(const JobStatus& j);
  // The record of job `id` on `key` (domain, disk) ending, with the reason the governor gave.
  void log_end(const std::pair<std::string, std::string>& key, std::uint64_t id,
               const GovernorStatus& st);
  // One record when `j`'s probe is off for a reason not logged yet.
  void log_probe(const JobStatus& j, Known& k);
  // One record when the throttle filter under `j`'s target goes in, out, or is not used.
  void log_target_throttle(const JobStatus& j, Known& k);
  // One record, the first time `j` is floor-limited: which floor and its figures.
  void log_floor(const JobStatus& j, Known& k);
  // One record when a mirror stops converging, when its converge floor goes on, and when it
  // converges again without one.
  void log_convergence(const JobStatus& j, Known& k);
  // One record when `j`'s first speed is seen in QEMU: its time to govern, how it was found, and
  // whether it was adopted late.
  void log_governed(const JobStatus& j, Known& k);
  LogSink sink_;
  std::optional<bool> connected_;
  std::map<std::pair<std::string, std::string>, Known> jobs_;
};

}  // namespace qcommit::plugin
