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
      "usage: qcommitd [--config PATH] [--uri URI] [--socket PATH]\n"
      "  --config PATH   policy file (default /etc/qcommit/qcommitd.conf; missing = defaults)\n"
      "  --uri URI       libvirt connection (default qemu:///system)\n"
      "  --socket PATH   control socket (default /run/qcommit/qcommitd.sock)\n",
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
  std::string uri, socket_path;
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
    // Wake the loop every 20 ms so ticks/polls run on time even without libvirt traffic.
    if (virEventAddTimeout(20, wake_timer, nullptr, nullptr) < 0) {
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
