// SPDX-License-Identifier: GPL-2.0-or-later
#include "tests/throttle/scenarios.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace qcommit::throttle::sim {

ControllerConfig default_controller_config() {
  ControllerConfig c;
  c.latency_budget = Duration(kBudget);
  return c;
}

JobConfig copy_job(const Policy& p, std::uint64_t bytes, Ns start) {
  JobConfig j;
  j.policy = p.kind;
  j.controller = default_controller_config();
  j.fixed_rate = p.fixed_rate;
  j.total_bytes = bytes;
  j.start = start;
  // Baselines behave like QEMU's mirror: 1 MiB requests, 16 in flight.
  j.max_io = p.kind == PolicyKind::Controller ? 256 * kKiB : 1 * kMiBytes;
  return j;
}

namespace {

GuestConfig flush_guest(Ns start = 0, Ns end = INT64_MAX) {
  GuestConfig g;
  g.kind = GuestKind::SyncPeriodic;
  g.io_bytes = 4 * kKiB;
  g.interval = 10 * kMs;  // 100 write+fsync per second
  g.start = start;
  g.end = end;
  return g;
}

constexpr std::uint64_t kSeed = 20240601;

}  // namespace

ScenarioRun run_scenario(int n, const Policy& p) {
  ScenarioRun r;
  r.number = n;
  StorageConfig st;
  PageCacheConfig pc;
  const std::uint64_t seed = kSeed + static_cast<std::uint64_t>(n);
  auto make = [&] { r.sim = std::make_unique<Simulator>(st, pc, seed); };
  switch (n) {
    case 1: {
      r.name = "1 flush 100/s, 20 GiB copy";
      make();
      r.sim->add_guest(flush_guest());
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->run(1000 * kSec);
      r.from = 0;
      r.to = r.sim->now();
      r.capacity_bytes = kCapacity * static_cast<double>(r.to - r.from) / kSec;
      break;
    }
    case 2: {
      r.name = "2 idle 30 s, then flushes";
      make();
      r.sim->add_guest(flush_guest(30 * kSec));
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->run(60 * kSec);
      r.from = 0;
      r.to = 60 * kSec;
      r.capacity_bytes = kCapacity * 60;
      break;
    }
    case 3:
    case 4: {
      r.name = n == 3 ? "3 capacity 100->30 MB/s" : "4 capacity 30->100 MB/s";
      make();
      r.sim->add_guest(flush_guest());
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->at_capacity(30 * kSec, 30 * kMBps);
      if (n == 4) r.sim->at_capacity(60 * kSec, kCapacity);
      r.sim->run((n == 3 ? 60 : 90) * kSec);
      r.from = n == 3 ? 30 * kSec : 60 * kSec;
      r.to = n == 3 ? 60 * kSec : 90 * kSec;
      r.capacity_bytes = (n == 3 ? 30 * kMBps : kCapacity) * 30;
      break;
    }
    case 5: {
      r.name = "5 2 s storage stall";
      make();
      r.sim->add_guest(flush_guest());
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->stall(30 * kSec, 32 * kSec);
      r.sim->run(45 * kSec);
      r.from = 25 * kSec;
      r.to = 45 * kSec;
      r.capacity_bytes = kCapacity * 18;  // 20 s minus the 2 s stall
      break;
    }
    case 6: {
      r.name = "6 buffered copy, 2 GiB cache";
      pc.enabled = true;
      make();
      r.sim->add_guest(flush_guest());
      JobConfig j = copy_job(p, 6 * kGiB);
      j.buffered = true;
      r.jobs.push_back(r.sim->add_job(j));
      r.sim->run(300 * kSec);
      r.from = 0;
      r.to = r.sim->now();
      r.capacity_bytes = kCapacity * static_cast<double>(r.to) / kSec;
      break;
    }
    case 7: {
      r.name = "7 guest uses 95% of C";
      make();
      GuestConfig g;
      g.kind = GuestKind::OpenLoop;
      g.io_bytes = 64 * kKiB;
      g.rate = 0.95 * kCapacity;
      r.sim->add_guest(g);
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->run(60 * kSec);
      r.from = 0;
      r.to = 60 * kSec;
      r.capacity_bytes = kCapacity * 60;
      break;
    }
    case 8: {
      r.name = "8 two copies, 2nd at +60 s";
      make();
      r.sim->add_guest(flush_guest());
      r.jobs.push_back(r.sim->add_job(copy_job(p, 40 * kGiB)));
      r.jobs.push_back(r.sim->add_job(copy_job(p, 40 * kGiB, 60 * kSec)));
      r.sim->run(180 * kSec);
      r.from = 0;
      r.to = 180 * kSec;
      r.capacity_bytes = kCapacity * 180;
      break;
    }
    case 9: {
      r.name = "9 base latency +15 ms";
      make();
      r.sim->add_guest(flush_guest());
      r.jobs.push_back(r.sim->add_job(copy_job(p, 20 * kGiB)));
      r.sim->at_base_latency(30 * kSec, st.base_latency + 15 * kMs);
      r.sim->run(90 * kSec);
      r.from = 30 * kSec;
      r.to = 90 * kSec;
      r.capacity_bytes = kCapacity * 60;
      break;
    }
    case 10: {
      r.name = "10 noise sigma 0.5, no guest";
      st.noise_sigma = 0.5;
      make();
      r.has_guest = false;
      r.jobs.push_back(r.sim->add_job(copy_job(p, 200 * kGiB)));
      r.sim->run(600 * kSec);
      r.from = 0;
      r.to = 600 * kSec;
      r.capacity_bytes = kCapacity * 600;
      break;
    }
    case 11: {
      r.name = "11 tick jitter, lost samples";
      make();
      r.sim->add_guest(flush_guest());
      JobConfig j = copy_job(p, 20 * kGiB);
      j.tick_jitter_max = 300 * kMs;
      j.sample_loss = 0.3;
      j.tick_loss = 0.2;
      r.jobs.push_back(r.sim->add_job(j));
      r.sim->run(1000 * kSec);
      r.from = 0;
      r.to = r.sim->now();
      r.capacity_bytes = kCapacity * static_cast<double>(r.to) / kSec;
      break;
    }
    case 12: {
      r.name = "12 cancel at 10 s";
      make();
      r.sim->add_guest(flush_guest());
      JobConfig j = copy_job(p, 20 * kGiB);
      j.cancel_at = 10 * kSec;
      r.jobs.push_back(r.sim->add_job(j));
      r.sim->run(15 * kSec);
      r.from = 0;
      r.to = 10 * kSec;
      r.capacity_bytes = kCapacity * 10;
      break;
    }
    default:
      r.name = "unknown scenario";
      make();
      break;
  }
  return r;
}

