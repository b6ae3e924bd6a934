// qcommit live DOMAIN DISK: a governed merge of a running domain's disk, started by qcommit.
// qcommit live --qmp SOCKET DISK: the same on a QEMU that libvirt does not manage, over QMP.
// Glue: options, the event loop (libvirt's or the QMP socket's) and progress output.  The job
// order is plugin/live.cpp, the pacing is plugin/governor.cpp (the same policy qcommitd
// applies), run in-process.
#include <libvirt/libvirt.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <string>

#include "common/defaults.h"
#include "cli/commands.h"
#include "cli/daemon.h"
#include "cli/json.h"
#include "cli/options.h"
#include "cli/units.h"
#include "plugin/config.h"
#include "plugin/governor.h"
#include "plugin/libvirt_hypervisor.h"
#include "plugin/live.h"
#include "plugin/qmp_hypervisor.h"
#include "plugin/writeback.h"

namespace qcommit::cli {
namespace {

std::atomic<bool> g_interrupted{false};
void on_interrupt(int) {
  g_interrupted = true;
}
void wake_timer(int, void*) {}

plugin::TimePoint mono_now() {
  return plugin::TimePoint(std::chrono::duration_cast<plugin::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

constexpr const char* kUsage =
    "usage: qcommit live DOMAIN DISK [--top T] [--base B] [--budget 20ms] [--pivot]\n"
    "                    [--strategy two-phase|direct] [--overlay-dir DIR] [-c|--connect URI]\n"
    "                    [--dry-run] [--output=json] [--page-cache auto|no-cachestat|meminfo]\n"
    "       qcommit live --qmp SOCKET DISK [--top T] [--base B] [--budget 20ms] [--pivot] ...\n"
    "  Merges TOP (default: the disk's active layer) into BASE (default: the bottom of the chain)\n"
    "  on the running DOMAIN with libvirt block jobs, paced by the qcommitd governor so that the\n"
    "  guests on the same storage see at most BUDGET of added latency.\n"
    "  --strategy two-phase (default, active layer only): a fresh overlay takes the guest's new\n"
    "             writes, the old overlay is committed as a non-active commit (one 512 KiB\n"
    "             request at a time), then the small fresh overlay is active-committed;\n"
    "  --strategy direct: one active commit (QEMU's mirror: 16 x 1 MiB requests in flight).\n"
    "  --overlay-dir DIR  two-phase: create the fresh overlay in DIR (e.g. local SSD) instead of\n"
    "             next to TOP: the guest's writes during the merge then never wait behind it on\n"
    "             shared storage. Until the pivot the disk depends on DIR: a host failure leaves\n"
    "             its latest writes there (an HA restart elsewhere cannot open the disk).\n"
    "  --pivot    switch the disk to BASE when the active commit is ready (else it is left ready)\n"
    "  --dry-run  print the steps, change nothing\n"
    "  --page-cache S  where the target's dirty pages are read: auto (cachestat(2) where the\n"
    "             kernel has it, else no-cachestat), no-cachestat (forced: what a kernel before\n"
    "             6.5 gets), no-cachestat-shadow (also logs cachestat's truth) or meminfo\n"
    "  --output=json  JSON lines on stdout: plan, step, progress (1/s) and result events\n"
    "  --qmp SOCKET   a QEMU that libvirt does not manage (e.g. Proxmox VE's\n"
    "             /var/run/qemu-server/ID.qmp), driven over its QMP monitor. DISK: a drive id,\n"
    "             device id, node name or the active layer's path; the domain name comes from\n"
    "             query-name, else the socket's file name. QEMU serves one QMP client per\n"
    "             socket: its other clients wait until qcommit live ends.\n"
    "  -c, --connect URI  libvirt connection (--uri: the same)\n"
    "  Refused while qcommitd answers on its socket (--socket PATH, or --daemon-socket, default\n"
    "  %s): it would govern the same jobs.\n"
    "examples:\n  qcommit live vm1 vda --pivot\n  qcommit live vm1 vda --dry-run --strategy "
    "direct\n"
    "  qcommit live vm1 vda --pivot --output=json | jq -c 'select(.event != \"progress\")'\n"
    "  qcommit live --qmp /var/run/qemu-server/100.qmp drive-scsi0 --pivot\n";

// `--qmp`: QEMU serves its QMP socket until it exits, so a connection that cannot be
// re-established for this long means QEMU is gone.
constexpr auto kQmpReconnectGiveUp = std::chrono::seconds(10);
// The longest the loop waits for hypervisor events; it wakes earlier when the governor's next
// step is due (its pacer and chunk gate work in 2 ms steps).
constexpr auto kEventWait = std::chrono::milliseconds(20);

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

// What differs between the libvirt and the QMP backend while the merge runs.
struct LiveBackend {
  plugin::Hypervisor& hv;
  plugin::BlockJobControl& ctl;
  // Runs the event loop for at most the given time (1 ms .. kEventWait); false: broken.
  std::function<bool(std::chrono::milliseconds)> wait_events;
  std::string job_hint;    // where to look at a job left running
  std::string pivot_hint;  // how to pivot a job left ready
  // --qmp: give up when the connection stays lost this long; libvirt: wait for libvirtd.
  std::optional<plugin::Duration> give_up_after;
  std::function<std::string()> lost_message;
  std::function<std::string()> job_error;  // QEMU's last job error, "" when none
};

int run_live(LiveBackend& be, const plugin::LiveRequest& req,
             const std::vector<plugin::LiveStep>& steps, const plugin::DaemonConfig& cfg,
             bool json_out, plugin::PageCacheSource page_cache);

// {"event": "progress", "type": ..., "bytes-left": ..., "p99-ms": ... or null, "phase": ...}
json::Ordered progress_json(const plugin::JobStatus& j) {
  const json::Ordered p99 =
      j.latency_p99 ? json::Ordered(rounded(
                          std::chrono::duration<double, std::milli>(*j.latency_p99).count(), 6))
                    : json::Ordered(nullptr);
  return json::Ordered{{"event", "progress"},
                       {"type", plugin::to_string(j.type)},
                       {"bytes-left", j.bytes_left},
                       {"speed", j.speed_bytes_per_s},
                       {"window", j.window_bytes},
                       {"p99-ms", p99},
                       {"phase", j.phase}};
}

}  // namespace

int cmd_live(const Args& args) {
  using namespace qcommit::plugin;
  LiveRequest req;
  std::string uri = qcommit::defaults::kUri;
  std::string budget = qcommit::defaults::budget_text();
  bool dry_run = false;
  std::string daemon_socket = qcommit::defaults::kSocketPath;
  std::string qmp;
  std::string overlay_dir;
  bool uri_given = false;
  plugin::PageCacheSource page_cache = plugin::PageCacheSource::kAuto;
  Output out = Output::kHuman;
  std::vector<std::string> pos;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const char* name) -> std::string {
      const std::string prefix = std::string(name) + "=";
      if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
      if (i + 1 >= args.size()) throw UsageError(std::string(name) + " needs a value");
      return args[++i];
    };
    auto is = [&](const char* name) {
      return a == name || a.rfind(std::string(name) + "=", 0) == 0;
    };
    if (a == "-h" || a == "--help") {
      std::printf(kUsage, qcommit::defaults::kSocketPath);
      return kExitOk;
    } else if (is("--top")) {
      req.top = value("--top");
    } else if (is("--base")) {
      req.base = value("--base");
    } else if (is("--budget")) {
      budget = value("--budget");
    } else if (is("--connect") || is("--uri") || a == "-c") {
      uri = value(a == "-c" ? "-c" : is("--uri") ? "--uri" : "--connect");
      uri_given = true;
    } else if (is("--qmp")) {
      qmp = value("--qmp");
    } else if (is("--strategy")) {
      const std::string s = value("--strategy");
      if (s == "direct")
        req.strategy = LiveStrategy::Direct;
      else if (s == "two-phase")
        req.strategy = LiveStrategy::TwoPhase;
      else
        throw UsageError("--strategy must be two-phase or direct, not '" + s + "'");
    } else if (is("--overlay-dir")) {
      overlay_dir = value("--overlay-dir");
    } else if (a == "--pivot") {
      req.pivot = true;
    } else if (a == "--dry-run") {
      dry_run = true;
    } else if (is("--output")) {
      out = parse_output(value("--output"));
    } else if (is("--socket") || is("--daemon-socket")) {
      daemon_socket = value(is("--socket") ? "--socket" : "--daemon-socket");
    } else if (is("--page-cache")) {
      const std::string v = value("--page-cache");
      const auto src = plugin::parse_page_cache_source(v);
      if (!src)
        throw UsageError("--page-cache must be auto, no-cachestat, no-cachestat-shadow or meminfo, "
                         "not '" + v + "'");
      page_cache = *src;
    } else if (!a.empty() && a[0] == '-') {
      throw UsageError("unknown option '" + a + "'");
    } else {
      pos.push_back(a);
    }
  }
  if (!overlay_dir.empty()) {
    if (req.strategy != LiveStrategy::TwoPhase)
      throw UsageError("--overlay-dir is for the two-phase strategy (its fresh overlay)");
    struct stat sb {};
    if (::stat(overlay_dir.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode)) {
      std::fprintf(stderr, "qcommit live: --overlay-dir %s: not a directory\n",
                   overlay_dir.c_str());
      return kExitError;
    }
    // QEMU and libvirt are given the path: an absolute one.
    char* real = ::realpath(overlay_dir.c_str(), nullptr);
    if (real) {
      overlay_dir = real;
      std::free(real);
    }
  }
  if (!qmp.empty()) {
    if (uri_given) throw UsageError("--qmp and --connect exclude each other");
    if (pos.size() != 1) throw UsageError("expected --qmp SOCKET DISK (see --help)");
  } else if (pos.size() != 2) {
    throw UsageError("expected DOMAIN DISK (see --help)");
  }
  // One governor per job: with qcommitd running it would also govern the jobs we start and the
  // two would fight over their speed. qcommitd wins; we refuse before touching anything.
  // (qcommitd governs libvirt's domains only: a QEMU reached with --qmp is not among them.)
  if (qmp.empty() && !dry_run && qcommitd_answers(daemon_socket)) {
    std::fprintf(
        stderr,
        "qcommit live: %s: qcommitd is running (%s) and governs every block job; start the "
        "merge with 'virsh blockcommit %s %s --active --pivot' and let it govern, or stop "
        "qcommitd to use qcommit live\n",
        pos[0].c_str(), daemon_socket.c_str(), pos[0].c_str(), pos[1].c_str());
    return kExitError;
  }
  req.domain = qmp.empty() ? pos[0] : "";
  req.disk = qmp.empty() ? pos[1] : pos[0];

