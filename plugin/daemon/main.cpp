// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd: governs libvirt block jobs (commit, active commit, pull, copy) so that snapshot
// merges stay within a latency budget of the guests sharing the storage.  Glue, in named steps:
// options, the libvirt event loop, the control socket, the trace; the policy is in governor.cpp.
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/defaults.h"
#include "plugin/daemon/control.h"
#include "plugin/daemon/daemon_log.h"
#include "plugin/daemon/trace_file.h"
#include "plugin/govern/governor.h"
#include "plugin/govern/writeback.h"
#include "plugin/host/event_loop.h"
#include "plugin/host/mono_clock.h"
#include "plugin/hypervisor/libvirt_hypervisor.h"
#include "plugin/policy/command_policy.h"

namespace {

using namespace qcommit::plugin;
using qcommit::log_field;
namespace po = boost::program_options;

// How fresh the status (control socket, log decisions) is kept (the trace: kTraceInterval).
constexpr auto kStatusInterval = std::chrono::milliseconds(50);

// Exit codes: bad options 2, failures 1 (as qcommit's).
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

// ---- options ----

struct DaemonArgs {
  std::string config_path = qcommit::defaults::kConfigPath;
  bool config_given = false;
  std::string uri;          // empty: the configuration's
  std::string socket_path;  // empty: the configuration's
  std::string trace_path;
  std::string page_cache_name = "auto";
  PageCacheSource page_cache = PageCacheSource::kAuto;
  std::string throttle_filter = "on";
  std::string bdi_limit = "on";
};

constexpr const char* kSynopsis =
    "usage: qcommitd [--config PATH] [-c|--connect URI] [--socket PATH] [--trace FILE]\n"
    "                [--page-cache auto|no-cachestat|meminfo] [--throttle-filter on|off]\n"
    "                [--bdi-limit on|off] [--version]\n";

constexpr const char* kEpilogue =
    "Logs one line per connection change, job adopted, decision change and job released on\n"
    "stderr (see qcommitd(8)).\n"
    "examples:\n"
    "  qcommitd                      # as qcommitd.service runs it\n"
    "  qcommitd --connect qemu:///system --socket /tmp/q.sock --trace /var/tmp/qcommitd.csv\n";

po::options_description daemon_options(DaemonArgs& a) {
  using qcommit::defaults::kConfigPath;
  using qcommit::defaults::kSocketPath;
  using qcommit::defaults::kUri;
  po::options_description opts("options");
  opts.add_options()("help,h", "show this help")("version", "print the version")(
      "config", po::value(&a.config_path),
      (std::string("policy file (default ") + kConfigPath + "; missing = defaults)").c_str())(
      "connect,c", po::value(&a.uri),
      (std::string("libvirt connection URI (default ") + kUri + ")").c_str())(
      "uri", po::value(&a.uri), "the same as --connect")(
      "socket", po::value(&a.socket_path),
      (std::string("control socket (default ") + kSocketPath + ")").c_str())(
      "trace", po::value(&a.trace_path),
      "append governed jobs' speed/window/backlog/p99 every 100 ms (CSV)")(
      "page-cache", po::value(&a.page_cache_name),
      "where a target's dirty pages are read: auto (cachestat(2) where the kernel has it, else "
      "no-cachestat), no-cachestat (forced: what a kernel before 6.5 gets: completion-clocked "
      "writeback, QEMU's memory cgroup), no-cachestat-shadow (also logs cachestat's truth; "
      "tests) or meminfo (host-wide count, fdatasync pacing; diagnostics)")(
      "throttle-filter", po::value(&a.throttle_filter),
      "on (default): an active commit into a cache=none/directsync disk gets a QEMU throttle "
      "filter node under its target, through libvirt's monitor passthrough (libvirt marks the "
      "domain tainted), which spreads QEMU's 16 MiB copy bursts; off: the job's speed only")(
      "bdi-limit", po::value(&a.bdi_limit),
      "on (default): the storage of a job that escaped governance gets a kernel dirty limit "
      "(/sys/class/bdi/*/strict_limit and max_bytes, Linux 6.2 and later) while it runs; off: "
      "the job is only held at the floor");
  return opts;
}

// The options, or the exit code when the daemon is not to run (--help, --version, bad options).
std::optional<int> parse_daemon_args(int argc, char** argv, DaemonArgs& a, DaemonLog& log) {
  po::options_description opts = daemon_options(a);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    log.record(std::string(e.what()) + " (see qcommitd --help)");
    return kExitUsage;
  }
  if (vm.count("help")) {
    std::cout << kSynopsis << "\n" << opts << "\n" << kEpilogue;
    return 0;
  }
  if (vm.count("version")) {
    std::printf("qcommitd %s\n", QCOMMIT_VERSION);
    return 0;
  }
  a.config_given = vm.count("config") > 0;
  const auto src = parse_page_cache_source(a.page_cache_name);
  if (!src) {
    log.record("--page-cache: " + log_field(a.page_cache_name) +
               " is not auto, no-cachestat, no-cachestat-shadow or meminfo");
    return kExitUsage;
  }
  a.page_cache = *src;
  if (a.throttle_filter != "on" && a.throttle_filter != "off") {
    log.record("--throttle-filter: " + log_field(a.throttle_filter) + " is not on or off");
    return kExitUsage;
  }
  if (a.bdi_limit != "on" && a.bdi_limit != "off") {
    log.record("--bdi-limit: " + log_field(a.bdi_limit) + " is not on or off");
    return kExitUsage;
  }
  return std::nullopt;
}

