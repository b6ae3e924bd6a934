// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/copy_trial.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include "engine/budget_governor.h"
#include "engine/copy_pool.h"
#include "common/safe_file.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The merge's governor (or none), with every completion counted on the way.
class CountingGovernor final : public CopyGovernor {
 public:
  CountingGovernor(std::shared_ptr<CopyGovernor> inner, Clock::time_point start)
      : inner_(std::move(inner)), start_(start) {}
  Duration admit(Clock::time_point now, uint64_t bytes, uint64_t inflight) override {
    return inner_ ? inner_->admit(now, bytes, inflight) : Duration::zero();
  }
  void completed(Clock::time_point now, uint64_t bytes, Duration latency) override {
    if (inner_) inner_->completed(now, bytes, latency);
    std::lock_guard lk(mu_);
    done_ += bytes;
    completions_.emplace_back(seconds_between(start_, now), done_);
  }
  void tick(Clock::time_point now) override {
    if (inner_) inner_->tick(now);
  }
  uint64_t preferred_request_bytes() override {
    return inner_ ? inner_->preferred_request_bytes() : kChunkBytes;
  }
  std::vector<std::pair<double, uint64_t>> completions() {
    std::lock_guard lk(mu_);
    return completions_;
  }

 private:
  std::shared_ptr<CopyGovernor> inner_;
  Clock::time_point start_;
  std::mutex mu_;
  uint64_t done_ = 0;
  std::vector<std::pair<double, uint64_t>> completions_;
};

// Bytes completed `s` seconds into the trial: linear between two completions.
double bytes_at(const std::vector<std::pair<double, uint64_t>>& c, double s) {
  if (c.empty() || s <= 0) return 0;
  double t0 = 0, b0 = 0;
  for (const auto& [t, b] : c) {
    if (t >= s) {
      if (t <= t0) return double(b);
      return b0 + (double(b) - b0) * (s - t0) / (t - t0);
    }
    t0 = t;
    b0 = double(b);
  }
  return b0;
}

// Seconds to copy `bytes` at a rate that starts at `rate` and grows by `growth` bytes/s per
// second up to `cap`.
double time_to_copy(double bytes, double rate, double growth, double cap) {
  rate = std::min(rate, cap);
  if (!(growth > 0) || rate >= cap) return bytes / rate;
  const double t_cap = std::isfinite(cap) ? (cap - rate) / growth : 0;
  const double bytes_to_cap = rate * t_cap + growth * t_cap * t_cap / 2;
  if (!std::isfinite(cap) || bytes <= bytes_to_cap)
    return (std::sqrt(rate * rate + 2 * growth * bytes) - rate) / growth;
  return t_cap + (bytes - bytes_to_cap) / cap;
}

}  // namespace

