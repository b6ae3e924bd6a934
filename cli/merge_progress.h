// SPDX-License-Identifier: GPL-2.0-or-later
// What `qcommit merge` shows while it runs: the engine's progress as JSON lines, a terminal bar,
// or (human output that is not a terminal: a log file, the journal) a plain line every
// kPlainLineInterval; JSON and the bar at least once a second even when the engine reports
// nothing (a long request at a low rate, a wait for a lock, planning a large chain): the last
// state again, with the time advanced and the average rate and ETA recomputed. Governed, each
// shows the guests' p99 latency since the previous one.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "cli/options.h"
#include "engine/merge.h"
#include "engine/wait_notice.h"

namespace qcommit::cli {

// The longest time without a progress line or event while a merge runs.
inline constexpr std::chrono::milliseconds kProgressHeartbeat{1000};
// How often a plain progress line is written where no bar can be drawn.
inline constexpr std::chrono::seconds kPlainLineInterval{5};

class MergeProgress {
 public:
  // `bar`: draw the terminal bar (human output on a terminal); JSON lines with Output::kJson.
  // `heartbeat`: show the last state again after kProgressHeartbeat without news.
  MergeProgress(Output out, bool bar, bool heartbeat);
  ~MergeProgress();
  MergeProgress(const MergeProgress&) = delete;
  MergeProgress& operator=(const MergeProgress&) = delete;

  // engine::MergeOptions::on_progress and on_lock_wait.
  void on_progress(const engine::Progress& p);
  void on_lock_wait(const engine::WaitNotice& notice);
  // Ends the heartbeat (before the result is printed).
  void stop();
  // Where the guests' p99 latency since the previous call comes from (a governed merge).
  void set_p99_source(std::function<std::optional<std::chrono::nanoseconds>()> source);
  // Ends the bar's line, so that a message written next starts on a line of its own.
  void break_line();

 private:
  using Clock = std::chrono::steady_clock;
  void show(const engine::Progress& p);  // with mu_ held
  void print_plain(const engine::Progress& p);  // with mu_ held
  void break_line_locked();
  void heartbeat();
  // The last state with `since` seconds more elapsed: the average rate over the copy so far.
  [[nodiscard]] static engine::Progress advanced(const engine::Progress& p, double since);

  Output out_;
  bool bar_;
  bool bar_open_ = false;  // the bar is drawn and its line not ended
  std::function<std::optional<std::chrono::nanoseconds>()> p99_;
  Clock::time_point plain_at_{};  // when the last plain line was written
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::optional<engine::Progress> last_;  // as the engine reported it
  Clock::time_point last_at_{};           // when the engine reported it
  Clock::time_point shown_at_{};          // when anything was last shown
  std::thread thread_;
};

}  // namespace qcommit::cli