  DaemonConfig cfg;
  cfg.uri = uri;
  cfg.defaults.budget = qcommit::cli::parse_duration(budget, "--budget");
  if (auto e = cfg.defaults.validate()) throw UsageError(*e);
  req.initial_speed_bytes_per_s =
      static_cast<std::uint64_t>(cfg.defaults.controller_config().initial_rate_bytes_per_s);

  std::unique_ptr<LibvirtHypervisor> lv;
  std::unique_ptr<QmpHypervisor> qm;
  std::optional<DomainInfo> dom;
  int wake_timer_id = -1;  // libvirt event loop timer that bounds each wait
  if (qmp.empty()) {
    if (virEventRegisterDefaultImpl() < 0 ||
        (wake_timer_id = virEventAddTimeout(static_cast<int>(kEventWait.count()), wake_timer,
                                            nullptr, nullptr)) < 0) {
      std::fprintf(stderr, "qcommit live: cannot set up the libvirt event loop\n");
      return kExitError;
    }
    lv = std::make_unique<LibvirtHypervisor>(uri);
    if (!lv->connect()) {
      std::fprintf(stderr, "qcommit live: %s: %s\n", uri.c_str(), lv->last_error().c_str());
      return kExitError;
    }
    dom = lv->domain(req.domain);
    if (!dom) {
      std::fprintf(stderr, "qcommit live: %s: no running domain of that name on %s\n",
                   req.domain.c_str(), uri.c_str());
      return kExitError;
    }
  } else {
    qm = std::make_unique<QmpHypervisor>(qmp);
    try {
      if (!qm->connect()) {
        std::fprintf(stderr, "qcommit live: %s\n", qm->last_error().c_str());
        return kExitError;
      }
      req.domain = qm->name();
      if (std::optional<std::string> target = qm->resolve_disk(req.disk)) req.disk = *target;
      dom = qm->domain(req.domain);
      if (dom && !dry_run) {
        if (std::optional<JobInfo> j = qm->job_info(req.domain, req.disk)) {
          std::fprintf(stderr, "qcommit live: %s: %s: a %s block job already runs on disk %s\n",
                       qmp.c_str(), req.domain.c_str(), to_string(j->type), req.disk.c_str());
          return kExitError;
        }
      }
    } catch (const HypervisorDisconnected& e) {
      std::fprintf(stderr, "qcommit live: %s\n", e.what());
      return kExitError;
    }
  }
  if (!dom) {
    std::fprintf(stderr, "qcommit live: %s: no domain\n", qmp.c_str());
    return kExitError;
  }
  const DiskInfo* disk = nullptr;
  for (const auto& d : dom->disks)
    if (d.target == req.disk || d.source == req.disk) disk = &d;
  if (!disk) {
    std::string known;
    for (const auto& d : dom->disks) known += (known.empty() ? "" : ", ") + d.target;
    std::fprintf(stderr, "qcommit live: %s%s%s: no disk '%s' (disks: %s)\n",
                 qmp.empty() ? "" : qmp.c_str(), qmp.empty() ? "" : ": ", req.domain.c_str(),
                 req.disk.c_str(), known.empty() ? "none" : known.c_str());
    return kExitError;
  }
  req.disk = disk->target;
  req.top = as_in_chain(req.top, *disk);
  req.base = as_in_chain(req.base, *disk);
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d%H%M%S", std::gmtime(&t));
  const std::string fresh =
      fresh_overlay_path(req.top.empty() ? disk->source : req.top, stamp, overlay_dir);
  std::vector<LiveStep> steps;
  try {
    steps = plan_live(req, *disk, fresh);
  } catch (const BlockJobError& e) {
    std::fprintf(stderr, "qcommit live: %s\n", e.what());
    return kExitError;
  }
  const bool json_out = out == Output::kJson;
  if (json_out) {
    json::Ordered described = json::Ordered::array();
    for (const auto& step : steps) described.push_back(step.describe());
    print_json(json::Ordered{{"event", "plan"},
                             {"domain", req.domain},
                             {"disk", req.disk},
                             {"strategy", to_string(req.strategy)},
                             {"budget", budget},
                             {"dry-run", dry_run},
                             {"steps", described}});
  } else {
    std::printf("qcommit live: %s %s, strategy %s, budget %s\n", req.domain.c_str(),
                req.disk.c_str(), to_string(req.strategy), budget.c_str());
    for (size_t i = 0; i < steps.size(); ++i)
      std::printf("  %zu. %s\n", i + 1, steps[i].describe().c_str());
  }
  std::fflush(stdout);
  if (dry_run) return kExitOk;

