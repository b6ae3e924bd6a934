// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/budget_governor.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <string_view>
#include <utility>

#include "common/safe_file.h"
#include "common/trace_csv.h"
#include "common/units.h"
#include "qcow2/error.h"
#include "throttle/percentile.h"

namespace qcommit::engine {

namespace {
inline constexpr auto kPausedWait = std::chrono::milliseconds(10);
inline constexpr auto kWindowFullWait = std::chrono::milliseconds(1);
// The foreground samples kept for take_foreground_p99 between two calls: minutes of probes and
// co-tenant polls; later ones are dropped rather than growing without bound.
inline constexpr size_t kRecentSamples = 1 << 16;

throttle::TimePoint to_tp(Clock::time_point t) {
  return throttle::TimePoint(std::chrono::duration_cast<throttle::Duration>(t.time_since_epoch()));
}

// The trace's header (common/trace_csv.h): a column per field of a row (trace_row).
std::string trace_header() {
  return trace_csv::header_line(
      {"t_s", "fg_max_ms", "fg_samples", "fg_outstanding_ms", "copy_max_ms", "backlog_bytes",
       "drained_bytes", "bytes_done", "window_bytes", "rate_bytes_per_s", "paused", "phase",
       "queue_delay_ms", "drain_estimate_bytes_per_s", "request_bytes", "cotenant_max_ms",
       "cotenant_samples", "cotenant_outstanding_ms"});
}

// A wall-clock time as ISO 8601 in UTC with milliseconds: 2026-12-02T13:55:00.123Z.
std::string utc_iso8601(std::chrono::system_clock::time_point t) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", int(ms));
  return buf;
}
}  // namespace

// The co-tenants' state, shared by the governor and its sampling thread (which holds it alive:
// a thread stuck in the hypervisor past the governor's end touches nothing else).
struct BudgetGovernor::Feed {
  Feed(std::shared_ptr<ForegroundSource> s, Duration i) : source(std::move(s)), interval(i) {}
  const std::shared_ptr<ForegroundSource> source;
  const Duration interval;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;      // (mu)
  bool finished = false;  // (mu) the sampling thread has left its loop
  std::map<std::string, throttle::IoCounterSampler> samplers;  // (mu) per disk id
  std::vector<throttle::Duration> latencies;  // (mu) of the latest answer
  uint32_t outstanding = 0;                   // (mu) as of state_at
  std::optional<throttle::Duration> oldest;   // (mu) as of state_at
  std::optional<Clock::time_point> state_at;  // (mu)
  CotenantStats stats;                        // (mu)

  void record_locked(const std::vector<ForegroundDisk>& disks, Clock::time_point now) {
    throttle::ForegroundSignals sig;
    std::map<std::string, throttle::IoCounterSampler> next;
    for (const auto& d : disks) {
      auto node = samplers.extract(d.id);
      throttle::IoCounterSampler smp = node.empty() ? throttle::IoCounterSampler{} : node.mapped();
      smp.sample(to_tp(now), d.counters, interval, sig);
      next.insert_or_assign(d.id, smp);
    }
    samplers.swap(next);  // disks that are gone lose their history
    latencies = sig.latencies;
    outstanding = sig.outstanding;
    oldest = sig.oldest_outstanding;
    state_at = now;
    ++stats.polls;
    stats.disks = disks.size();
    stats.max_disks = std::max(stats.max_disks, disks.size());
    stats.samples += sig.latencies.size();
    if (sig.outstanding) ++stats.stall_polls;
    for (auto l : sig.latencies) stats.max_latency = std::max(stats.max_latency, l);
  }

  // The co-tenants' state as of `now`: the latencies of the latest answer, which stand for the
  // co-tenants' latency until the next answer replaces them (every controller tick until then
  // sees them: a co-tenant that waits too long must keep the rate from rising on the ticks in
  // between, on which only the copy's own samples would speak), and the suspected stalls, aged
  // by the time since.  Nothing from an answer older than two intervals (sampling is stuck).
  throttle::ForegroundSignals take(Clock::time_point now) {
    std::lock_guard lk(mu);
    throttle::ForegroundSignals out;
    if (!state_at || now < *state_at) return out;
    const Duration age = now - *state_at;
    if (age <= 2 * interval) out.latencies = latencies;
    if (age <= kCotenantStateMaxAge && outstanding) {
      out.outstanding = outstanding;
      if (oldest) out.oldest_outstanding = *oldest + age;  // still silent since
    }
    return out;
  }

