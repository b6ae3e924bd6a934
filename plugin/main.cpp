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
#include <set>
#include <string>

#include "plugin/config.h"
#include "plugin/control.h"
#include "plugin/governor.h"
#include "plugin/libvirt_hypervisor.h"
#include "plugin/writeback.h"

namespace {

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop = true; }

void usage(FILE* f) {
  std::fputs(
      "usage: qcommitd [--config PATH] [--uri URI] [--socket PATH] [--trace FILE]\n"
      "  --config PATH   policy file (default /etc/qcommit/qcommitd.conf; missing = defaults)\n"
      "  --uri URI       libvirt connection (default qemu:///system)\n"
      "  --socket PATH   control socket (default /run/qcommit/qcommitd.sock)\n"
      "  --trace FILE    append governed jobs' speed/window/backlog/p99 every 100 ms (CSV)\n",
      f);
}

qcommit::throttle::TimePoint mono_now() {
  return qcommit::throttle::TimePoint(std::chrono::duration_cast<qcommit::throttle::Duration>(
      std::chrono::steady_clock::now().time_since_epoch()));
}

void wake_timer(int, void*) {}

}  // namespace

int main(int argc, char** argv) {
  using namespace qcommit::plugin;
  std::string config_path = kDefaultConfigPath;
  bool config_given = false;
  std::string uri, socket_path, trace_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* opt) -> std::string {
      const std::string prefix = std::string(opt) + "=";
      if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
      if (i + 1 >= argc) {
        std::fprintf(stderr, "qcommitd: %s needs a value\n", opt);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
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
    } else {
      std::fprintf(stderr, "qcommitd: unknown option '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  try {
    DaemonConfig cfg = load_config(config_path, !config_given);
    if (!uri.empty()) cfg.uri = uri;
    if (!socket_path.empty()) cfg.socket_path = socket_path;
    if (auto e = cfg.validate()) {
      std::fprintf(stderr, "qcommitd: %s: %s\n", config_path.c_str(), e->c_str());
      return 1;
    }
    GovernorOptions opt;
    if (auto e = opt.validate()) {
      std::fprintf(stderr, "qcommitd: %s\n", e->c_str());
      return 1;
    }

    struct sigaction sa{};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);

    if (virEventRegisterDefaultImpl() < 0) {
      std::fprintf(stderr, "qcommitd: cannot register the libvirt event loop\n");
      return 1;
    }
    // Wake the loop every pace interval so ticks/polls/pacing run on time without libvirt
    // traffic.
    if (virEventAddTimeout(static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                GovernorOptions{}.pace).count()),
                           wake_timer, nullptr, nullptr) < 0) {
      std::fprintf(stderr, "qcommitd: cannot add the event loop timer\n");
      return 1;
    }

    LibvirtHypervisor hv(cfg.uri);
    SystemTargetFiles files;
    Governor gov(hv, files, cfg, opt);

    std::mutex snap_mu;
    std::string snapshot = "{\"ok\":true,\"connected\":false,\"jobs\":[],\"released\":[]}";
    ControlServer server(cfg.socket_path, [&] {
      std::lock_guard<std::mutex> lk(snap_mu);
      return snapshot;
    });
    server.start();
    std::fprintf(stderr, "qcommitd: governing block jobs on %s, control socket %s\n",
                 cfg.uri.c_str(), cfg.socket_path.c_str());

    bool was_connected = false;
    std::set<std::string> known_jobs;
    FILE* trace = nullptr;
    if (!trace_path.empty()) {
      trace = std::fopen(trace_path.c_str(), "a");
      if (!trace) {
        std::fprintf(stderr, "qcommitd: %s: cannot open the trace file\n", trace_path.c_str());
        return 1;
      }
      std::fputs("mono_s,domain,disk,speed_bps,window_bytes,backlog_bytes,p99_ms,bytes_left,phase\n", trace);
    }
    auto next_trace = mono_now();
    std::size_t released_seen = 0;
    while (!g_stop) {
      const auto now = mono_now();
      (void)gov.step(now);
      GovernorStatus st = gov.status(now);
      if (st.connected != was_connected) {
        std::fprintf(stderr, "qcommitd: %s %s%s%s\n", st.connected ? "connected to" : "not connected to",
                     cfg.uri.c_str(), st.connected ? "" : ": ",
                     st.connected ? "" : hv.last_error().c_str());
        was_connected = st.connected;
      }
      // One line per adopted / released job.
      std::set<std::string> now_jobs;
      for (const auto& j : st.jobs) {
        const std::string k = j.domain + " " + j.disk;
        now_jobs.insert(k);
        if (!known_jobs.count(k))
          std::fprintf(stderr, "qcommitd: governing %s job on %s %s (target %s, storage %s)\n",
                       to_string(j.type), j.domain.c_str(), j.disk.c_str(), j.target.c_str(),
                       j.storage.c_str());
      }
      for (const auto& k : known_jobs)
        if (!now_jobs.count(k)) {
          std::string reason = "released";
          for (const auto& r : st.released)
            if (r.domain + " " + r.disk == k) { reason = r.reason; break; }
          std::fprintf(stderr, "qcommitd: %s: %s\n", k.c_str(), reason.c_str());
        }
      known_jobs.swap(now_jobs);
      if (trace && now >= next_trace) {
        next_trace = now + std::chrono::milliseconds(100);
        const double t = std::chrono::duration<double>(now.time_since_epoch()).count();
        for (const auto& j : st.jobs)
          std::fprintf(trace, "%.3f,%s,%s,%llu,%llu,%llu,%.1f,%llu,%s\n", t, j.domain.c_str(),
                       j.disk.c_str(), static_cast<unsigned long long>(j.speed_bytes_per_s),
                       static_cast<unsigned long long>(j.window_bytes),
                       static_cast<unsigned long long>(j.backlog_bytes),
                       j.latency_p99 ? std::chrono::duration<double, std::milli>(*j.latency_p99).count() : -1.0,
                       static_cast<unsigned long long>(j.bytes_left), j.phase.c_str());
        std::fflush(trace);
      }
      (void)released_seen;
      {
        std::string j = status_json(st, now);
        std::lock_guard<std::mutex> lk(snap_mu);
        snapshot = std::move(j);
      }
      if (virEventRunDefaultImpl() < 0) break;
    }
    std::fprintf(stderr, "qcommitd: stopping; governed jobs get a finishing speed\n");
    gov.release_all();
    server.stop();
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "qcommitd: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qcommitd: %s\n", e.what());
    return 1;
  }
}
