// SPDX-License-Identifier: GPL-2.0-or-later
// What `qcommit merge` shows while it runs: the engine's progress as JSON lines or a terminal bar,
// and at least once a second even when the engine reports nothing (a long request at a low rate,
// a wait for a lock, planning a large chain): the last state again, with the time advanced and
// the average rate and ETA recomputed.
#pragma once

#include <chrono>
#include <condition_variable>
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

 private:
  using Clock = std::chrono::steady_clock;
  void show(const engine::Progress& p);  // with mu_ held
  void heartbeat();
  // The last state with `since` seconds more elapsed: the average rate over the copy so far.
  [[nodiscard]] static engine::Progress advanced(const engine::Progress& p, double since);

  Output out_;
  bool bar_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::optional<engine::Progress> last_;  // as the engine reported it
  Clock::time_point last_at_{};           // when the engine reported it
  Clock::time_point shown_at_{};          // when anything was last shown
  std::thread thread_;
};

}  // namespace qcommit::cli