// ---- pieces of the running daemon ----

// The libvirt hook's domain events arrive on the control thread: queued here, handed to the
// governor by the main loop (the control thread never touches the governor).
class HookEventQueue {
 public:
  void push(const std::string& domain, const std::string& event) {
    std::lock_guard<std::mutex> lk(mu_);
    if (events_.size() < kMaxQueuedHookEvents) events_.emplace_back(domain, event);
  }
  [[nodiscard]] std::vector<std::pair<std::string, std::string>> take() {
    std::vector<std::pair<std::string, std::string>> out;
    std::lock_guard<std::mutex> lk(mu_);
    out.swap(events_);
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> events_;
};

// The control socket's answer to "status": the latest snapshot, replaced by the main loop.
class StatusSnapshot {
 public:
  [[nodiscard]] std::string get() const {
    std::lock_guard<std::mutex> lk(mu_);
    return json_;
  }
  void set(std::string json) {
    std::lock_guard<std::mutex> lk(mu_);
    json_ = std::move(json);
  }

 private:
  mutable std::mutex mu_;
  std::string json_ = "{\"ok\":true,\"connected\":false,\"jobs\":[],\"released\":[]}";
};

// ---- set-up ----

// The policy file with the command line's overrides, validated.  Throws ConfigError.
DaemonConfig daemon_config(const DaemonArgs& a) {
  return with_overrides(load_config(a.config_path, !a.config_given),
                        {.config_path = a.config_path, .uri = a.uri, .socket_path = a.socket_path});
}

// The record of the kernel dirty limits set for escaped jobs (GovernorOptions::bdi_state_path),
// in the daemon's runtime directory: the control socket's (systemd's RuntimeDirectory, a tmpfs:
// no record outlives a reboot).
std::string bdi_state_path(const DaemonConfig& cfg) {
  const std::string::size_type slash = cfg.socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : cfg.socket_path.substr(0, slash);
  return (dir.empty() ? "/" : dir + "/") + "bdi-limits";
}

GovernorOptions governor_options(const DaemonArgs& a, const DaemonConfig& cfg, DaemonLog& log) {
  GovernorOptions opt;
  // Off: no limits set; the record a crashed daemon left is still restored.
  opt.bdi_state_path = bdi_state_path(cfg);
  opt.bdi_limits = a.bdi_limit == "on";
  opt.target_throttle = a.throttle_filter == "on";
  opt.notice = [&log](const std::string& m) { log.record(m); };
  opt.clock = mono_now;  // time to govern: stamps within a step
  opt.settle_every = settle_interval_for(dirty_expire());
  // GovernorOptions::wall_clock stays unset: slotted on CLOCK_REALTIME, the lab's qcd-commit row
  // took 78-82 s against 59 s (2026-12-02, quiet host, with the shared-queue probe on or off).
  if (auto e = opt.validate()) throw ConfigError(*e);
  return opt;
}

// The event loop wakes every pace interval so ticks, polls and pacing run on time without
// libvirt traffic.
std::chrono::milliseconds wake_interval() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(GovernorOptions{}.pace);
}

