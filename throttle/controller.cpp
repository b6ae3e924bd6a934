#include "throttle/controller.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace qcommit::throttle {
namespace {

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

Duration from_seconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

}  // namespace

const char* to_string(Phase p) {
  switch (p) {
    case Phase::SlowStart: return "slow-start";
    case Phase::Steady: return "steady";
    case Phase::Slowdown: return "slowdown";
    case Phase::Paused: return "paused";
  }
  return "?";
}

std::optional<std::string> ControllerConfig::validate() const {
  if (latency_budget <= Duration::zero()) return "throttle config: latency_budget must be > 0";
  if (!(floor_rate_bytes_per_s > 0)) return "throttle config: floor_rate must be > 0";
  if (!(ceiling_rate_bytes_per_s >= floor_rate_bytes_per_s))
    return "throttle config: floor_rate must be <= ceiling_rate";
  if (!(initial_rate_bytes_per_s >= floor_rate_bytes_per_s &&
        initial_rate_bytes_per_s <= ceiling_rate_bytes_per_s))
    return "throttle config: initial_rate must lie within [floor_rate, ceiling_rate]";
  if (!(additive_increase_bytes_per_s2 > 0))
    return "throttle config: additive_increase must be > 0";
  if (min_window_bytes == 0) return "throttle config: min_window_bytes must be > 0";
  if (max_window_bytes < min_window_bytes)
    return "throttle config: min_window_bytes must be <= max_window_bytes";
  if (tick_interval <= Duration::zero()) return "throttle config: tick_interval must be > 0";
  if (slowdown_duration <= Duration::zero())
    return "throttle config: slowdown_duration must be > 0";
  if (slowdown_interval < 4 * slowdown_duration)
    return "throttle config: slowdown_interval must be >= 4 x slowdown_duration";
  return std::nullopt;
}

Controller::Controller(ControllerConfig cfg) : cfg_(cfg) {
  // Clamp an unvalidated config to something that cannot divide by zero or invert bounds.
  if (cfg_.latency_budget <= Duration::zero()) cfg_.latency_budget = std::chrono::milliseconds(20);
  if (!(cfg_.floor_rate_bytes_per_s > 0)) cfg_.floor_rate_bytes_per_s = 1.0;
  cfg_.ceiling_rate_bytes_per_s = std::max(cfg_.ceiling_rate_bytes_per_s, cfg_.floor_rate_bytes_per_s);
  cfg_.initial_rate_bytes_per_s = std::clamp(cfg_.initial_rate_bytes_per_s,
                                             cfg_.floor_rate_bytes_per_s,
                                             cfg_.ceiling_rate_bytes_per_s);
  if (cfg_.min_window_bytes == 0) cfg_.min_window_bytes = kMinWindowBytes;
  cfg_.max_window_bytes = std::max(cfg_.max_window_bytes, cfg_.min_window_bytes);
  if (cfg_.tick_interval <= Duration::zero()) cfg_.tick_interval = std::chrono::milliseconds(50);
  if (cfg_.slowdown_duration <= Duration::zero())
    cfg_.slowdown_duration = std::chrono::milliseconds(200);
  cfg_.slowdown_interval = std::max(cfg_.slowdown_interval, 4 * cfg_.slowdown_duration);
  rate_ = cfg_.initial_rate_bytes_per_s;
  drain_est_ = cfg_.initial_rate_bytes_per_s;
  drain_max_seen_ = drain_est_;
}

