// qcommitd: governs libvirt block jobs (commit, active commit, pull, copy) so that snapshot
// merges stay within a latency budget of the guests sharing the storage.  Glue: options, the
// libvirt event loop, the control socket; the policy is in governor.cpp.
#include <libvirt/libvirt.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/defaults.h"
#include "plugin/config.h"
#include "plugin/control.h"
#include "plugin/daemon_log.h"
#include "plugin/governor.h"
#include "plugin/libvirt_hypervisor.h"
#include "plugin/writeback.h"

namespace {

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop = true; }

void usage(FILE* f) {
  std::fprintf(f,
      "usage: qcommitd [--config PATH] [--uri URI] [--socket PATH] [--trace FILE]\n"
      "                [--page-cache auto|no-cachestat|meminfo] [--version]\n"
      "  --config PATH   policy file (default %s; missing = defaults)\n"
      "  --uri URI       libvirt connection (default %s)\n"
      "  --socket PATH   control socket (default %s)\n"
      "  --trace FILE    append governed jobs' speed/window/backlog/p99 every 100 ms (CSV)\n"
      "  --page-cache S  where a target's dirty pages are read: auto (cachestat(2) where the\n"
      "                  kernel has it, else no-cachestat), no-cachestat (forced: what a kernel\n"
      "                  before 6.5 gets: completion-clocked writeback, QEMU's memory cgroup),\n"
      "                  no-cachestat-shadow (also logs cachestat's truth; tests) or meminfo\n"
      "                  (host-wide count, fdatasync pacing; diagnostics)\n"
      "Logs one line per connection change, job adopted, decision change and job released on\n"
      "stderr (see qcommitd(8)).\n"
      "examples:\n"
      "  qcommitd                      # as qcommitd.service runs it\n"
      "  qcommitd --uri qemu:///system --socket /tmp/q.sock --trace /var/tmp/qcommitd.csv\n",
      qcommit::defaults::kConfigPath, qcommit::defaults::kUri, qcommit::defaults::kSocketPath);
}

