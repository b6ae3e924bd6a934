// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit live DOMAIN DISK: a governed merge of a running domain's disk, started by qcommit.
// qcommit live --qmp SOCKET DISK: the same on a QEMU that libvirt does not manage, over QMP.
// Glue, in named steps: options (cli/live_args.cpp), the connection (libvirt's event loop or the
// QMP socket), the wait for a block job somebody else runs on the disk, the plan, then the loop
// that runs the job order (plugin/live/live.cpp) beside the pacing (cli/live_pacing.cpp:
// qcommitd's governor run in-process, or qcommitd itself when it answers on its socket) and
// shows progress.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/daemon.h"
#include "cli/json.h"
#include "cli/live_args.h"
#include "cli/live_pacing.h"
#include "cli/merge_policy.h"
#include "cli/options.h"
#include "cli/units.h"
#include "cli/wait_event.h"
#include "common/defaults.h"
#include "plugin/govern/governor.h"
#include "plugin/govern/writeback.h"
#include "plugin/host/event_loop.h"
#include "plugin/host/json.h"
#include "plugin/host/mono_clock.h"
#include "plugin/hypervisor/libvirt_hypervisor.h"
#include "plugin/hypervisor/qmp_hypervisor.h"
#include "plugin/live/live.h"
#include "plugin/live/progress.h"
#include "plugin/policy/command_policy.h"

namespace qcommit::cli {
namespace {

using plugin::Duration;
using plugin::EventLoop;
using plugin::JobProgress;
using plugin::mono_now;
using plugin::TimePoint;

// `--qmp`: QEMU serves its QMP socket until it exits, so a connection that cannot be
// re-established for this long means QEMU is gone.
constexpr auto kQmpReconnectGiveUp = std::chrono::seconds(10);
// How often progress is shown (and, under qcommitd, asked of it).
constexpr auto kProgressEvery = std::chrono::seconds(1);

// ---- the connection ----

// What differs between the libvirt and the QMP backend while the merge runs.
struct LiveBackend {
  plugin::Hypervisor& hv;
  plugin::BlockJobControl& ctl;
  // Runs the event loop for at most the given time (1 ms .. kEventWait); false: broken.
  std::function<bool(std::chrono::milliseconds)> wait_events;
  std::string job_hint;    // where to look at a job left running
  std::string pivot_hint;  // how to pivot a job left ready
  // --qmp: give up when the connection stays lost this long; libvirt: wait for libvirtd.
  std::optional<Duration> give_up_after;
  std::function<std::string()> lost_message;
  std::function<std::string()> job_error;  // QEMU's last job error, "" when none
};

// The hypervisor connection, libvirt's or a QMP socket's, and the backend over it.
class LiveConnection {
 public:
  explicit LiveConnection(LiveArgs& a) : a_(a) {}

  void open() { a_.qmp.empty() ? open_libvirt() : open_qmp(); }
  [[nodiscard]] plugin::DomainInfo domain();
  [[nodiscard]] LiveBackend backend();

 private:
  void open_libvirt();
  void open_qmp();

