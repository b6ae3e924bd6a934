// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/live/progress.h"

#include <chrono>
#include <cmath>

namespace qcommit::plugin {
namespace {

// Progress numbers are rounded to 6 decimal places.
constexpr double kProgressScale = 1e6;

json::Ordered number_or_null(std::optional<double> v) {
  return v ? json::Ordered(std::round(*v * kProgressScale) / kProgressScale)
           : json::Ordered(nullptr);
}

std::optional<double> number_member(const json::Value& o, const char* key) {
  const json::Value* v = json::member(o, key);
  if (!v || !v->is_number()) return std::nullopt;
  return v->get<double>();
}

// A byte count the daemon sent, exact (0 when absent or not a count).
std::uint64_t count_member(const json::Value& o, const char* key) {
  const json::Value* v = json::member(o, key);
  return v ? json::to_uint64(*v).value_or(0) : 0;
}

}  // namespace

JobProgress progress_of(const JobStatus& j) {
  JobProgress p;
  p.type = to_string(j.type);
  p.bytes_left = j.bytes_left;
  p.speed_bytes_per_s = j.speed_bytes_per_s;
  p.window_bytes = j.window_bytes;
  p.eta_s = j.eta_s;
  p.phase = j.phase;
  p.probe = to_string(j.probe);
  p.probe_off_reason = j.probe_off_reason;
  if (j.latency_p99) p.p99_ms = std::chrono::duration<double, std::milli>(*j.latency_p99).count();
  p.converging = j.converging;
  p.converge_floor_bytes_per_s = j.converge_floor_bytes_per_s;
  return p;
}

JobProgress progress_of_status(const json::Value& job) {
  JobProgress p;
  p.type = json::string_member(job, "type");
  p.bytes_left = count_member(job, "bytes_left");
  p.speed_bytes_per_s = count_member(job, "speed_bytes_per_s");
  p.window_bytes = count_member(job, "window_bytes");
  p.p99_ms = number_member(job, "latency_p99_ms");
  p.eta_s = number_member(job, "eta_s");
  if (const json::Value* c = json::member(job, "converging"); c && c->is_boolean())
    p.converging = c->get<bool>();
  p.converge_floor_bytes_per_s = number_member(job, "converge_floor_bytes_per_s").value_or(0);
  p.phase = json::string_member(job, "phase");
  p.probe = json::string_member(job, "probe");
  p.probe_off_reason = json::string_member(job, "probe_off_reason");
  return p;
}

json::Ordered progress_json(const JobProgress& j, std::optional<double> percent) {
  return json::Ordered{{"event", "progress"},
                       {"type", j.type},
                       {"bytes_left", j.bytes_left},
                       {"speed_bytes_per_s", j.speed_bytes_per_s},
                       {"window_bytes", j.window_bytes},
                       {"latency_p99_ms", number_or_null(j.p99_ms)},
                       {"phase", j.phase},
                       {"percent", number_or_null(percent)},
                       {"eta_s", number_or_null(j.eta_s)},
                       {"converging", j.converging ? json::Ordered(*j.converging) : json::Ordered(nullptr)},
                       {"converge_floor_bytes_per_s", j.converge_floor_bytes_per_s},
                       {"probe", j.probe},
                       {"probe_off_reason", j.probe_off_reason}};
}

}  // namespace qcommit::plugin