  static void run(const std::shared_ptr<Feed>& f) {
    std::unique_lock lk(f->mu);
    while (!f->stop) {
      lk.unlock();
      std::vector<ForegroundDisk> disks;
      bool ok = true;
      try {
        disks = f->source->sample();
      } catch (...) {
        ok = false;  // must not throw; if it does, skip this round
      }
      const auto now = Clock::now();
      lk.lock();
      if (f->stop) break;
      if (ok) f->record_locked(disks, now);
      f->cv.wait_for(lk, f->interval, [&] { return f->stop; });
    }
    f->finished = true;
    f->cv.notify_all();
  }
};

std::string BudgetGovernorConfig::validate() const {
  if (auto e = units::budget_problem(budget)) return "the latency budget " + *e;
  if (cotenants && (cotenant_interval <= Duration::zero() || cotenant_interval > std::chrono::seconds(1)))
    return "the co-tenant sampling interval must be in (0, 1s]";
  throttle::ControllerConfig c = controller;
  c.latency_budget = throttle::request_budget(budget);
  if (auto e = c.validate()) return *e;
  return "";
}

BudgetGovernor::BudgetGovernor(BudgetGovernorConfig cfg)
    : cfg_([&] {
        cfg.controller.latency_budget = throttle::request_budget(cfg.budget);
        return cfg;
      }()),
      ctl_(cfg_.controller),
      pacer_(cfg_.controller.initial_rate_bytes_per_s),
      epoch_(Clock::now()),
      wall_epoch_(std::chrono::system_clock::now()) {
  // Before any thread starts: a trace that cannot be written throws out of the constructor, and
  // a joinable std::thread destroyed there would terminate the process.
  open_trace();
  if (cfg_.cotenants) {
    feed_ = std::make_shared<Feed>(cfg_.cotenants, cfg_.cotenant_interval);
    if (cfg_.cotenant_thread) feed_thread_ = std::thread([f = feed_] { Feed::run(f); });
  }
  decision_ = ctl_.tick({.now = tp(Clock::now())});
}

// The probe's scratch file beside BASE, created only now that the merge has passed its checks
// (a refused merge creates nothing there): unnamed where the filesystem allows it, else under an
// unpredictable name, never through anything planted in the directory (common/safe_file.h).
// Without O_DIRECT (the filesystem refuses it) the fdatasync still waits for the storage.
void BudgetGovernor::begin(Clock::time_point /*now*/) {
  if (cfg_.probe_dir.empty() || probe_fd_.valid()) return;
  safe_file::Opened probe = safe_file::create_scratch(cfg_.probe_dir, ".qcommit-probe-", true);
  if (!probe.ok())
    throw qcow2::IoError(probe.name, "cannot create the latency probe's scratch file (" + probe.problem +
                                         "); use --probe off",
                         probe.err);
  probe_fd_ = std::move(probe.fd);
  probe_thread_ = std::thread([this] { probe_loop(); });
}