  if (lv) {
    LiveBackend be{*lv,
                   *lv,
                   [wake_timer_id](std::chrono::milliseconds wait) {
                     virEventUpdateTimeout(wake_timer_id, static_cast<int>(wait.count()));
                     return virEventRunDefaultImpl() >= 0;
                   },
                   "'virsh blockjob " + req.domain + " " + req.disk + " --info'",
                   "'virsh blockjob " + req.domain + " " + req.disk + " --pivot'",
                   std::nullopt,
                   nullptr,
                   nullptr};
    return run_live(be, req, steps, cfg, json_out, page_cache);
  }
  QmpHypervisor& q = *qm;
  LiveBackend be{
      q,
      q,
      [&q](std::chrono::milliseconds wait) {
        q.pump(wait);
        return true;
      },
      "query-block-jobs on " + qmp,
      "QMP block-job-complete of job " + qcommit_job_id(req.disk) + " on " + qmp,
      std::chrono::duration_cast<Duration>(kQmpReconnectGiveUp),
      [&q] { return "lost the QMP connection and could not reconnect: " + q.last_error(); },
      [&q] { return q.last_job_error(); }};
  return run_live(be, req, steps, cfg, json_out, page_cache);
}

namespace {

int run_live(LiveBackend& be, const plugin::LiveRequest& req,
             const std::vector<plugin::LiveStep>& steps, const plugin::DaemonConfig& cfg,
             bool json_out, plugin::PageCacheSource page_cache) {
  using namespace qcommit::plugin;
  Hypervisor& hv = be.hv;
  GovernorOptions opt;
  opt.settle_every = settle_interval_for(dirty_expire());
  opt.only_disk = std::make_pair(req.domain, req.disk);
  if (auto e = opt.validate()) {
    std::fprintf(stderr, "qcommit live: %s\n", e->c_str());
    return kExitError;
  }
  if (!json_out)
    std::fprintf(stderr, "qcommit live: page cache: %s\n", describe_page_cache_source(page_cache).c_str());
  SystemTargetFiles files(page_cache, [json_out](const std::string& m) {
    if (!json_out) std::fprintf(stderr, "qcommit live: %s\n", m.c_str());
  });
  Governor gov(hv, files, cfg, opt);
  LiveMerge merge(be.ctl, hv, steps, req);

  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::size_t shown_step = static_cast<std::size_t>(-1);
  auto next_report = mono_now();
  bool running = true;
  bool loop_broken = false;  // the event loop failed: the merge's state is unknown
  std::optional<TimePoint> lost_since;
  while (running && !g_interrupted) {
    const auto now = mono_now();
    if (be.give_up_after) {
      if (hv.connected()) {
        lost_since.reset();
      } else {
        if (!lost_since) lost_since = now;
        if (now - *lost_since > *be.give_up_after) {
          std::fprintf(stderr, "qcommit live: %s\n", be.lost_message().c_str());
          return kExitError;
        }
      }
    }
    try {
      running = merge.step(now);
    } catch (const HypervisorDisconnected& e) {
      // The governor reconnects; the job order waits for it.
      (void)e;
    }
    const TimePoint gov_next = gov.step(now);
    if (merge.current() != shown_step && merge.current() < merge.steps().size()) {
      shown_step = merge.current();
      if (json_out)
        print_json(json::Ordered{{"event", "step"},
                                 {"step", shown_step + 1},
                                 {"description", merge.steps()[shown_step].describe()}});
      else
        std::printf("step %zu: %s\n", shown_step + 1, merge.steps()[shown_step].describe().c_str());
      std::fflush(stdout);
    }
    if (now >= next_report) {
      next_report = now + std::chrono::seconds(1);
      const GovernorStatus st = gov.status(now);
      for (const auto& j : st.jobs) {
        if (json_out) {
          print_json(progress_json(j));
          continue;
        }
        std::fprintf(stderr,
                     "  %s: %llu bytes left, speed %.1f MiB/s, window %llu KiB, p99 %s, %s\n",
                     to_string(j.type), static_cast<unsigned long long>(j.bytes_left),
                     static_cast<double>(j.speed_bytes_per_s) / 1048576.0,
                     static_cast<unsigned long long>(j.window_bytes / 1024),
                     j.latency_p99
                         ? (std::to_string(
                                std::chrono::duration<double, std::milli>(*j.latency_p99).count()) +
                            " ms")
                               .c_str()
                         : "-",
                     j.phase.c_str());
      }
    }
    // Until the governor's next step (the chunk gate closes 2 ms after it opens), at most
    // kEventWait, at least 1 ms.
    const auto until_gov = std::chrono::ceil<std::chrono::milliseconds>(gov_next - mono_now());
    const auto wait = std::clamp(until_gov, std::chrono::milliseconds(1), kEventWait);
    if (running && !be.wait_events(wait)) {
      loop_broken = true;
      break;
    }
  }
  if (g_interrupted) {
    gov.release_all();
    std::fprintf(stderr,
                 "qcommit live: interrupted at step %zu; the running block job (if any) "
                 "continues at a finishing speed: see %s\n",
                 merge.current() + 1, be.job_hint.c_str());
    return kExitError;
  }
  if (loop_broken && !merge.error()) {
    gov.release_all();
    std::fprintf(stderr,
                 "qcommit live: the event loop failed at step %zu; the running block job (if "
                 "any) continues at a finishing speed: see %s\n",
                 merge.current() + 1, be.job_hint.c_str());
    return kExitError;
  }
  if (merge.error()) {
    gov.release_all();
    const std::string job_error = be.job_error ? be.job_error() : "";
    if (job_error.empty() || merge.error()->find(job_error) != std::string::npos)
      std::fprintf(stderr, "qcommit live: %s\n", merge.error()->c_str());
    else
      std::fprintf(stderr, "qcommit live: %s (QEMU: %s)\n", merge.error()->c_str(),
                   job_error.c_str());
    return kExitError;
  }
  gov.release_all();
  if (json_out) {
    print_json(json::Ordered{{"event", "result"},
                             {"domain", req.domain},
                             {"disk", req.disk},
                             {"outcome", merge.left_ready() ? "ready" : "done"}});
  } else if (merge.left_ready()) {
    std::printf("qcommit live: active commit ready (mirroring); pivot with %s\n",
                be.pivot_hint.c_str());
  } else {
    std::printf("qcommit live: done\n");
  }
  return kExitOk;
}

}  // namespace

}  // namespace qcommit::cli