void Controller::update_drain(const TickInput& in, Duration dt, bool window_limited) {
  if (in_slowdown_ && !drain_sampled_) {
    // A slowdown before the first drain sample (the guest became active at the start): the copy
    // was held at the floor on purpose, so what it drained says nothing about the storage, and
    // as the only sample it would replace the initial estimate; the rate, capped by headroom x
    // estimate, would then take seconds to climb back.  Later slowdowns are sampled: the max
    // filter's horizon still holds the samples taken before them.
    acc_bytes_ = 0;
    acc_time_ = Duration::zero();
    acc_window_limited_ = true;
  } else {
    acc_bytes_ += in.drained_bytes;
    acc_time_ += dt;
    acc_window_limited_ = acc_window_limited_ && window_limited;
  }
  if (acc_time_ >= kDrainSampleInterval) {
    const double r = static_cast<double>(acc_bytes_) / seconds(acc_time_);
    // Window-limited samples measure what storage gives us; app-limited ones only a lower
    // bound, so they count only when they raise the estimate (BBR).
    drain_samples_.push_back({in.now, r, acc_window_limited_ || r > drain_est_});
    drain_sampled_ = true;
    acc_bytes_ = 0;
    acc_time_ = Duration::zero();
    acc_window_limited_ = true;
  }
  while (!drain_samples_.empty() && in.now - drain_samples_.front().at > kDrainFilterHorizon)
    drain_samples_.pop_front();
  // Max over the window-limited samples in the horizon; when there are none (the copy was
  // paced below what storage gives it for a whole horizon), max over all samples: what the copy
  // achieved is then all that is known, and an old, higher figure must not keep the window
  // open after the storage slowed down.  No sample at all: keep the estimate.
  double valid_max = 0, any_max = 0;
  for (const auto& s : drain_samples_) {
    any_max = std::max(any_max, s.bytes_per_s);
    if (s.window_limited) valid_max = std::max(valid_max, s.bytes_per_s);
  }
  if (!drain_samples_.empty())
    drain_est_ = std::max(valid_max > 0 ? valid_max : any_max, cfg_.floor_rate_bytes_per_s);
  drain_max_seen_ = std::max(drain_max_seen_, drain_est_);
  // No sample in the horizon: keep the last estimate (nothing new was learned).
}

void Controller::skip_until(TimePoint now) {
  if (!started_ || now <= last_now_) return;
  last_now_ = now;
  acc_bytes_ = 0;
  acc_time_ = Duration::zero();
  acc_window_limited_ = true;
}

std::uint64_t Controller::compute_window() const {
  const double t = seconds(cfg_.latency_budget);
  const double cap = t * drain_est_;           // hard cap: budget × drain
  double w = cap;
  w = std::clamp(w, static_cast<double>(cfg_.min_window_bytes),
                 static_cast<double>(cfg_.max_window_bytes));
  return static_cast<std::uint64_t>(w);
}

void Controller::start_slowdown(TimePoint now) {
  in_slowdown_ = true;
  slowdown_end_ = now + cfg_.slowdown_duration;
  saved_rate_ = rate_;
  fg_base_.new_epoch();
  copy_base_.new_epoch();
  ++stats_.slowdowns;
}

