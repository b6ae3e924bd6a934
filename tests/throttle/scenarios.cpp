#include "tests/throttle/scenarios.h"

#include <algorithm>
#include <cmath>

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
