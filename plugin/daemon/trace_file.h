// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd --trace FILE: one CSV row per governed job every kTraceInterval, in the trace format
// qcommit merge --trace writes (common/trace_csv.h): its header once, at the top of the file.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "plugin/govern/governor.h"

namespace qcommit::plugin {

// How often the trace gets its rows.
inline constexpr auto kTraceInterval = std::chrono::milliseconds(100);

class TraceFile {
 public:
  // Appends to `path` (nothing for ""); the header goes in when the file is empty. Throws
  // ConfigError when the file cannot be opened.
  explicit TraceFile(const std::string& path);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;
  // A row per job of `st` when kTraceInterval has passed since the last rows; t_s is `now` on the
  // monotonic clock, in seconds.
  void write(const GovernorStatus& st, TimePoint now);

 private:
  FILE* f_ = nullptr;
  TimePoint next_{};
};

}  // namespace qcommit::plugin
