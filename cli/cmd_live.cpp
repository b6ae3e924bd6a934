// qcommit live DOMAIN DISK: a governed merge of a running domain's disk, started by qcommit.
// Glue: options, the libvirt event loop and progress output.  The job order is plugin/live.cpp,
// the pacing is plugin/governor.cpp (the same policy qcommitd applies), run in-process.
#include <libvirt/libvirt.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

#include "cli/commands.h"
#include "cli/daemon.h"
#include "cli/json.h"
#include "cli/options.h"
#include "plugin/config.h"
#include "plugin/governor.h"
#include "plugin/libvirt_hypervisor.h"
#include "plugin/live.h"
#include "plugin/writeback.h"

namespace qcommit::cli {
namespace {

std::atomic<bool> g_interrupted{false};
void on_interrupt(int) { g_interrupted = true; }
void wake_timer(int, void*) {}

plugin::TimePoint mono_now() {
  return plugin::TimePoint(std::chrono::duration_cast<plugin::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

constexpr const char* kUsage =
    "usage: qcommit live DOMAIN DISK [--top T] [--base B] [--budget 20ms] [--pivot]\n"
    "                    [--strategy two-phase|direct] [--uri URI] [--dry-run] [--output=json]\n"
    "  Merges TOP (default: the disk's active layer) into BASE (default: the bottom of the chain)\n"
    "  on the running DOMAIN with libvirt block jobs, paced by the qcommitd governor so that the\n"
    "  guests on the same storage see at most BUDGET of added latency.\n"
    "  --strategy two-phase (default, active layer only): a fresh overlay takes the guest's new\n"
    "             writes, the old overlay is committed as a non-active commit (one 512 KiB\n"
    "             request at a time), then the small fresh overlay is active-committed;\n"
    "  --strategy direct: one active commit (QEMU's mirror: 16 x 1 MiB requests in flight).\n"
    "  --pivot    switch the disk to BASE when the active commit is ready (else it is left ready)\n"
    "  --dry-run  print the steps, change nothing\n"
    "  --output=json  JSON lines on stdout: plan, step, progress (1/s) and result events\n"
    "  Refused while qcommitd answers on its socket (--daemon-socket PATH, default\n"
    "  /run/qcommit/qcommitd.sock): it would govern the same jobs.\n"
    "examples:\n  qcommit live vm1 vda --pivot\n  qcommit live vm1 vda --dry-run --strategy direct\n"
    "  qcommit live vm1 vda --pivot --output=json | jq -c 'select(.event != \"progress\")'\n";

}  // namespace

int cmd_live(const Args& args) {
  using namespace qcommit::plugin;
  LiveRequest req;
  std::string uri = kDefaultUri;
  std::string budget = "20ms";
  bool dry_run = false;
  std::string daemon_socket = kDaemonSocket;
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
      std::fputs(kUsage, stdout);
      return kExitOk;
    } else if (is("--top")) {
      req.top = value("--top");
    } else if (is("--base")) {
      req.base = value("--base");
    } else if (is("--budget")) {
      budget = value("--budget");
    } else if (is("--uri")) {
      uri = value("--uri");
    } else if (is("--strategy")) {
      const std::string s = value("--strategy");
      if (s == "direct") req.strategy = LiveStrategy::Direct;
      else if (s == "two-phase") req.strategy = LiveStrategy::TwoPhase;
      else throw UsageError("--strategy must be two-phase or direct, not '" + s + "'");
    } else if (a == "--pivot") {
      req.pivot = true;
    } else if (a == "--dry-run") {
      dry_run = true;
    } else if (is("--output")) {
      out = parse_output(value("--output"));
    } else if (is("--daemon-socket")) {
      daemon_socket = value("--daemon-socket");
    } else if (!a.empty() && a[0] == '-') {
      throw UsageError("unknown option '" + a + "'");
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) throw UsageError("expected DOMAIN DISK (see --help)");
  // One governor per job: with qcommitd running it would also govern the jobs we start and the
  // two would fight over their speed. qcommitd wins; we refuse before touching anything.
  if (!dry_run && qcommitd_answers(daemon_socket)) {
    std::fprintf(stderr,
                 "qcommit live: %s: qcommitd is running (%s) and governs every block job; start the "
                 "merge with 'virsh blockcommit %s %s --active --pivot' and let it govern, or stop "
                 "qcommitd to use qcommit live\n",
                 pos[0].c_str(), daemon_socket.c_str(), pos[0].c_str(), pos[1].c_str());
    return kExitError;
  }
  req.domain = pos[0];
  req.disk = pos[1];

  DaemonConfig cfg;
  cfg.uri = uri;
  try {
    cfg.defaults.budget = parse_duration(budget, "--budget");
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }
  if (auto e = cfg.defaults.validate()) throw UsageError(*e);
  req.initial_speed_bytes_per_s = static_cast<std::uint64_t>(
      cfg.defaults.controller_config().initial_rate_bytes_per_s);

  if (virEventRegisterDefaultImpl() < 0 || virEventAddTimeout(20, wake_timer, nullptr, nullptr) < 0) {
    std::fprintf(stderr, "qcommit live: cannot set up the libvirt event loop\n");
    return kExitError;
  }
  LibvirtHypervisor hv(uri);
  if (!hv.connect()) {
    std::fprintf(stderr, "qcommit live: %s: %s\n", uri.c_str(), hv.last_error().c_str());
    return kExitError;
  }
  std::optional<DomainInfo> dom = hv.domain(req.domain);
  if (!dom) {
    std::fprintf(stderr, "qcommit live: %s: no running domain of that name on %s\n",
                 req.domain.c_str(), uri.c_str());
    return kExitError;
  }
  const DiskInfo* disk = nullptr;
  for (const auto& d : dom->disks)
    if (d.target == req.disk || d.source == req.disk) disk = &d;
  if (!disk) {
    std::fprintf(stderr, "qcommit live: %s: no disk '%s'\n", req.domain.c_str(), req.disk.c_str());
    return kExitError;
  }
  req.disk = disk->target;
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d%H%M%S", std::gmtime(&t));
  const std::string fresh = fresh_overlay_path(req.top.empty() ? disk->source : req.top, stamp);
  std::vector<LiveStep> steps;
  try {
    steps = plan_live(req, *disk, fresh);
  } catch (const BlockJobError& e) {
    std::fprintf(stderr, "qcommit live: %s\n", e.what());
    return kExitError;
  }
  const bool json = out == Output::kJson;
  if (json) {
    std::string js = "{\"event\": \"plan\", \"domain\": " + json_string(req.domain) +
                     ", \"disk\": " + json_string(req.disk) + ", \"strategy\": \"" +
                     to_string(req.strategy) + "\", \"budget\": " + json_string(budget) +
                     ", \"dry-run\": " + json_bool(dry_run) + ", \"steps\": [";
    for (size_t i = 0; i < steps.size(); ++i) js += (i ? ", " : "") + json_string(steps[i].describe());
    std::printf("%s]}\n", js.c_str());
  } else {
    std::printf("qcommit live: %s %s, strategy %s, budget %s\n", req.domain.c_str(),
                req.disk.c_str(), to_string(req.strategy), budget.c_str());
    for (size_t i = 0; i < steps.size(); ++i)
      std::printf("  %zu. %s\n", i + 1, steps[i].describe().c_str());
  }
  std::fflush(stdout);
  if (dry_run) return kExitOk;

  GovernorOptions opt;
  opt.only_disk = std::make_pair(req.domain, req.disk);
  if (auto e = opt.validate()) {
    std::fprintf(stderr, "qcommit live: %s\n", e->c_str());
    return kExitError;
  }
  SystemTargetFiles files;
  Governor gov(hv, files, cfg, opt);
  LiveMerge merge(hv, hv, steps, req);

  struct sigaction sa{};
  sa.sa_handler = on_interrupt;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::size_t shown_step = static_cast<std::size_t>(-1);
  auto next_report = mono_now();
  bool running = true;
  while (running && !g_interrupted) {
    const auto now = mono_now();
    try {
      running = merge.step(now);
    } catch (const HypervisorDisconnected& e) {
      // The governor reconnects; the job order waits for it.
      (void)e;
    }
    (void)gov.step(now);
    if (merge.current() != shown_step && merge.current() < merge.steps().size()) {
      shown_step = merge.current();
      if (json)
        std::printf("{\"event\": \"step\", \"step\": %zu, \"description\": %s}\n", shown_step + 1,
                    json_string(merge.steps()[shown_step].describe()).c_str());
      else
        std::printf("step %zu: %s\n", shown_step + 1, merge.steps()[shown_step].describe().c_str());
      std::fflush(stdout);
    }
    if (now >= next_report) {
      next_report = now + std::chrono::seconds(1);
      const GovernorStatus st = gov.status(now);
      for (const auto& j : st.jobs) {
        if (json) {
          std::printf("{\"event\": \"progress\", \"type\": \"%s\", \"bytes-left\": %llu, "
                      "\"speed\": %llu, \"window\": %llu, \"p99-ms\": %s, \"phase\": %s}\n",
                      to_string(j.type), static_cast<unsigned long long>(j.bytes_left),
                      static_cast<unsigned long long>(j.speed_bytes_per_s),
                      static_cast<unsigned long long>(j.window_bytes),
                      j.latency_p99 ? std::to_string(std::chrono::duration<double, std::milli>(
                                                         *j.latency_p99).count()).c_str()
                                    : "null",
                      json_string(j.phase).c_str());
          std::fflush(stdout);
          continue;
        }
        std::fprintf(stderr, "  %s: %llu bytes left, speed %.1f MiB/s, window %llu KiB, p99 %s, %s\n",
                     to_string(j.type), static_cast<unsigned long long>(j.bytes_left),
                     static_cast<double>(j.speed_bytes_per_s) / 1048576.0,
                     static_cast<unsigned long long>(j.window_bytes / 1024),
                     j.latency_p99 ? (std::to_string(std::chrono::duration<double, std::milli>(
                                                         *j.latency_p99).count()) + " ms").c_str()
                                   : "-",
                     j.phase.c_str());
      }
    }
    if (running && virEventRunDefaultImpl() < 0) break;
  }
  if (g_interrupted) {
    gov.release_all();
    std::fprintf(stderr, "qcommit live: interrupted at step %zu; the running block job (if any) "
                         "continues at a finishing speed: see 'virsh blockjob %s %s --info'\n",
                 merge.current() + 1, req.domain.c_str(), req.disk.c_str());
    return kExitError;
  }
  if (merge.error()) {
    gov.release_all();
    std::fprintf(stderr, "qcommit live: %s\n", merge.error()->c_str());
    return kExitError;
  }
  gov.release_all();
  if (json) {
    std::printf("{\"event\": \"result\", \"domain\": %s, \"disk\": %s, \"outcome\": \"%s\"}\n",
                json_string(req.domain).c_str(), json_string(req.disk).c_str(),
                merge.left_ready() ? "ready" : "done");
  } else if (merge.left_ready()) {
    std::printf("qcommit live: active commit ready (mirroring); pivot with 'virsh blockjob %s %s "
                "--pivot'\n", req.domain.c_str(), req.disk.c_str());
  } else {
    std::printf("qcommit live: done\n");
  }
  return kExitOk;
}

}  // namespace qcommit::cli