  LiveArgs& a_;
  std::unique_ptr<EventLoop> loop_;  // libvirt's; outlives the connection
  std::unique_ptr<plugin::LibvirtHypervisor> lv_;
  std::unique_ptr<plugin::QmpHypervisor> qm_;
};

void LiveConnection::open_libvirt() {
  try {
    loop_ = std::make_unique<EventLoop>(kEventWait);
  } catch (const plugin::EventLoopError&) {
    throw LiveError("cannot set up the libvirt event loop");
  }
  lv_ = std::make_unique<plugin::LibvirtHypervisor>(a_.uri);
  if (!lv_->connect()) throw LiveError(a_.uri + ": " + lv_->last_error());
}

void LiveConnection::open_qmp() {
  qm_ = std::make_unique<plugin::QmpHypervisor>(a_.qmp);
  try {
    if (!qm_->connect()) throw LiveError(qm_->last_error());
    a_.req.domain = qm_->name();
    if (std::optional<std::string> target = qm_->resolve_disk(a_.req.disk)) a_.req.disk = *target;
  } catch (const plugin::HypervisorDisconnected& e) {
    throw LiveError(e.what());
  }
}

plugin::DomainInfo LiveConnection::domain() {
  std::optional<plugin::DomainInfo> dom;
  try {
    dom = lv_ ? lv_->domain(a_.req.domain) : qm_->domain(a_.req.domain);
  } catch (const plugin::HypervisorDisconnected& e) {
    throw LiveError(e.what());
  }
  if (dom) return *dom;
  if (lv_) throw LiveError(a_.req.domain + ": no running domain of that name on " + a_.uri);
  throw LiveError(a_.qmp + ": no domain");
}

LiveBackend LiveConnection::backend() {
  const std::string& d = a_.req.domain;
  const std::string& k = a_.req.disk;
  if (lv_) {
    EventLoop& loop = *loop_;
    return LiveBackend{*lv_,
                       *lv_,
                       [&loop](std::chrono::milliseconds wait) { return loop.run_once(wait); },
                       "'virsh blockjob " + d + " " + k + " --info'",
                       "'virsh blockjob " + d + " " + k + " --pivot'",
                       std::nullopt,
                       nullptr,
                       nullptr};
  }
  plugin::QmpHypervisor& q = *qm_;
  return LiveBackend{
      q,
      q,
      [&q](std::chrono::milliseconds wait) {
        q.pump(wait);
        return true;
      },
      "query-block-jobs on " + a_.qmp,
      "QMP block-job-complete of job " + plugin::qcommit_job_id(k) + " on " + a_.qmp,
      std::chrono::duration_cast<Duration>(kQmpReconnectGiveUp),
      [&q] { return "lost the QMP connection and could not reconnect: " + q.last_error(); },
      [&q] { return q.last_job_error(); }};
}

// ---- before the plan ----

// Somebody else's block job on the disk (a backup, an operator's commit, a job a previous run
// left at its finishing speed) is waited out for at most --wait, saying once what is awaited.
// Whether there was one to wait for (the chain may then have changed).
[[nodiscard]] bool wait_for_foreign_job(LiveBackend& be, const LiveArgs& a) {
  plugin::ForeignJobWait w(be.hv, a.req.domain, a.req.disk, a.wait_limit);
  bool said = false;
  for (;;) {
    plugin::ForeignJobWait::State st;
    try {
      st = w.poll(mono_now());
    } catch (const plugin::HypervisorDisconnected& e) {
      throw LiveError(e.what());
    }
    if (st == plugin::ForeignJobWait::State::kClear) return said;
    if (st == plugin::ForeignJobWait::State::kTimedOut) {
      throw LiveError(w.describe_job() + " was not started by qcommit live and " +
                      (a.wait_limit == Duration::zero() ? std::string("--wait is 0")
                                                        : "did not end within " + a.wait) +
                      "; see " + be.job_hint);
    }
    if (!said) {
      said = true;
      engine::WaitNotice n;
      n.what = engine::WaitFor::kBlockJob;
      n.message = "waiting up to " + a.wait + " for " + w.describe_job() + " to end";
      n.timeout = a.wait_limit;
      n.domain = a.req.domain;
      n.disk = a.req.disk;
      n.job = w.job() ? to_string(w.job()->type) : "unknown";
      if (w.job() && w.job()->end > 0)
        n.percent = 100.0 * static_cast<double>(w.job()->cur) / static_cast<double>(w.job()->end);
      show_wait(n, a.json_out, "qcommit live");
    }
    if (!be.wait_events(std::chrono::duration_cast<std::chrono::milliseconds>(
            plugin::ForeignJobWait::kRecheck)))
      throw LiveError("the event loop failed while waiting for " + w.describe_job());
  }
}

// A --top/--base path as the chain spells it, also when given relative or through symlinks (the
// chain holds the paths QEMU opened).
std::string as_in_chain(const std::string& path, const plugin::DiskInfo& disk) {
  std::vector<std::string> chain{disk.source};
  chain.insert(chain.end(), disk.backing_chain.begin(), disk.backing_chain.end());
  if (path.empty() || std::find(chain.begin(), chain.end(), path) != chain.end()) return path;
  auto real = [](const std::string& p) -> std::string {
    char* r = ::realpath(p.c_str(), nullptr);
    if (!r) return "";
    std::string out = r;
    std::free(r);
    return out;
  };
  const std::string want = real(path);
  for (const auto& c : chain)
    if (!want.empty() && real(c) == want) return c;
  return path;
}

// The disk the request names (target or active layer's path); the request then says its target
// and TOP/BASE as the chain spells them.
plugin::DiskInfo find_disk(const plugin::DomainInfo& dom, LiveArgs& a) {
  for (const auto& d : dom.disks) {
    if (d.target != a.req.disk && d.source != a.req.disk) continue;
    a.req.disk = d.target;
    a.req.top = as_in_chain(a.req.top, d);
    a.req.base = as_in_chain(a.req.base, d);
    return d;
  }
  std::string known;
  for (const auto& d : dom.disks) known += (known.empty() ? "" : ", ") + d.target;
  throw LiveError((a.qmp.empty() ? "" : a.qmp + ": ") + a.req.domain + ": no disk '" + a.req.disk +
                  "' (disks: " + (known.empty() ? "none" : known) + ")");
}

std::vector<plugin::LiveStep> plan(const LiveArgs& a, const plugin::DiskInfo& disk) {
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d%H%M%S", std::gmtime(&t));
  const std::string fresh =
      plugin::fresh_overlay_path(a.req.top.empty() ? disk.source : a.req.top, stamp, a.overlay_dir);
  try {
    return plugin::plan_live(a.req, disk, fresh);
  } catch (const plugin::BlockJobError& e) {
    throw LiveError(e.what());
  }
}

void print_plan(const LiveArgs& a, const std::vector<plugin::LiveStep>& steps,
                const std::string& governor) {
  if (a.json_out) {
    json::Ordered described = json::Ordered::array();
    for (const auto& step : steps) described.push_back(step.describe());
    print_json(json::Ordered{{"event", "plan"},
                             {"domain", a.req.domain},
                             {"disk", a.req.disk},
                             {"strategy", to_string(a.req.strategy)},
                             {"budget", a.budget},
                             {"governor", governor},
                             {"dry_run", a.dry_run},
                             {"steps", described}});
  } else {
    std::printf("qcommit live: %s %s, strategy %s, budget %s, governed by %s\n",
                a.req.domain.c_str(), a.req.disk.c_str(), to_string(a.req.strategy),
                a.budget.c_str(), governor.c_str());
    for (size_t i = 0; i < steps.size(); ++i)
      std::printf("  %zu. %s\n", i + 1, steps[i].describe().c_str());
  }
  std::fflush(stdout);
}

// ---- the run ----

std::string eta_text(double s) {
  if (s >= 3600)
    return std::to_string(static_cast<long>(s / 3600)) + " h " +
           std::to_string(static_cast<long>(s / 60) % 60) + " min";
  if (s >= 60)
    return std::to_string(static_cast<long>(s / 60)) + " min " +
           std::to_string(static_cast<long>(s) % 60) + " s";
  return std::to_string(static_cast<long>(s + 0.5)) + " s";
}

// Percent of the running job done, from the job's own counters (cur/end); nullopt before the
// first reading.
std::optional<double> percent_done(const std::optional<plugin::JobInfo>& info) {
  if (!info || info->end == 0) return std::nullopt;
  return 100.0 * static_cast<double>(info->cur) / static_cast<double>(info->end);
}

// "  commit: 42%, 512.0 MiB left, 12.0 MiB/s, ETA 43 s, guests' p99 4.1 ms, window 4.0 MiB (phase)"
void print_progress_line(const JobProgress& j, std::optional<double> percent) {
  char pct[16] = "";
  if (percent) std::snprintf(pct, sizeof pct, "%.0f%%, ", *percent);
  char p99[32] = "-";
  if (j.p99_ms) std::snprintf(p99, sizeof p99, "%.1f ms", *j.p99_ms);
  std::fprintf(stderr, "  %s: %s%s left, %s/s, ETA %s, guests' p99 %s, window %s (%s)\n",
               j.type.c_str(), pct, format_size(j.bytes_left).c_str(),
               format_size(j.speed_bytes_per_s).c_str(), j.eta_s ? eta_text(*j.eta_s).c_str() : "-",
               p99, format_size(j.window_bytes).c_str(), j.phase.c_str());
}

// The loop: the job order's next step, the pacing, progress once a second, the event wait.
class LiveRun {
 public:
  LiveRun(LiveBackend& be, const LiveArgs& a, std::vector<plugin::LiveStep> steps,
          LivePacing& pacing)
      : be_(be), a_(a), pacing_(pacing), merge_(be.ctl, be.hv, std::move(steps), a.req) {
    merge_.set_pivot_gate([this](TimePoint now) {
      return pacing_.settled_for_pivot(a_.req.domain, a_.req.disk, now);
    });
  }
  [[nodiscard]] int run();