// ---- the loop ----

class Daemon {
 public:
  Daemon(const DaemonArgs& a, const DaemonConfig& cfg, const GovernorOptions& opt, DaemonLog& log)
      : cfg_(cfg),
        log_(log),
        hv_(cfg.uri),
        files_(a.page_cache, [&log](const std::string& m) { log.record(m); }),
        gov_(hv_, files_, cfg, opt),
        trace_(a.trace_path),
        server_(
            cfg.socket_path, [this] { return snapshot_.get(); },
            [this](const std::string& domain, const std::string& event) {
              hook_events_.push(domain, event);
            }) {
    log_.record("page cache: " + describe_page_cache_source(a.page_cache));
  }
  void run(EventLoop& loop);

 private:
  void deliver_hook_events();
  void publish_status(TimePoint now);
  void note_job_events();

  const DaemonConfig& cfg_;
  DaemonLog& log_;
  LibvirtHypervisor hv_;
  SystemTargetFiles files_;
  Governor gov_;
  TraceFile trace_;
  StatusSnapshot snapshot_;
  HookEventQueue hook_events_;
  ControlServer server_;
  TimePoint next_status_{};
  std::string job_events_logged_;  // the job-events failure logged last
};

// Without QEMU's job events new jobs are found by the poll alone (within GovernorOptions::poll):
// said once per reason.
void Daemon::note_job_events() {
  const std::string& why = hv_.job_events_error();
  if (why.empty() || why == job_events_logged_) return;
  job_events_logged_ = why;
  log_.record("QEMU job events not available (" + why +
              "): new block jobs are found by the poll only");
}

void Daemon::deliver_hook_events() {
  for (const auto& [domain, event] : hook_events_.take()) {
    log_.record("libvirt hook: domain " + log_field(domain) + " " + log_field(event));
    gov_.domain_event(domain, event);
  }
}

// The status (percentiles over every job's latency history), the log's decision changes, the
// trace and the control socket's snapshot need not be fresher than kStatusInterval; the loop
// itself runs every pace interval (2 ms).
void Daemon::publish_status(TimePoint now) {
  if (now < next_status_) return;
  next_status_ = now + kStatusInterval;
  const GovernorStatus st = gov_.status(now);
  log_.observe(st, cfg_.uri, hv_.last_error());
  trace_.write(st, now);
  snapshot_.set(status_json(st, now));
}

void Daemon::run(EventLoop& loop) {
  server_.start();  // throws when another qcommitd listens: its limits are its own
  gov_.restore_recorded_limits();
  log_.record("governing block jobs on " + log_field(cfg_.uri) + ", control socket " +
              log_field(cfg_.socket_path));
  while (!EventLoop::stop_requested()) {
    deliver_hook_events();
    const auto now = mono_now();
    (void)gov_.step(now);
    note_job_events();
    publish_status(now);
    if (!loop.run_once()) break;
  }
  log_.record("stopping; governed jobs get a finishing speed");
  gov_.release_all();
  server_.stop();
}

}  // namespace

int main(int argc, char** argv) {
  // Every record on stderr (the journal under systemd) goes through this log: one line each,
  // names as data.
  DaemonLog log([](std::string_view r) {
    std::fprintf(stderr, "qcommitd: %.*s\n", static_cast<int>(r.size()), r.data());
  });
  DaemonArgs args;
  if (std::optional<int> rc = parse_daemon_args(argc, argv, args, log)) return *rc;
  try {
    const DaemonConfig cfg = daemon_config(args);
    if (cfg.origin.empty())
      log.record(log_field(args.config_path) + " does not exist: the built-in policy (budget " +
                 qcommit::defaults::budget_text() + ")");
    const GovernorOptions opt = governor_options(args, cfg, log);
    EventLoop::install_stop_signals();
    EventLoop loop(wake_interval());  // throws EventLoopError
    Daemon d(args, cfg, opt, log);
    d.run(loop);
    return 0;
  } catch (const std::exception& e) {
    log.record(e.what());
    return kExitFailure;
  }
}
