// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit live`'s two pacings: the governor in-process, or qcommitd's status over its socket.
#include "cli/live_pacing.h"

#include <cstdio>
#include <optional>
#include <utility>

#include "cli/daemon.h"
#include "plugin/govern/writeback.h"
#include "plugin/host/json.h"
#include "throttle/backoff.h"

namespace qcommit::cli {
namespace {

using plugin::JobProgress;
using plugin::TimePoint;

// qcommitd's governor, run in this process for this one disk.
class InProcessPacing final : public LivePacing {
 public:
  InProcessPacing(plugin::Hypervisor& hv, const LiveArgs& a, const plugin::DaemonConfig& cfg,
                  const plugin::GovernorOptions& opt)
      : files_(a.page_cache,
               [json = a.json_out](const std::string& m) {
                 if (!json) std::fprintf(stderr, "qcommit live: %s\n", m.c_str());
               }),
        gov_(hv, files_, cfg, opt) {}
  TimePoint step(TimePoint now) override { return gov_.step(now); }
  std::vector<JobProgress> progress(TimePoint now) override;
  void release_all() override { gov_.release_all(); }
  const char* job_left_running() const override { return "continues at a finishing speed"; }
  bool settled_for_pivot(const std::string& domain, const std::string& disk,
                         TimePoint now) override {
    return gov_.settled_for_pivot(domain, disk, now);
  }

 private:
  plugin::SystemTargetFiles files_;
  plugin::Governor gov_;
};

std::vector<JobProgress> InProcessPacing::progress(TimePoint now) {
  std::vector<JobProgress> out;
  for (const auto& j : gov_.status(now).jobs) out.push_back(plugin::progress_of(j));
  return out;
}

// qcommitd governs every block job on its connection, ours included: progress is its status.
// The job order's own connection is reconnected here (in-process, the governor does it).
class DaemonPacing final : public LivePacing {
 public:
  DaemonPacing(plugin::Hypervisor& hv, std::string socket, std::string domain, std::string disk)
      : hv_(hv), socket_(std::move(socket)), domain_(std::move(domain)), disk_(std::move(disk)) {}
  TimePoint step(TimePoint now) override;
  std::vector<JobProgress> progress(TimePoint now) override;
  void release_all() override {}
  const char* job_left_running() const override { return "continues under qcommitd"; }

 private:
  plugin::Hypervisor& hv_;
  std::string socket_, domain_, disk_;
  // Reconnects back off as the governor's do.
  throttle::Backoff reconnect_{plugin::GovernorOptions{}.reconnect_min,
                               plugin::GovernorOptions{}.reconnect_max};
};

TimePoint DaemonPacing::step(TimePoint now) {
  if (hv_.connected())
    reconnect_.succeeded();
  else if (reconnect_.due(now) && !hv_.connect())
    reconnect_.failed(now);
  return now + kEventWait;
}

std::vector<JobProgress> DaemonPacing::progress(TimePoint) {
  std::string error;
  const std::optional<std::string> line =
      ask_qcommitd(socket_, json::dump(json::Ordered{{"cmd", "status"}}), error);
  std::optional<json::Value> v;
  if (line) v = json::parse(*line, json::kControlResponseLimits, &error);
  const json::Value* jobs = v ? json::member(*v, "jobs") : nullptr;
  std::vector<JobProgress> out;
  if (!jobs || !jobs->is_array()) return out;
  for (const auto& j : *jobs) {
    if (json::string_member(j, "domain") != domain_ || json::string_member(j, "disk") != disk_)
      continue;
    out.push_back(plugin::progress_of_status(j));
  }
  return out;
}

}  // namespace

std::unique_ptr<LivePacing> in_process_pacing(plugin::Hypervisor& hv, const LiveArgs& a,
                                              const plugin::DaemonConfig& cfg,
                                              const plugin::GovernorOptions& opt) {
  return std::make_unique<InProcessPacing>(hv, a, cfg, opt);
}

std::unique_ptr<LivePacing> daemon_pacing(plugin::Hypervisor& hv, std::string socket,
                                          std::string domain, std::string disk) {
  return std::make_unique<DaemonPacing>(hv, std::move(socket), std::move(domain), std::move(disk));
}

}  // namespace qcommit::cli