 private:
  [[nodiscard]] bool connection_given_up(TimePoint now);
  void show_step();
  void report(TimePoint now);
  [[nodiscard]] int finish(bool loop_broken);
  [[nodiscard]] int fail(const std::string& message);

  LiveBackend& be_;
  const LiveArgs& a_;
  LivePacing& pacing_;
  plugin::LiveMerge merge_;
  std::size_t shown_step_ = static_cast<std::size_t>(-1);
  TimePoint next_report_{};
  std::optional<TimePoint> lost_since_;
  std::string probe_off_shown_;  // the reason the probe is off, once said
};

// A lost connection (libvirtd restarting, QEMU's QMP socket gone) is waited for: said once when
// it is lost (a line on stderr, a "wait" event for "connection"), given up after
// give_up_after (--qmp) or never (libvirt).
bool LiveRun::connection_given_up(TimePoint now) {
  if (be_.hv.connected()) {
    lost_since_.reset();
    return false;
  }
  if (!lost_since_) {
    lost_since_ = now;
    engine::WaitNotice n;
    n.what = engine::WaitFor::kConnection;
    n.message = "lost the connection to " +
                (a_.qmp.empty() ? "libvirtd (" + a_.uri + ")" : a_.qmp) + "; waiting " +
                (be_.give_up_after
                     ? "up to " +
                           std::to_string(
                               std::chrono::duration_cast<std::chrono::seconds>(*be_.give_up_after)
                                   .count()) +
                           " s"
                     : std::string("for it")) +
                " while the block job runs on in QEMU";
    if (be_.give_up_after) n.timeout = *be_.give_up_after;
    if (a_.qmp.empty())
      n.uri = a_.uri;
    else
      n.qmp = a_.qmp;
    show_wait(n, a_.json_out, "qcommit live");
  }
  return be_.give_up_after && now - *lost_since_ > *be_.give_up_after;
}

void LiveRun::show_step() {
  if (merge_.current() == shown_step_ || merge_.current() >= merge_.steps().size()) return;
  shown_step_ = merge_.current();
  const std::string what = merge_.steps()[shown_step_].describe();
  if (a_.json_out)
    print_json(json::Ordered{{"event", "step"}, {"step", shown_step_ + 1}, {"description", what}});
  else
    std::printf("step %zu: %s\n", shown_step_ + 1, what.c_str());
  std::fflush(stdout);
}

void LiveRun::report(TimePoint now) {
  if (now < next_report_) return;
  next_report_ = now + kProgressEvery;
  const std::optional<double> pct = percent_done(merge_.last_info());
  for (const auto& j : pacing_.progress(now)) {
    if (a_.json_out) {
      print_json(plugin::progress_json(j, pct));
    } else {
      print_progress_line(j, pct);
      // A probe the policy asks for but that is off: said once (per reason).
      if (j.probe == "off" && j.probe_off_reason != probe_off_shown_) {
        std::fprintf(stderr, "qcommit live: shared-queue probe off: %s\n",
                     j.probe_off_reason.c_str());
        probe_off_shown_ = j.probe_off_reason;
      }
    }
  }
}

int LiveRun::run() {
  EventLoop::install_stop_signals();
  bool running = true;
  while (running && !EventLoop::stop_requested()) {
    const auto now = mono_now();
    if (connection_given_up(now)) {
      pacing_.release_all();
      return fail(be_.lost_message());
    }
    try {
      running = merge_.step(now);
    } catch (const plugin::HypervisorDisconnected&) {
      // The governor reconnects; the job order waits for it.
    }
    const TimePoint pacing_next = pacing_.step(now);
    show_step();
    report(now);
    // Until the pacing's next step (the chunk gate closes 2 ms after it opens), at most
    // kEventWait, at least 1 ms.
    const auto until = std::chrono::ceil<std::chrono::milliseconds>(pacing_next - mono_now());
    if (running && !be_.wait_events(std::clamp(until, std::chrono::milliseconds(1), kEventWait)))
      return finish(true);
  }
  return finish(false);
}

int LiveRun::fail(const std::string& message) {
  std::fprintf(stderr, "qcommit live: %s\n", message.c_str());
  return kExitError;
}

int LiveRun::finish(bool loop_broken) {
  pacing_.release_all();
  const std::string where = "at step " + std::to_string(merge_.current() + 1) +
                            "; the running block job (if any) " + pacing_.job_left_running() +
                            ": see " + be_.job_hint;
  if (EventLoop::stop_requested()) return fail("interrupted " + where);
  if (loop_broken && !merge_.error()) return fail("the event loop failed " + where);
  if (merge_.error()) {
    const std::string job_error = be_.job_error ? be_.job_error() : "";
    if (job_error.empty() || merge_.error()->find(job_error) != std::string::npos)
      return fail(*merge_.error());
    return fail(*merge_.error() + " (QEMU: " + job_error + ")");
  }
  if (a_.json_out) {
    print_json(json::Ordered{{"event", "result"},
                             {"domain", a_.req.domain},
                             {"disk", a_.req.disk},
                             {"outcome", merge_.left_ready() ? "ready" : "done"}});
  } else if (merge_.left_ready()) {
    std::printf("qcommit live: active commit ready (mirroring); pivot with %s\n",
                be_.pivot_hint.c_str());
  } else {
    std::printf("qcommit live: done\n");
  }
  return kExitOk;
}

// The governor's configuration for this one disk (--budget, the built-in defaults):
// plugin::live_policy's; the job starts at its initial speed.
plugin::DaemonConfig live_config(LiveArgs& a) {
  plugin::LivePolicyInputs in;
  in.uri = a.uri;
  in.budget = parse_budget(a.budget);
  if (!a.probe.empty()) in.probe = a.probe;
  in.max_rate_bytes_per_s = a.max_rate_bytes_per_s;
  if (auto e = in.validate()) throw UsageError(*e);
  try {
    plugin::LivePolicy lp = plugin::live_policy(in);
    a.req.initial_speed_bytes_per_s = static_cast<std::uint64_t>(lp.initial_speed_bytes_per_s);
    return std::move(lp.config);
  } catch (const plugin::ConfigError& e) {
    throw UsageError(e.what());
  }
}

plugin::GovernorOptions live_governor_options(const LiveArgs& a) {
  plugin::GovernorOptions opt;
  opt.settle_every = plugin::settle_interval_for(plugin::dirty_expire());
  opt.only_disk = std::make_pair(a.req.domain, a.req.disk);
  opt.max_rate_bytes_per_s = a.max_rate_bytes_per_s;
  if (auto e = opt.validate()) throw LiveError(*e);
  return opt;
}

int live(LiveArgs& a) {
  const plugin::DaemonConfig cfg = live_config(a);
  // qcommitd governs the domains of its own connection: not a QEMU reached with --qmp, nor
  // (as far as this command can tell) one on another connection named with -c.
  const bool daemon = a.qmp.empty() && (!a.uri_given || a.uri == defaults::kUri) &&
                      qcommitd_answers(a.daemon_socket);
  LiveConnection conn(a);
  conn.open();
  plugin::DiskInfo disk = find_disk(conn.domain(), a);  // its target names it from here on
  LiveBackend be = conn.backend();
  if (!a.dry_run && wait_for_foreign_job(be, a))
    disk = find_disk(conn.domain(), a);  // the chain the awaited job left
  const std::vector<plugin::LiveStep> steps = plan(a, disk);
  print_plan(a, steps, daemon ? "qcommitd (" + a.daemon_socket + ")" : "qcommit live");
  if (a.dry_run) return kExitOk;
  if (daemon && a.budget_given && !a.json_out)
    std::fprintf(stderr,
                 "qcommit live: qcommitd governs with its own policy: --budget is not used\n");
  if (daemon && !a.probe.empty() && !a.json_out)
    std::fprintf(stderr,
                 "qcommit live: qcommitd governs with its own policy: --probe is not used (set "
                 "probe= in the policy of its pool)\n");
  if (daemon && a.max_rate_bytes_per_s)
    std::fprintf(
        stderr,
        "qcommit live: qcommitd governs with its own policy: --max-rate only sets the "
        "job's starting speed (cap it with ceiling= in the policy of its pool or domain)\n");
  std::unique_ptr<LivePacing> pacing;
  if (daemon) {
    pacing = daemon_pacing(be.hv, a.daemon_socket, a.req.domain, a.req.disk);
  } else {
    if (!a.json_out)
      std::fprintf(stderr, "qcommit live: page cache: %s\n",
                   plugin::describe_page_cache_source(a.page_cache).c_str());
    pacing = in_process_pacing(be.hv, a, cfg, live_governor_options(a));
  }
  LiveRun run(be, a, steps, *pacing);
  return run.run();
}

}  // namespace

int cmd_live(const Args& args) {
  LiveArgs a;
  try {
    if (!parse_live_args(args, a)) return kExitOk;
    return live(a);
  } catch (const LiveError& e) {
    std::fprintf(stderr, "qcommit live: %s\n", e.what());
    return kExitError;
  }
}

}  // namespace qcommit::cli
