// throttle_bench: runs the twelve simulator scenarios with our controller and with the best
// fixed-rate limiter for scenario 1 (found by sweep), prints one table.
//   throttle_bench [--scenario N]...   (default: all)
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> which;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--scenario") == 0 && i + 1 < argc) {
      which.push_back(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "throttle_bench: unknown argument %s (use --scenario N)\n", argv[i]);
      return 2;
    }
  }
  if (which.empty())
    for (int n = 1; n <= kScenarioCount; ++n) which.push_back(n);
  const double fixed = best_fixed_rate();
  if (fixed <= 0) {
    std::fprintf(stderr, "throttle_bench: no fixed rate keeps scenario 1 within budget\n");
    return 1;
  }
  std::printf("budget T = %.0f ms, C = %.0f MB/s; added latency in ms (p50 p99 max), copy as %% of "
              "leftover bandwidth\n", static_cast<double>(kBudget) / kMs, kCapacity / kMBps);
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
  std::printf("fixed rate = %.0f MB/s (highest 5 MB/s step keeping scenario 1 within p99 <= T, max <= 2T)\n",
              fixed / kMBps);
  return 0;
}
