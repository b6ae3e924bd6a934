// SPDX-License-Identifier: GPL-2.0-or-later
// One governed job's progress as `qcommit live` shows it, read from the governor run in-process
// or from qcommitd's status, and its --output=json record. The record names each field as
// qcommitd's status does (plugin/daemon/control.cpp): bytes_left, eta_s, probe_off_reason, ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "plugin/govern/governor.h"
#include "plugin/host/json.h"

namespace qcommit::plugin {

struct JobProgress {
  std::string type;
  std::uint64_t bytes_left = 0;
  std::uint64_t speed_bytes_per_s = 0;
  std::uint64_t window_bytes = 0;
  std::optional<double> p99_ms;  // guests on the same storage
  std::optional<double> eta_s;
  std::optional<bool> converging;  // a mirror's bytes left shrink (JobStatus::converging)
  double converge_floor_bytes_per_s = 0;
  std::string phase;
  std::string probe;             // the shared-queue probe: "on", "off", "disabled" ("" unknown)
  std::string probe_off_reason;  // "off": why
};

// The governor's own view of a job (in-process pacing).
[[nodiscard]] JobProgress progress_of(const JobStatus& j);

// A job of qcommitd's status answer ({"jobs": [...]}); absent or mistyped members stay unknown.
[[nodiscard]] JobProgress progress_of_status(const json::Value& job);

// {"event": "progress", "type", "bytes_left", "speed_bytes_per_s", "window_bytes",
//  "latency_p99_ms", "phase", "percent", "eta_s", "converging", "converge_floor_bytes_per_s",
//  "probe", "probe_off_reason"} (unknown values
// null): each field under the name qcommitd's status gives it.
[[nodiscard]] json::Ordered progress_json(const JobProgress& j, std::optional<double> percent);

}  // namespace qcommit::plugin
