// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit live`'s pacing of the jobs it starts: qcommitd's governor run in this process for the
// one disk, or qcommitd itself when it answers on its socket (it governs every job of its
// connection; progress is then its status).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cli/live_args.h"
#include "plugin/govern/governor.h"
#include "plugin/hypervisor/hypervisor.h"
#include "plugin/live/progress.h"

namespace qcommit::cli {

// The longest the loop waits for hypervisor events; it wakes earlier when the governor's next
// step is due (its pacer and chunk gate work in 2 ms steps).
inline constexpr auto kEventWait = std::chrono::milliseconds(20);

class LivePacing {
 public:
  virtual ~LivePacing() = default;
  // Runs what is due; returns when it is next due.
  [[nodiscard]] virtual plugin::TimePoint step(plugin::TimePoint now) = 0;
  [[nodiscard]] virtual std::vector<plugin::JobProgress> progress(plugin::TimePoint now) = 0;
  // The jobs get a finishing speed (in-process) or stay governed (qcommitd).
  virtual void release_all() = 0;
  // What happens to a job this command leaves running.
  [[nodiscard]] virtual const char* job_left_running() const = 0;
  // Whether the disk's job may pivot now (plugin::Governor::settled_for_pivot); qcommitd
  // governing the job: at once.
  [[nodiscard]] virtual bool settled_for_pivot(const std::string& domain, const std::string& disk,
                                               plugin::TimePoint now) {
    (void)domain, (void)disk, (void)now;
    return true;
  }
};

// qcommitd's governor in this process, for the disk `a` names.
[[nodiscard]] std::unique_ptr<LivePacing> in_process_pacing(plugin::Hypervisor& hv,
                                                            const LiveArgs& a,
                                                            const plugin::DaemonConfig& cfg,
                                                            const plugin::GovernorOptions& opt);
// qcommitd (on `socket`) governing the job on `domain`'s `disk`.
[[nodiscard]] std::unique_ptr<LivePacing> daemon_pacing(plugin::Hypervisor& hv, std::string socket,
                                                        std::string domain, std::string disk);

}  // namespace qcommit::cli
