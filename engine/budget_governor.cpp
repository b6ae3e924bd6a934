#include "engine/budget_governor.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace qcommit::engine {

namespace {
inline constexpr auto kPausedWait = std::chrono::milliseconds(10);
inline constexpr auto kWindowFullWait = std::chrono::milliseconds(1);
}  // namespace

std::string BudgetGovernorConfig::validate() const {
  if (budget <= Duration::zero()) return "the latency budget must be positive";
  if (budget > std::chrono::seconds(60)) return "a latency budget over 60 s makes no sense; use --budget off";
  throttle::ControllerConfig c = controller;
  c.latency_budget = budget;
  if (auto e = c.validate()) return *e;
  return "";
}

BudgetGovernor::BudgetGovernor(BudgetGovernorConfig cfg)
    : cfg_([&] {
        cfg.controller.latency_budget = cfg.budget;
        return cfg;
      }()),
      ctl_(cfg_.controller),
      pacer_(cfg_.controller.initial_rate_bytes_per_s),
      epoch_(Clock::now()) {
  if (!cfg_.probe_dir.empty()) {
    probe_path_ = cfg_.probe_dir + "/.qcommit-probe-" + std::to_string(getpid());
    probe_fd_ = ::open(probe_path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (probe_fd_ < 0)  // no O_DIRECT here: the fdatasync still waits for the storage
      probe_fd_ = ::open(probe_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (probe_fd_ >= 0) {
      ::unlink(probe_path_.c_str());
      probe_thread_ = std::thread([this] { probe_loop(); });
    }
  }
  if (!cfg_.trace_path.empty()) {
    trace_ = std::fopen(cfg_.trace_path.c_str(), "w");
    if (trace_)
      std::fputs("t_s,fg_max_ms,fg_samples,fg_outstanding_ms,copy_max_ms,backlog_bytes,drained_bytes,"
                 "bytes_done,window_bytes,rate_bytes_per_s,paused,phase,queue_delay_ms,drain_estimate_bytes_per_s,"
                 "request_bytes\n",
                 trace_);
  }
  decision_ = ctl_.tick({.now = tp(Clock::now())});
}

void BudgetGovernor::trace_row(Clock::time_point now, const throttle::TickInput& in,
                               const std::vector<throttle::CopySample>& copy) {
  if (!trace_) return;
  auto ms = [](throttle::Duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  double fg_max = 0, copy_max = 0;
  for (auto d : in.foreground_latencies) fg_max = std::max(fg_max, ms(d));
  for (auto& c : copy) copy_max = std::max(copy_max, ms(c.latency));
  std::fprintf(trace_, "%.3f,%.3f,%zu,%.3f,%.3f,%llu,%llu,%llu,%llu,%.0f,%d,%s,%.3f,%.0f,%llu\n",
               std::chrono::duration<double>(now - epoch_).count(), fg_max, in.foreground_latencies.size(),
               in.foreground_oldest_outstanding ? ms(*in.foreground_oldest_outstanding) : 0.0, copy_max,
               (unsigned long long)in.backlog_bytes, (unsigned long long)in.drained_bytes,
               (unsigned long long)drained_total_, (unsigned long long)decision_.window_bytes,
               decision_.rate_bytes_per_s, decision_.paused ? 1 : 0, throttle::to_string(decision_.phase),
               ms(decision_.queue_delay), decision_.drain_estimate_bytes_per_s,
               (unsigned long long)request_bytes_locked());
}

BudgetGovernor::~BudgetGovernor() {
  stop_ = true;
  if (probe_thread_.joinable()) probe_thread_.join();
  if (probe_fd_ >= 0) ::close(probe_fd_);
  if (trace_) std::fclose(trace_);
}

throttle::TimePoint BudgetGovernor::tp(Clock::time_point t) const {
  return throttle::TimePoint(std::chrono::duration_cast<throttle::Duration>(t.time_since_epoch()));
}

void BudgetGovernor::probe_loop() {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, kProbeBytes) != 0) return;
  std::memset(mem, 0x5a, kProbeBytes);
  while (!stop_) {
    const auto t0 = Clock::now();
    probe_started_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    const bool ok = ::pwrite(probe_fd_, mem, kProbeBytes, 0) == ssize_t(kProbeBytes) && ::fdatasync(probe_fd_) == 0;
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
  in.foreground_latencies = fg_samples_;
  const int64_t started = probe_started_ns_;
  if (started) {
    in.foreground_outstanding = 1;
    in.foreground_oldest_outstanding =
        std::chrono::nanoseconds(std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count() - started);
  }
  // With a working probe, its latency is what a co-tenant sees, and it is the signal. Our own
  // writes' latency also contains the queue among our own requests, part of which may never
  // reach the shared queue (the kernel serialises extending O_DIRECT writes per file, FUSE and
  // NFS split requests): steering it to the target would throttle us for a queue that delays
  // nobody else. Without a probe, our own latency is the only signal we have.
  const bool probing = probe_fd_ >= 0 && probe_samples_ok_;
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
  trace_row(now, in, copy_samples_);
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
