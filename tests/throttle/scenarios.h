// The twelve storage scenarios of the controller, shared by the doctest cases and by
// throttle_bench (which runs each one with our controller and with a fixed-rate limiter).
// Budget T = 20 ms and C = 100 MB/s unless a scenario says otherwise.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/throttle/sim.h"

namespace qcommit::throttle::sim {

inline constexpr Ns kBudget = 20 * kMs;
inline constexpr double kCapacity = 100 * kMBps;
inline constexpr int kScenarioCount = 12;

struct Policy {
  PolicyKind kind = PolicyKind::Controller;
  double fixed_rate = 0;  // FixedRate only
};

struct ScenarioRun {
  int number = 0;
  std::string name;
  std::unique_ptr<Simulator> sim;
  std::vector<int> jobs;
  Ns from = 0;               // summary window
  Ns to = 0;
  double capacity_bytes = 0; // storage capacity integrated over [from, to)
  bool has_guest = true;
};

[[nodiscard]] ControllerConfig default_controller_config();
[[nodiscard]] JobConfig copy_job(const Policy& p, std::uint64_t bytes, Ns start = 0);

// Builds and runs scenario n (1..12) to completion.
[[nodiscard]] ScenarioRun run_scenario(int n, const Policy& p);

// Guest added latency (ms) of requests submitted in [a, b).
[[nodiscard]] std::vector<double> added_ms(const Simulator& s, Ns a, Ns b);
[[nodiscard]] double percentile(std::vector<double> v, double p);  // p in [0, 100]

struct Summary {
  double p50_ms = 0, p99_ms = 0, max_ms = 0;
  double copy_pct_of_leftover = 0;
  bool has_guest = true;
};
[[nodiscard]] Summary summarize(const ScenarioRun& r);

}  // namespace qcommit::throttle::sim
