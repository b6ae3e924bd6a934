// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/daemon/trace_file.h"

#include <sys/stat.h>

#include <cmath>
#include <limits>

#include "common/log_field.h"
#include "common/safe_file.h"
#include "common/trace_csv.h"
#include "plugin/policy/config.h"

namespace qcommit::plugin {
namespace {

std::string trace_header() {
  return trace_csv::header_line({"t_s", "domain", "disk", "speed_bytes_per_s", "window_bytes",
                                 "backlog_bytes", "latency_p99_ms", "bytes_left", "phase",
                                 "delay_measured_ms", "delay_charged_ms", "own_queue_bytes",
                                 "own_queue_rate_bytes_per_s"});
}

// Milliseconds, NaN (an empty field) when unknown.
double ms_or_nan(const std::optional<Duration>& d) {
  return d ? std::chrono::duration<double, std::milli>(*d).count()
           : std::numeric_limits<double>::quiet_NaN();
}

std::string trace_row(const JobStatus& j, double t) {
  using std::to_string;
  return trace_csv::row_line(
      {trace_csv::fixed(t, 3), j.domain, j.disk, to_string(j.speed_bytes_per_s),
       to_string(j.window_bytes), to_string(j.backlog_bytes),
       trace_csv::fixed(ms_or_nan(j.latency_p99), 1), to_string(j.bytes_left), j.phase,
       trace_csv::fixed(ms_or_nan(j.delay_measured), 2), trace_csv::fixed(ms_or_nan(j.delay_charged), 2),
       j.own_queue_bytes ? to_string(*j.own_queue_bytes) : std::string(),
       trace_csv::fixed(j.own_queue_rate_bytes_per_s, 0)});
}

}  // namespace

TraceFile::TraceFile(const std::string& path) {
  if (path.empty()) return;
  // Appended to; never through a symlink or into a FIFO or someone else's file (safe_file.h).
  safe_file::Opened out = safe_file::open_output(path, safe_file::OutputMode::kAppend);
  if (!out.ok())
    throw ConfigError(log_field(path) + ": cannot open the trace file: " + out.problem);
  struct stat sb {};
  const bool empty = ::fstat(out.fd.get(), &sb) == 0 && sb.st_size == 0;
  f_ = ::fdopen(out.fd.get(), "a");
  if (!f_) throw ConfigError(log_field(path) + ": cannot open the trace file");
  (void)out.fd.release();  // the FILE owns it now
  if (empty) std::fputs(trace_header().c_str(), f_);
}

TraceFile::~TraceFile() {
  if (f_) std::fclose(f_);
}

void TraceFile::write(const GovernorStatus& st, TimePoint now) {
  if (!f_ || now < next_) return;
  next_ = now + kTraceInterval;
  const double t = std::chrono::duration<double>(now.time_since_epoch()).count();
  for (const auto& j : st.jobs) std::fputs(trace_row(j, t).c_str(), f_);
  std::fflush(f_);
}

}  // namespace qcommit::plugin