void BudgetGovernor::trace_row(Clock::time_point now, const throttle::TickInput& in,
                               const std::vector<throttle::CopySample>& copy,
                               const throttle::ForegroundSignals& cot) {
  if (!trace_) return;
  auto ms = [](throttle::Duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  double fg_max = 0, copy_max = 0, cot_max = 0;
  for (auto d : in.foreground_latencies) fg_max = std::max(fg_max, ms(d));
  for (auto& c : copy) copy_max = std::max(copy_max, ms(c.latency));
  for (auto d : cot.latencies) cot_max = std::max(cot_max, ms(d));
  using trace_csv::fixed;
  using std::to_string;
  const std::string line = trace_csv::row_line(
      {fixed(std::chrono::duration<double>(now - epoch_).count(), 3), fixed(fg_max, 3),
       to_string(in.foreground_latencies.size()),
       fixed(in.foreground_oldest_outstanding ? ms(*in.foreground_oldest_outstanding) : 0.0, 3),
       fixed(copy_max, 3), to_string(in.backlog_bytes), to_string(in.drained_bytes),
       to_string(drained_total_), to_string(decision_.window_bytes),
       fixed(decision_.rate_bytes_per_s, 0), decision_.paused ? "1" : "0",
       throttle::to_string(decision_.phase), fixed(ms(decision_.queue_delay), 3),
       fixed(decision_.drain_estimate_bytes_per_s, 0), to_string(request_bytes_locked()),
       fixed(cot_max, 3), to_string(cot.latencies.size()),
       fixed(cot.oldest_outstanding ? ms(*cot.oldest_outstanding) : 0.0, 3)});
  std::fputs(line.c_str(), trace_);
}

// The merge's parameters as "# key=value" lines (readers that know only the columns skip a
// leading '#', as gnuplot and pandas' comment='#' do), then the CSV header.
void BudgetGovernor::open_trace() {
  if (cfg_.trace_path.empty()) return;
  safe_file::Opened out = safe_file::open_output(cfg_.trace_path);
  if (!out.ok()) throw qcow2::IoError(cfg_.trace_path, "cannot write the trace: " + out.problem, out.err);
  trace_ = ::fdopen(out.fd.get(), "w");
  if (!trace_) throw qcow2::IoError(cfg_.trace_path, "cannot write the trace", errno);
  (void)out.fd.release();  // the FILE owns it now
  char budget[32];
  std::snprintf(budget, sizeof budget, "%g",
                std::chrono::duration<double, std::milli>(cfg_.budget).count());
  std::string head = trace_csv::param_line("start", utc_iso8601(wall_epoch_)) +
                     trace_csv::param_line("budget_ms", budget);
  for (const auto& [key, value] : cfg_.trace_params) head += trace_csv::param_line(key, value);
  std::fputs((head + trace_header()).c_str(), trace_);
}

void BudgetGovernor::finish_trace(Clock::time_point now) {
  std::lock_guard lk(mu_);
  if (!trace_) return;
  throttle::TickInput in;
  in.now = tp(now);
  in.foreground_latencies = fg_samples_;
  in.backlog_bytes = inflight_;
  in.drained_bytes = drained_;
  drained_total_ += drained_;
  trace_row(now, in, copy_samples_, {});
  fg_samples_.clear();
  copy_samples_.clear();
  drained_ = 0;
  std::fclose(trace_);
  trace_ = nullptr;
}

BudgetGovernor::~BudgetGovernor() {
  stop_ = true;
  if (feed_thread_.joinable()) {
    bool finished;
    {
      std::unique_lock lk(feed_->mu);
      feed_->stop = true;
      feed_->cv.notify_all();
      finished = feed_->cv.wait_for(lk, kCotenantJoinTimeout, [&] { return feed_->finished; });
    }
    // Stuck in the hypervisor: leave it; it holds the Feed and the source alive by itself.
    if (finished) feed_thread_.join();
    else feed_thread_.detach();
  }
  if (probe_thread_.joinable()) probe_thread_.join();
  finish_trace(Clock::now());
}

throttle::TimePoint BudgetGovernor::tp(Clock::time_point t) const { return to_tp(t); }

void BudgetGovernor::sample_cotenants(Clock::time_point now) {
  if (!feed_) return;
  std::vector<ForegroundDisk> disks = feed_->source->sample();  // may block: no lock held
  std::lock_guard lk(feed_->mu);
  feed_->record_locked(disks, now);
}

std::optional<Duration> BudgetGovernor::take_foreground_p99() {
  std::vector<throttle::Duration> s;
  {
    std::lock_guard lk(mu_);
    s.swap(recent_fg_);
  }
  const std::optional<throttle::Duration> p99 =
      throttle::percentile(std::move(s), throttle::kP99Percent);
  if (!p99) return std::nullopt;
  return std::chrono::duration_cast<Duration>(*p99);
}

CotenantStats BudgetGovernor::cotenant_stats() {
  if (!feed_) return {};
  std::lock_guard lk(feed_->mu);
  return feed_->stats;
}

void BudgetGovernor::probe_loop() {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, kProbeBytes) != 0) return;
  std::memset(mem, 0x5a, kProbeBytes);
  while (!stop_) {
    const auto t0 = Clock::now();
    probe_started_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    const bool ok = ::pwrite(probe_fd_.get(), mem, kProbeBytes, 0) == ssize_t(kProbeBytes) && ::fdatasync(probe_fd_.get()) == 0;
    const auto t1 = Clock::now();
    probe_started_ns_ = 0;
    if (ok) {
      std::lock_guard lk(mu_);
      probe_samples_ok_ = true;
      fg_samples_.push_back(std::chrono::duration_cast<throttle::Duration>(t1 - t0));
    }
    std::this_thread::sleep_for(kProbeInterval);
  }
  free(mem);
}