std::vector<double> added_ms(const Simulator& s, Ns a, Ns b) {
  std::vector<double> v;
  for (const auto& g : s.guest_samples())
    if (g.submit >= a && g.submit < b) v.push_back(static_cast<double>(g.added) / kMs);
  return v;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(rank));
  const auto hi = static_cast<std::size_t>(std::ceil(rank));
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

namespace {

constexpr std::uint64_t kMultiHostSeed = 20261202;
constexpr std::uint64_t kEndlessMergeBytes = 1024 * kGiB;  // still running at the end

}  // namespace

const char* to_string(HostLayout l) {
  switch (l) {
    case HostLayout::GuestsEverywhere:
      return "guests everywhere";
    case HostLayout::HiddenGuests:
      return "hidden guests";
    case HostLayout::HiddenGuestsCapacityDrop:
      return "hidden, capacity drop";
  }
  return "?";
}

namespace {

int merging_hosts(int hosts, HostLayout layout) {
  return layout == HostLayout::GuestsEverywhere ? hosts : std::max(1, hosts / 2);
}

// A merge on `host` as qcommitd governs it (see run_multi_host).
JobConfig host_merge(const Policy& p, int host, Ns start, Ns clock_offset) {
  JobConfig j = copy_job(p, kEndlessMergeBytes, start);
  j.host = host;
  j.copy_latency_visible = false;
  // As qcommitd: its own queue at storage and its guests' largest requests (TickInput::
  // own_queue_bytes, foreground_own_bytes).
  j.own_queue_visible = true;
  j.idle_signal = true;
  j.clock_offset = clock_offset;
  // A simulated guest's write+fsync is one FIFO request, and so is the probe.
  j.controller.probe_requests_per_sample = 1;
  if (p.probe) j.probe = ProbeConfig{};
  return j;
}

}  // namespace

