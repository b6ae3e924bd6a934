// SPDX-License-Identifier: GPL-2.0-or-later
// throttle_bench: runs the twelve simulator scenarios with our controller and with the best
// fixed-rate limiter for scenario 1 (found by sweep), prints one table; then the runs with
// several hosts on one storage (scenarios.h, run_multi_host) with the controller with and
// without its shared-queue probe and with the same fixed rate on every merging host.
//   throttle_bench [--scenario N]... [--hosts N]...   (default: all of both)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/throttle/scenarios.h"

using namespace qcommit::throttle::sim;

namespace {

// Highest fixed rate whose scenario-1 run keeps guest added p99 ≤ T and max ≤ 2T.
double best_fixed_rate() {
  double best = 0;
  for (int mbps = 5; mbps <= 100; mbps += 5) {
    Policy p{PolicyKind::FixedRate, mbps * kMBps};
    const auto r = run_scenario(1, p);
    const auto s = summarize(r);
    const bool ok = s.p99_ms <= static_cast<double>(kBudget) / kMs &&
                    s.max_ms <= 2.0 * static_cast<double>(kBudget) / kMs;
    std::fprintf(stderr, "sweep fixed %3d MB/s: p99 %8.1f ms max %8.1f ms copy %5.1f%% %s\n", mbps,
                 s.p99_ms, s.max_ms, s.copy_pct_of_leftover, ok ? "ok" : "over budget");
    if (ok) best = mbps * kMBps;
  }
  return best;
}

void cell(const Summary& s) {
  if (s.has_guest)
    std::printf(" %7.1f %7.1f %8.1f %6.1f%% |", s.p50_ms, s.p99_ms, s.max_ms, s.copy_pct_of_leftover);
  else
    std::printf(" %7s %7s %8s %6.1f%% |", "-", "-", "-", s.copy_pct_of_leftover);
}

// Worst guest p99 and max, the merges' share of the leftover, Jain's index between them.
void host_cell(const MultiHostSummary& s) {
  std::printf(" %7.1f %8.1f %6.1f%% %5.2f |", s.worst_p99_ms, s.worst_max_ms, s.total_share_pct,
              s.jain);
}

void multi_host_table(const std::vector<int>& hosts, double fixed) {
  std::printf(
      "\nseveral hosts on one storage (C = %.0f MB/s, T = %.0f ms); worst guest added "
      "latency in ms (p99 max), merges' share of leftover, Jain between merges\n",
      kCapacity / kMBps, static_cast<double>(kBudget) / kMs);
  std::printf("%-32s | %-31s | %-31s | %-31s\n", "hosts, layout", "probe + synced slowdowns",
              "controller, no probe", "fixed rate (best for 1)");
  std::printf("%-32s |", "");
  for (int i = 0; i < 3; ++i) std::printf(" %7s %8s %7s %5s |", "p99", "max", "merges", "Jain");
  std::printf("\n");
  std::vector<std::string> details;
  for (int n : hosts) {
    for (HostLayout layout : {HostLayout::GuestsEverywhere, HostLayout::HiddenGuests,
                              HostLayout::HiddenGuestsCapacityDrop}) {
      const auto probe = run_multi_host(n, layout, Policy{PolicyKind::Controller, 0, true, true});
      const auto plain = run_multi_host(n, layout, Policy{PolicyKind::Controller, 0, false, false});
      const auto fix = run_multi_host(n, layout, Policy{PolicyKind::FixedRate, fixed});
      // Each change alone.
      const auto probe_only =
          summarize(run_multi_host(n, layout, Policy{PolicyKind::Controller, 0, true, false}));
      const auto clock_only =
          summarize(run_multi_host(n, layout, Policy{PolicyKind::Controller, 0, false, true}));
      const auto sp = summarize(probe);
      std::printf("%-32s |", probe.name.c_str());
      host_cell(sp);
      host_cell(summarize(plain));
      host_cell(summarize(fix));
      std::printf("\n");
      // Each guest and each merge of the probe run.
      std::string line = "  " + probe.name + " (probe load " +
                         std::to_string(sp.probe_load_pct).substr(0, 5) + "% of C): guests";
      char buf[96];
      for (const auto& g : sp.guests) {
        std::snprintf(buf, sizeof buf, " h%d%s %.1f/%.1f", g.host, g.seen ? "" : "*", g.p99_ms,
                      g.max_ms);
        line += buf;
      }
      line += "; merges";
      for (double x : sp.share_pct) {
        std::snprintf(buf, sizeof buf, " %.1f%%", x);
        line += buf;
      }
      std::snprintf(buf, sizeof buf, "; probe alone %.1f/%.1f ms Jain %.2f",
                    probe_only.worst_p99_ms, probe_only.worst_max_ms, probe_only.jain);
      line += buf;
      std::snprintf(buf, sizeof buf, ", synced slowdowns alone %.1f/%.1f ms Jain %.2f",
                    clock_only.worst_p99_ms, clock_only.worst_max_ms, clock_only.jain);
      line += buf;
      details.push_back(line);
    }
  }
  std::printf(
      "probe + synced slowdowns: each guest's p99/max ms (* = on a host without a merge: "
      "seen by no controller), each merge's share of leftover; then worst p99/max and "
      "Jain with each change alone:\n");
  for (const auto& d : details) std::printf("%s\n", d.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> which, hosts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--scenario") == 0 && i + 1 < argc) {
      which.push_back(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--hosts") == 0 && i + 1 < argc) {
      hosts.push_back(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "throttle_bench: unknown argument %s (use --scenario N, --hosts N)\n",
                   argv[i]);
      return 2;
    }
  }
  if (which.empty() && hosts.empty()) {
    for (int n = 1; n <= kScenarioCount; ++n) which.push_back(n);
    for (int n : kMultiHostCounts) hosts.push_back(n);
  }
  const double fixed = best_fixed_rate();
  if (fixed <= 0) {
    std::fprintf(stderr, "throttle_bench: no fixed rate keeps scenario 1 within budget\n");
    return 1;
  }
  if (!which.empty()) {
    std::printf(
        "budget T = %.0f ms, C = %.0f MB/s; added latency in ms (p50 p99 max), copy as %% of "
        "leftover bandwidth\n",
        static_cast<double>(kBudget) / kMs, kCapacity / kMBps);
    std::printf("%-32s | %-35s | %-35s\n", "scenario", "controller", "fixed rate (best for 1)");
    std::printf("%-32s | %7s %7s %8s %7s | %7s %7s %8s %7s |\n", "", "p50", "p99", "max", "copy",
                "p50", "p99", "max", "copy");
    for (int n : which) {
      const auto c = run_scenario(n, Policy{PolicyKind::Controller, 0});
      const auto f = run_scenario(n, Policy{PolicyKind::FixedRate, fixed});
      std::printf("%-32s |", c.name.c_str());
      cell(summarize(c));
      cell(summarize(f));
      std::printf("\n");
    }
  }
  std::printf("fixed rate = %.0f MB/s (highest 5 MB/s step keeping scenario 1 within p99 <= T, max <= 2T)\n",
              fixed / kMBps);
  if (!hosts.empty()) multi_host_table(hosts, fixed);
  return 0;
}