void BudgetGovernor::tick(Clock::time_point now) {
  std::lock_guard lk(mu_);
  if (now < next_tick_) return;
  throttle::TickInput in;
  in.now = tp(now);
  // Foreground: the probe and the co-tenants.
  const throttle::ForegroundSignals cot = feed_ ? feed_->take(now) : throttle::ForegroundSignals{};
  std::vector<throttle::Duration> fg = fg_samples_;
  fg.insert(fg.end(), cot.latencies.begin(), cot.latencies.end());
  in.foreground_latencies = fg;
  recent_fg_.insert(recent_fg_.end(), fg.begin(),
                    fg.begin() + std::ptrdiff_t(std::min(fg.size(), kRecentSamples - std::min(kRecentSamples, recent_fg_.size()))));
  in.foreground_outstanding = cot.outstanding;
  in.foreground_oldest_outstanding = cot.oldest_outstanding;
  const int64_t started = probe_started_ns_;
  if (started) {
    const throttle::Duration age(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count() - started);
    in.foreground_outstanding += 1;
    in.foreground_oldest_outstanding = std::max(in.foreground_oldest_outstanding.value_or(age), age);
  }
  // With a working probe, its latency is what a co-tenant sees, and it is the signal. Our own
  // writes' latency also contains the queue among our own requests, part of which may never
  // reach the shared queue (the kernel serialises extending O_DIRECT writes per file, FUSE and
  // NFS split requests): steering it to the target would throttle us for a queue that delays
  // nobody else. Without a probe, our own latency is the only signal we have.
  const bool probing = probe_fd_.valid() && probe_samples_ok_;
  if (!probing) in.copy_samples = copy_samples_;
  in.backlog_bytes = inflight_;
  in.drained_bytes = drained_;
  decision_ = ctl_.tick(in);
  // Request size follows the largest window of the last one to two kRequestSizeEpoch: a window
  // that shrinks for a few seconds (a hiccup, CPU contention) must not shrink the requests too,
  // or their per-request overhead lowers the drain rate, the window, and the requests again.
  if (now - window_epoch_start_ >= kRequestSizeEpoch) {
    window_max_prev_ = window_max_cur_;
    window_max_cur_ = 0;
    window_epoch_start_ = now;
  }
  window_max_cur_ = std::max(window_max_cur_, decision_.window_bytes);
  drained_total_ += drained_;
  trace_row(now, in, copy_samples_, cot);
  fg_samples_.clear();
  copy_samples_.clear();
  drained_ = 0;
  pacer_.set_rate(in.now, std::max(1.0, decision_.rate_bytes_per_s));
  next_tick_ = now + std::max<Duration>(decision_.next_tick, std::chrono::milliseconds(1));
}

Duration BudgetGovernor::admit(Clock::time_point now, uint64_t bytes, uint64_t inflight) {
  tick(now);
  std::lock_guard lk(mu_);
  inflight_ = inflight;
  if (decision_.paused) return kPausedWait;
  if (inflight > 0 && inflight + bytes > decision_.window_bytes) return kWindowFullWait;
  const Duration wait = pacer_.wait_for(tp(now), bytes);
  if (wait > Duration::zero()) return wait;
  (void)pacer_.reserve(tp(now), bytes);
  inflight_ = inflight + bytes;
  return Duration::zero();
}

void BudgetGovernor::completed(Clock::time_point, uint64_t bytes, Duration latency) {
  std::lock_guard lk(mu_);
  copy_samples_.push_back({std::chrono::duration_cast<throttle::Duration>(latency), bytes});
  drained_ += bytes;
  inflight_ = inflight_ > bytes ? inflight_ - bytes : 0;
}

uint64_t BudgetGovernor::request_bytes_locked() const {
  const uint64_t window = std::max({window_max_prev_, window_max_cur_, decision_.window_bytes});
  uint64_t r = kChunkBytes;
  while (r > kMinRequestBytes && r * kRequestsPerWindow > window) r /= 2;
  return r;
}

uint64_t BudgetGovernor::preferred_request_bytes() {
  std::lock_guard lk(mu_);
  return request_bytes_locked();
}

throttle::Decision BudgetGovernor::last_decision() {
  std::lock_guard lk(mu_);
  return decision_;
}

}  // namespace qcommit::engine