MultiHostRun run_multi_host(int hosts, HostLayout layout, const Policy& p) {
  MultiHostRun r;
  r.hosts = hosts;
  r.layout = layout;
  r.name = std::to_string(hosts) + " hosts, " + to_string(layout);
  const std::uint64_t seed =
      kMultiHostSeed + static_cast<std::uint64_t>(hosts) * 4 + static_cast<std::uint64_t>(layout);
  r.sim = std::make_unique<Simulator>(StorageConfig{}, PageCacheConfig{}, seed);
  std::mt19937_64 offsets(seed);
  std::uniform_int_distribution<Ns> offset(0,
                                           default_controller_config().slowdown_interval.count());
  std::uniform_int_distribution<Ns> ntp_error(-kWallClockError, kWallClockError);
  const int merging = merging_hosts(hosts, layout);
  for (int h = 0; h < hosts; ++h) {
    const bool merges = h < merging;
    if (!merges || layout == HostLayout::GuestsEverywhere) {
      GuestConfig g = flush_guest();
      g.host = h;
      r.sim->add_guest(g);
      r.guest_hosts.push_back(h);
      r.guest_seen.push_back(merges);
    }
    if (!merges) continue;
    JobConfig j = host_merge(p, h, h * kMergeStagger, offset(offsets));
    const Ns error = ntp_error(offsets);
    if (p.wall_clock) j.wall_clock_error = error;
    r.jobs.push_back(r.sim->add_job(j));
  }
  const Ns last_start = (merging - 1) * kMergeStagger;
  r.from = last_start + kSettleAfterLastStart;
  r.to = last_start + kAllMergingFor;
  r.end = r.to;
  if (layout == HostLayout::HiddenGuestsCapacityDrop) {
    r.sim->at_capacity(r.to, kDropFraction * kCapacity);
    r.sim->at_capacity(r.to + kDropLength, kCapacity);
    r.end = r.to + kDropLength + kAfterDrop;
  }
  r.sim->run(r.end);
  return r;
}

double jain_index(const std::vector<double>& x) {
  double sum = 0, sum2 = 0;
  for (double v : x) {
    sum += v;
    sum2 += v * v;
  }
  return sum2 > 0 ? sum * sum / (static_cast<double>(x.size()) * sum2) : 0;
}

MultiHostSummary summarize(const MultiHostRun& r) {
  MultiHostSummary s;
  std::vector<std::vector<double>> per_guest(r.guest_hosts.size());
  for (const auto& g : r.sim->guest_samples())
    if (g.submit < r.end)
      per_guest[static_cast<std::size_t>(g.guest)].push_back(static_cast<double>(g.added) / kMs);
  for (std::size_t i = 0; i < per_guest.size(); ++i) {
    const auto& v = per_guest[i];
    GuestResult gr{r.guest_hosts[i], r.guest_seen[i], percentile(v, 99),
                   v.empty() ? 0 : *std::max_element(v.begin(), v.end())};
    s.worst_p99_ms = std::max(s.worst_p99_ms, gr.p99_ms);
    s.worst_max_ms = std::max(s.worst_max_ms, gr.max_ms);
    s.guests.push_back(gr);
  }
  const double leftover = kCapacity - r.sim->guest_throughput(r.from, r.to);
  std::vector<double> rates;
  std::uint64_t probe_bytes = 0;
  for (int j : r.jobs) {
    const double x = r.sim->job(j).throughput(r.from, r.to);
    rates.push_back(x);
    s.share_pct.push_back(100.0 * x / leftover);
    s.total_share_pct += 100.0 * x / leftover;
    probe_bytes += r.sim->job(j).probe_bytes;
  }
  s.jain = jain_index(rates);
  s.probe_load_pct =
      100.0 * static_cast<double>(probe_bytes) / (kCapacity * static_cast<double>(r.end) / kSec);
  return s;
}

Summary summarize(const ScenarioRun& r) {
  Summary s;
  s.has_guest = r.has_guest;
  const auto lat = added_ms(*r.sim, r.from, r.to);
  s.p50_ms = percentile(lat, 50);
  s.p99_ms = percentile(lat, 99);
  s.max_ms = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  const double secs = static_cast<double>(r.to - r.from) / kSec;
  double copy = 0;
  for (int j : r.jobs) copy += r.sim->job(j).throughput(r.from, r.to);
  const double leftover = r.capacity_bytes / secs - r.sim->guest_throughput(r.from, r.to);
  s.copy_pct_of_leftover = leftover > 0 ? 100.0 * copy / leftover : 0;
  return s;
}

}  // namespace qcommit::throttle::sim
