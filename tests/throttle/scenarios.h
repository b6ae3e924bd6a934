// SPDX-License-Identifier: GPL-2.0-or-later
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
  bool probe = false;     // Controller only, multi-host runs: the shared-queue probe
  bool wall_clock = false;  // Controller only, multi-host runs: slowdowns on the synced clock
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

// ---- Several hosts on one FIFO storage ----------------------------------------------------------
// Each host runs its own controller the way qcommitd does: it paces a job whose I/O it does not
// see (no copy latencies; backlog and drained bytes only), sees only its own host's guests
// (and whether they are idle), and, with Policy::probe, its own shared-queue probe.  Hosts'
// monotonic clocks have seeded random offsets; with Policy::wall_clock the controllers are also
// given a synchronised wall clock, off by at most kWallClockError (NTP on a LAN).  Merges start
// kMergeStagger apart and all run until the end.  Layouts:
//  * GuestsEverywhere: every host runs a flush guest (100 write+fsync/s) and a merge;
//  * HiddenGuests: the first max(1, N/2) hosts merge and their guests are idle (the merged guest
//    idles, as in the lab); every other host runs a flush guest no merging host can see;
//  * HiddenGuestsCapacityDrop: HiddenGuests, then, after the fairness window, the storage gives
//    kDropFraction of its capacity for kDropLength (another export of the same server got busy)
//    and recovers for kAfterDrop: the windows, sized from the drain rates before, are too large
//    until the drain estimates fall.
inline constexpr int kMultiHostCounts[] = {2, 4, 8};
inline constexpr Ns kMergeStagger = 5 * kSec;
inline constexpr Ns kAllMergingFor = 60 * kSec;         // run length after the last merge started
inline constexpr Ns kSettleAfterLastStart = 10 * kSec;  // fairness measured from then on
inline constexpr Ns kWallClockError = 2 * kMs;

inline constexpr double kDropFraction = 0.4;
inline constexpr Ns kDropLength = 10 * kSec;
inline constexpr Ns kAfterDrop = 5 * kSec;

enum class HostLayout { GuestsEverywhere, HiddenGuests, HiddenGuestsCapacityDrop };
[[nodiscard]] const char* to_string(HostLayout l);

struct MultiHostRun {
  int hosts = 0;
  HostLayout layout = HostLayout::GuestsEverywhere;
  std::string name;
  std::unique_ptr<Simulator> sim;
  std::vector<int> jobs;         // one per merging host
  std::vector<int> guest_hosts;  // host of guest i
  std::vector<bool> guest_seen;  // guest i is on a merging host
  Ns from = 0;                   // all merges running and settled (fairness measured here)
  Ns to = 0;
  Ns end = 0;  // guests' latency measured over [0, end)
};

[[nodiscard]] MultiHostRun run_multi_host(int hosts, HostLayout layout, const Policy& p);

struct GuestResult {
  int host = 0;
  bool seen = false;  // on a merging host (its controller sees it)
  double p99_ms = 0, max_ms = 0;
};

struct MultiHostSummary {
  std::vector<GuestResult> guests;  // whole run
  std::vector<double> share_pct;    // each merge, % of the leftover in [from, to)
  double total_share_pct = 0;
  double jain = 0;  // between the merges (1 with one merge)
  double worst_p99_ms = 0, worst_max_ms = 0;
  double probe_load_pct = 0;  // probes' bytes, % of the capacity
};
[[nodiscard]] MultiHostSummary summarize(const MultiHostRun& r);

// Jain's fairness index (Σx)² / (n Σx²): 1 when all equal, 1/n when one takes everything.
[[nodiscard]] double jain_index(const std::vector<double>& x);

}  // namespace qcommit::throttle::sim