qcommit::throttle::TimePoint mono_now() {
  return qcommit::throttle::TimePoint(std::chrono::duration_cast<qcommit::throttle::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

void wake_timer(int, void*) {}

constexpr auto kStatusInterval = std::chrono::milliseconds(50);

}  // namespace

int main(int argc, char** argv) {
  using namespace qcommit::plugin;
  // Every record on stderr (the journal under systemd) goes through this log: one line each,
  // names as data.
  DaemonLog log([](std::string_view r) {
    std::fprintf(stderr, "qcommitd: %.*s\n", static_cast<int>(r.size()), r.data());
  });
  std::string config_path = qcommit::defaults::kConfigPath;
  bool config_given = false;
  std::string uri, socket_path, trace_path;
  PageCacheSource page_cache = PageCacheSource::kAuto;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* opt) -> std::string {
      const std::string prefix = std::string(opt) + "=";
      if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
      if (i + 1 >= argc) {
        log.record(std::string(opt) + " needs a value");
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else if (a == "--version") {
      std::printf("qcommitd %s\n", QCOMMIT_VERSION);
      return 0;
    } else if (a.rfind("--config", 0) == 0) {
      config_path = value("--config");
      config_given = true;
    } else if (a.rfind("--uri", 0) == 0) {
      uri = value("--uri");
    } else if (a.rfind("--socket", 0) == 0) {
      socket_path = value("--socket");
    } else if (a.rfind("--trace", 0) == 0) {
      trace_path = value("--trace");
    } else if (a.rfind("--page-cache", 0) == 0) {
      const std::string v = value("--page-cache");
      const auto src = parse_page_cache_source(v);
      if (!src) {
        log.record("--page-cache: " + log_field(v) +
                   " is not auto, no-cachestat, no-cachestat-shadow or meminfo");
        return 2;
      }
      page_cache = *src;
    } else {
      log.record("unknown option " + log_field(a));
      usage(stderr);
      return 2;
    }
  }
  try {
    DaemonConfig cfg = load_config(config_path, !config_given);
    if (!uri.empty()) cfg.uri = uri;
    if (!socket_path.empty()) cfg.socket_path = socket_path;
    if (auto e = cfg.validate()) {
      log.record(log_field(config_path) + ": " + *e);
      return 1;
    }
    GovernorOptions opt;
    opt.settle_every = settle_interval_for(dirty_expire());
    if (auto e = opt.validate()) {
      log.record(*e);
      return 1;
    }

    struct sigaction sa{};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);

    if (virEventRegisterDefaultImpl() < 0) {
      log.record("cannot register the libvirt event loop");
      return 1;
    }
    // Wake the loop every pace interval so ticks/polls/pacing run on time without libvirt
    // traffic.
    if (virEventAddTimeout(static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                GovernorOptions{}.pace).count()),
                           wake_timer, nullptr, nullptr) < 0) {
      log.record("cannot add the event loop timer");
      return 1;
    }

    LibvirtHypervisor hv(cfg.uri);
    SystemTargetFiles files(page_cache, [&log](const std::string& m) { log.record(m); });
    Governor gov(hv, files, cfg, opt);

    std::mutex snap_mu;
    std::string snapshot = "{\"ok\":true,\"connected\":false,\"jobs\":[],\"released\":[]}";
    // The libvirt hook's domain events arrive on the control thread: queued here, handed to the
    // governor by this loop (the control thread never touches the governor).
    std::mutex hook_mu;
    std::vector<std::pair<std::string, std::string>> hook_events;
    ControlServer server(
        cfg.socket_path,
        [&] {
          std::lock_guard<std::mutex> lk(snap_mu);
          return snapshot;
        },
        [&](const std::string& domain, const std::string& event) {
          std::lock_guard<std::mutex> lk(hook_mu);
          if (hook_events.size() < kMaxQueuedHookEvents) hook_events.emplace_back(domain, event);
        });
    server.start();
    log.record("governing block jobs on " + log_field(cfg.uri) + ", control socket " +
               log_field(cfg.socket_path));
    log.record("page cache: " + describe_page_cache_source(page_cache));

    FILE* trace = nullptr;
    if (!trace_path.empty()) {
      trace = std::fopen(trace_path.c_str(), "a");
      if (!trace) {
        log.record(log_field(trace_path) + ": cannot open the trace file");
        return 1;
      }
      std::fputs("mono_s,domain,disk,speed_bps,window_bytes,backlog_bytes,p99_ms,bytes_left,phase\n", trace);
    }
    auto next_trace = mono_now();
    auto next_status = mono_now();
    while (!g_stop) {
      {
        std::vector<std::pair<std::string, std::string>> events;
        {
          std::lock_guard<std::mutex> lk(hook_mu);
          events.swap(hook_events);
        }
        for (const auto& [domain, event] : events) {
          log.record("libvirt hook: domain " + log_field(domain) + " " + log_field(event));
          gov.domain_event(domain, event);
        }
      }
      const auto now = mono_now();
      (void)gov.step(now);
      // The loop runs every pace interval (2 ms); the status (percentiles over every job's
      // latency history), the log's decision changes and the control socket's snapshot need
      // not be fresher than kStatusInterval.
      if (now >= next_status) {
        next_status = now + kStatusInterval;
        GovernorStatus st = gov.status(now);
        log.observe(st, cfg.uri, hv.last_error());
        if (trace && now >= next_trace) {
          next_trace = now + std::chrono::milliseconds(100);
          const double t = std::chrono::duration<double>(now.time_since_epoch()).count();
          for (const auto& j : st.jobs)
            std::fprintf(
                trace, "%.3f,%s,%s,%llu,%llu,%llu,%.1f,%llu,%s\n", t, csv_field(j.domain).c_str(),
                csv_field(j.disk).c_str(), static_cast<unsigned long long>(j.speed_bytes_per_s),
                static_cast<unsigned long long>(j.window_bytes),
                static_cast<unsigned long long>(j.backlog_bytes),
                j.latency_p99 ? std::chrono::duration<double, std::milli>(*j.latency_p99).count()
                              : -1.0,
                static_cast<unsigned long long>(j.bytes_left), j.phase.c_str());
          std::fflush(trace);
        }
        {
          std::string j = status_json(st, now);
          std::lock_guard<std::mutex> lk(snap_mu);
          snapshot = std::move(j);
        }
      }
      if (virEventRunDefaultImpl() < 0) break;
    }
    log.record("stopping; governed jobs get a finishing speed");
    gov.release_all();
    server.stop();
    return 0;
  } catch (const ConfigError& e) {
    log.record(e.what());
    return 1;
  } catch (const std::exception& e) {
    log.record(e.what());
    return 1;
  }
}