CopyTrial run_copy_trial(const CopyTrialOptions& opt) {
  CopyTrial trial;
  const UniqueFd src(::open(opt.source.c_str(), O_RDONLY | O_CLOEXEC));
  if (!src.valid()) {
    const int err = errno;
    throw qcow2::IoError(opt.source, std::string("cannot open: ") + std::strerror(err), err);
  }
  struct stat sst {};
  if (::fstat(src.get(), &sst) != 0) {
    const int err = errno;
    throw qcow2::IoError(opt.source, std::string("fstat: ") + std::strerror(err), err);
  }
  uint64_t total = std::min<uint64_t>(opt.bytes, uint64_t(sst.st_size));
  struct statvfs vfs {};
  if (::statvfs(opt.dir.c_str(), &vfs) == 0)
    total = std::min<uint64_t>(total, uint64_t(vfs.f_bavail) * vfs.f_frsize / kTrialFreeSpaceShare);
  total -= total % kDirectAlignment;
  if (total == 0) return trial;

  // Unnamed, or under an unpredictable name unlinked at once: nothing planted in BASE's directory
  // is opened (common/safe_file.h).
  safe_file::Opened scratch = safe_file::create_scratch(opt.dir, ".qcommit-measure-");
  if (!scratch.ok())
    throw qcow2::IoError(scratch.name, "cannot create the scratch file: " + scratch.problem, scratch.err);
  const UniqueFd fd = std::move(scratch.fd);
  const std::string name = opt.dir + "/(scratch file)";  // for messages: it has no name now
  // O_DIRECT through the descriptor already open, as the merge reopens BASE.
  const std::string self = "/proc/self/fd/" + std::to_string(fd.get());
  const UniqueFd direct(::open(self.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC));
  trial.direct_io = direct.valid();
  (void)::fallocate(fd.get(), 0, 0, off_t(total));  // new space, as the merge allocates it

  // The merge's request sizes: device requests of whole clusters; unthrottled, copy requests of
  // a whole number of them; governed, the governor's preferred size.
  uint64_t piece = trial.direct_io ? device_request_bytes(direct.get()) : kChunkBytes;
  uint64_t unthrottled_request = kChunkBytes;
  const uint64_t grain = std::max(kDirectAlignment, opt.grain);
  if (piece >= grain) {
    piece -= piece % grain;
    unthrottled_request -= kChunkBytes % piece;
  }
  trial.request_bytes = piece;
  trial.governed = opt.governor != nullptr;
  trial.ceiling_bytes_per_s = opt.ceiling_bytes_per_s;

  const auto start = Clock::now();
  auto counting = std::make_shared<CountingGovernor>(opt.governor, start);
  {
    CopyPool pool(kDefaultIoThreads, kDefaultInflightBytes, counting.get(), piece);
    uint64_t off = 0;
    while (off < total && Clock::now() - start < opt.max_time) {
      uint64_t req = unthrottled_request;
      if (opt.governor) {
        req = std::clamp<uint64_t>(opt.governor->preferred_request_bytes(), kDirectAlignment,
                                   kChunkBytes);
        req -= req % kDirectAlignment;
      }
      const uint64_t n = std::min(req, total - off);
      CopyJob job;
      job.sources.push_back(CopySource{src.get(), off, n, &opt.source});
      job.dst_fd = trial.direct_io ? direct.get() : fd.get();
      job.dst_offset = off;
      job.length = n;
      job.direct_dst = trial.direct_io;
      job.buffered_dst = !trial.direct_io;
      job.dst_name = &name;
      pool.submit(std::move(job));
      off += n;
    }
    pool.drain();
    trial.bytes = off;
  }
  if (::fdatasync(fd.get()) != 0) {
    const int err = errno;
    throw qcow2::IoError(name, std::string("fdatasync: ") + std::strerror(err), err);
  }
  trial.seconds = seconds_between(start, Clock::now());
  trial.completions = counting->completions();
  return trial;
}

CopyEstimate estimate_copy_time(uint64_t data_bytes, const CopyTrial& trial) {
  CopyEstimate e;
  if (trial.bytes == 0 || !(trial.seconds > 0)) return e;
  if (data_bytes <= trial.bytes) {  // rehearsed whole
    e.seconds = trial.seconds * double(data_bytes) / double(trial.bytes);
    e.low_seconds = e.high_seconds = e.seconds;
    e.rate_bytes_per_s = e.seconds > 0 ? double(data_bytes) / e.seconds : 0;
    return e;
  }
  const double rest = double(data_bytes - trial.bytes);
  const auto& c = trial.completions;
  const double end = c.empty() ? 0 : c.back().first;
  const double mid = end / 2;
  double steady = end > mid ? (bytes_at(c, end) - bytes_at(c, mid)) / (end - mid) : 0;
  if (!(steady > 0)) steady = double(trial.bytes) / trial.seconds;
  // The rates of the two halves of the second half.
  const double q = (end + mid) / 2;
  double r1 = end > mid ? (bytes_at(c, q) - bytes_at(c, mid)) / (q - mid) : 0;
  double r2 = end > mid ? (bytes_at(c, end) - bytes_at(c, q)) / (end - q) : 0;
  if (!(r1 > 0)) r1 = steady;
  if (!(r2 > 0)) r2 = steady;
  const double slow = std::min({r1, r2, steady}), fast = std::max({r1, r2, steady});
  double rest_s = rest / steady;
  double low_s = rest / fast;
  const double high_s = rest / slow;
  if (trial.governed) {
    const double cap = trial.ceiling_bytes_per_s > 0 ? trial.ceiling_bytes_per_s
                                                     : std::numeric_limits<double>::infinity();
    // Growth under kGrowthNoise of the rate is the noise of a steady rate.
    constexpr double kGrowthNoise = 0.05;
    const double growth = r2 > r1 * (1 + kGrowthNoise) ? (r2 - r1) / (end - q) : 0.0;
    const double rate_at_end = r2 + growth * (end - q) / 2;
    rest_s = time_to_copy(rest, rate_at_end, growth, cap);
    // Still growing: it may grow as fast as the controller's additive increase lets it.
    if (growth > 0)
      low_s = time_to_copy(rest, std::max(rate_at_end, fast),
                           std::max(growth, kAdditiveIncreaseBytesPerS2), cap);
  }
  e.rate_bytes_per_s = rest / rest_s;
  e.seconds = trial.seconds + rest_s;
  e.low_seconds = trial.seconds + std::min(low_s, rest_s);
  e.high_seconds = trial.seconds + std::max(high_s, rest_s);
  return e;
}

}  // namespace qcommit::engine