Decision Controller::tick(const TickInput& in) {
  const TimePoint now = in.now;
  Duration dt = started_ ? now - last_now_ : cfg_.tick_interval;
  if (dt < Duration::zero()) dt = Duration::zero();
  if (dt > kMaxTickGap) dt = kMaxTickGap;
  const double dt_s = seconds(dt);
  // One indivisible copy request ahead of a foreground one is a delay no rate avoids.
  const double unit_s =
      drain_sampled_ ? static_cast<double>(cfg_.copy_request_bytes) / drain_max_seen_ : 0.0;
  const double configured_s = seconds(cfg_.latency_budget);
  const double budget_s = std::max(configured_s, unit_s);
  const Duration target = from_seconds(std::max(configured_s * kTargetFraction, unit_s));
  const std::int64_t slot = now.time_since_epoch() / cfg_.slowdown_interval;
  if (!started_) last_slowdown_slot_ = slot;
  ++stats_.ticks;

  // ---- drain estimate ----------------------------------------------------------------------
  const bool window_limited =
      started_ && static_cast<double>(std::min(prev_backlog_, in.backlog_bytes)) >=
                      kBusyFraction * static_cast<double>(prev_window_);
  update_drain(in, dt, window_limited);
  const bool used_rate =
      started_ && static_cast<double>(in.drained_bytes) >= kBusyFraction * prev_rate_ * dt_s;
  const bool busy = window_limited || used_rate;

  // ---- periodic slowdown (before this tick's samples, which belong to the new epoch) ----------
  if (!in_slowdown_ && !paused_ && started_ && slot != last_slowdown_slot_) {
    last_slowdown_slot_ = slot;
    start_slowdown(now);
  }

  // ---- base latencies ----------------------------------------------------------------------
  const bool had_fg_base = fg_base_.value().has_value();
  for (Duration l : in.foreground_latencies) fg_base_.add(l);
  const auto service = [&](std::uint64_t bytes) {
    // Service time at the best drain rate seen: an estimate of the storage's own speed, not of
    // our (possibly app-limited) share.
    return from_seconds(static_cast<double>(bytes) / drain_max_seen_);
  };
  std::vector<Duration> copy_norm;
  copy_norm.reserve(in.copy_samples.size());
  for (const auto& s : in.copy_samples) {
    const Duration n = std::max(Duration::zero(), s.latency - service(s.bytes));
    copy_norm.push_back(n);
    copy_base_.add(n);
  }
  const std::optional<Duration> fgb = fg_base_.value();
  const std::optional<Duration> cb = copy_base_.value();
  const bool fresh =
      !in.foreground_latencies.empty() || !in.copy_samples.empty() ||
      (in.foreground_idle && in.foreground_outstanding == 0 && !in.foreground_oldest_outstanding);

  // ---- queueing delay q --------------------------------------------------------------------
  Duration q = Duration::zero();
  const Duration fg_base_or_zero = fgb.value_or(Duration::zero());
  for (Duration l : in.foreground_latencies) q = std::max(q, l - fg_base_or_zero);
  // blk-wbt: an outstanding request is a sample of at least its age.
  std::optional<Duration> fg_age = in.foreground_oldest_outstanding;
  if (in.foreground_outstanding > 0 && in.foreground_latencies.empty()) {
    if (!fg_quiet_since_) fg_quiet_since_ = now;
    const Duration lower_bound = now - *fg_quiet_since_;
    fg_age = std::max(fg_age.value_or(Duration::zero()), lower_bound);
  } else {
    fg_quiet_since_.reset();
  }
  if (fg_age) q = std::max(q, *fg_age - fg_base_or_zero);
  if (!copy_norm.empty() && cb) {
    // Copy samples are numerous; their median is the queue they all waited behind.
    auto mid = copy_norm.begin() + static_cast<std::ptrdiff_t>(copy_norm.size() / 2);
    std::nth_element(copy_norm.begin(), mid, copy_norm.end());
    q = std::max(q, *mid - *cb);
  }
  {
    // Copy stall: bytes queued and none drained for longer than they should take.
    std::optional<Duration> age = in.copy_oldest_outstanding;
    if (in.backlog_bytes > 0 && in.drained_bytes == 0 && in.copy_samples.empty()) {
      if (!copy_quiet_since_) copy_quiet_since_ = now;
      const Duration expected = from_seconds(static_cast<double>(in.backlog_bytes) / drain_est_);
      age = std::max(age.value_or(Duration::zero()), now - *copy_quiet_since_ - expected);
    } else {
      copy_quiet_since_.reset();
    }
    if (age) q = std::max(q, *age - cb.value_or(Duration::zero()));
  }
  if (q < Duration::zero()) q = Duration::zero();

  // ---- state machine -----------------------------------------------------------------------
  Decision d;
  const bool emergency_now = q > from_seconds(budget_s * kEmergencyFactor);
  if (!in_slowdown_ && !paused_ && started_ && !had_fg_base && !in.foreground_latencies.empty()) {
    // The guest became active: its first samples may sit behind our queue, so forget them
    // and learn its base during a slowdown before trusting q.
    start_slowdown(now);
    fg_base_.reset();
  }
  if (in_slowdown_ && now >= slowdown_end_ && fresh) {
    in_slowdown_ = false;
    rate_ = std::min(saved_rate_, kRateHeadroomOverDrain * drain_est_);
  }

  if (emergency_now) {
    if (!paused_) {
      paused_ = true;
      paused_since_ = now;
      rate_ *= kEmergencyRateFactor;
      last_decrease_ = now;
      slow_start_ = false;
      ++stats_.emergencies;
      d.emergency = true;
    }
  } else if (paused_) {
    const bool nothing_outstanding =
        in.foreground_outstanding == 0 && in.backlog_bytes == 0 && !in.foreground_oldest_outstanding;
    if ((fresh && q <= target) || (!fresh && nothing_outstanding && now - paused_since_ >= kPauseProbeAfter))
      paused_ = false;
  } else if (!in_slowdown_) {
    if (q > target) {
      if (!last_decrease_ || now - *last_decrease_ >= kDecreaseHoldoff) {
        // Proportional multiplicative decrease: ×0.9 just above target, ×0.7 at the budget.
        const double over = std::clamp((seconds(q) - seconds(target)) / seconds(target), 0.0, 1.0);
        const double factor = kMildDecreaseFactor - over * (kMildDecreaseFactor - kStrongDecreaseFactor);
        rate_ *= factor;
        last_decrease_ = now;
        slow_start_ = false;
        ++stats_.decreases;
      }
    } else if (fresh && busy) {
      if (slow_start_) {
        if (q < target / 2) {
          rate_ *= std::exp2(dt_s / seconds(kSlowStartDoublingTime));
        } else {
          slow_start_ = false;
        }
      } else {
        const double qf = seconds(q) / seconds(target);
        const double gain = qf <= kFullIncreaseFraction
                                ? 1.0
                                : (1.0 - qf) / (1.0 - kFullIncreaseFraction);
        rate_ += cfg_.additive_increase_bytes_per_s2 * dt_s * gain;
      }
    }
  }
  const double headroom = slow_start_ ? kSlowStartHeadroomOverDrain : kRateHeadroomOverDrain;
  rate_ = std::clamp(rate_, cfg_.floor_rate_bytes_per_s,
                     std::clamp(headroom * drain_est_, cfg_.floor_rate_bytes_per_s,
                                cfg_.ceiling_rate_bytes_per_s));

  double out_rate = in_slowdown_ ? cfg_.floor_rate_bytes_per_s : rate_;
  std::uint64_t window = in_slowdown_ ? cfg_.min_window_bytes : compute_window();
  if (!fresh && started_) {
    // Never increase on a tick without fresh latency samples.
    out_rate = std::min(out_rate, prev_rate_);
    window = std::min(window, prev_window_);
  }

  Duration next = cfg_.tick_interval;
  if (paused_ || q > target) next = cfg_.tick_interval / 2;
  if (in_slowdown_ && slowdown_end_ > now) next = std::min(next, slowdown_end_ - now);
  next = std::max(next, kMinNextTick);

  d.window_bytes = window;
  d.rate_bytes_per_s = out_rate;
  d.paused = paused_;
  d.next_tick = next;
  d.phase = paused_ ? Phase::Paused
                    : in_slowdown_ ? Phase::Slowdown
                                   : slow_start_ ? Phase::SlowStart : Phase::Steady;
  d.queue_delay = q;
  d.foreground_base = fgb;
  d.copy_base = cb;
  d.drain_estimate_bytes_per_s = drain_est_;
  d.fresh = fresh;

  started_ = true;
  last_now_ = now;
  prev_window_ = window;
  prev_rate_ = out_rate;
  prev_backlog_ = in.backlog_bytes;
  return d;
}

}  // namespace qcommit::throttle
