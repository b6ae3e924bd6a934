// SPDX-License-Identifier: GPL-2.0-or-later
#include "throttle/controller.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace qcommit::throttle {
namespace {

double seconds(Duration d) {
  return std::chrono::duration<double>(d).count();
}

Duration from_seconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

}  // namespace

const char* to_string(Phase p) {
  switch (p) {
    case Phase::SlowStart:
      return "slow-start";
    case Phase::Steady:
      return "steady";
    case Phase::Slowdown:
      return "slowdown";
    case Phase::Paused:
      return "paused";
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
  if (!(probe_requests_per_sample >= 1))
    return "throttle config: probe_requests_per_sample must be >= 1";
  if (copy_requests_in_flight == 0) return "throttle config: copy_requests_in_flight must be > 0";
  return std::nullopt;
}

Controller::Controller(ControllerConfig cfg) : cfg_(cfg) {
  // Clamp an unvalidated config to something that cannot divide by zero or invert bounds.
  if (cfg_.latency_budget <= Duration::zero()) cfg_.latency_budget = std::chrono::milliseconds(20);
  if (!(cfg_.floor_rate_bytes_per_s > 0)) cfg_.floor_rate_bytes_per_s = 1.0;
  cfg_.ceiling_rate_bytes_per_s =
      std::max(cfg_.ceiling_rate_bytes_per_s, cfg_.floor_rate_bytes_per_s);
  cfg_.initial_rate_bytes_per_s = std::clamp(
      cfg_.initial_rate_bytes_per_s, cfg_.floor_rate_bytes_per_s, cfg_.ceiling_rate_bytes_per_s);
  if (cfg_.min_window_bytes == 0) cfg_.min_window_bytes = kMinWindowBytes;
  cfg_.max_window_bytes = std::max(cfg_.max_window_bytes, cfg_.min_window_bytes);
  if (cfg_.tick_interval <= Duration::zero()) cfg_.tick_interval = std::chrono::milliseconds(50);
  if (cfg_.slowdown_duration <= Duration::zero())
    cfg_.slowdown_duration = std::chrono::milliseconds(200);
  cfg_.slowdown_interval = std::max(cfg_.slowdown_interval, 4 * cfg_.slowdown_duration);
  if (!(cfg_.probe_requests_per_sample >= 1)) cfg_.probe_requests_per_sample = 1;
  cfg_.copy_requests_in_flight = std::max<std::uint32_t>(cfg_.copy_requests_in_flight, 1);
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
    ++drain_sample_count_;
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
  // Hard cap: budget × drain, also while the guests' own requests explain the delay.  Budget ×
  // the storage's rate there let the copy 1.5 GiB beside a busy guest finish in 1.74x its
  // unpaced time instead of 2.45x, but the guest's probe gained 64 ms at p99 instead of 25 (lab,
  // 2026-12-07): its flushes are chains of requests, each behind that much more.
  const double cap = t * drain_est_;
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
  probe_base_.new_epoch();
  ++stats_.slowdowns;
}

// The tick's own timing: interval since the previous tick (bounded), the budget and the delay
// target, widened to one indivisible copy request's service time when that is longer; then the
// copy is floor-limited, and only a delay beyond all its requests in flight is a stall.
Controller::TickTiming Controller::timing(TimePoint now) const {
  TickTiming t;
  t.dt = started_ ? now - last_now_ : cfg_.tick_interval;
  if (t.dt < Duration::zero()) t.dt = Duration::zero();
  if (t.dt > kMaxTickGap) t.dt = kMaxTickGap;
  t.dt_s = seconds(t.dt);
  // One indivisible copy request ahead of a foreground one is a delay no rate avoids.
  const double unit_s =
      drain_sampled_ ? static_cast<double>(cfg_.copy_request_bytes) / drain_max_seen_ : 0.0;
  const double configured_s = seconds(cfg_.latency_budget);
  t.budget_s = std::max(configured_s, unit_s);
  t.target = from_seconds(std::max(configured_s * kTargetFraction, unit_s));
  t.unit_s = unit_s;
  t.floor_limited =
      unit_s > configured_s && cfg_.copy_requests_in_flight >= kFloorLimitedMinRequestsInFlight;
  const double stall_s = kEmergencyFactor * t.budget_s;
  t.stall = from_seconds(t.floor_limited ? std::max(stall_s, unit_s * cfg_.copy_requests_in_flight)
                                         : stall_s);
  return t;
}

// Feeds the drain estimate; returns whether the copy used what it was allowed (its window or its
// rate): only then does a low delay say that more would fit.
bool Controller::measure_drain(const TickInput& in, const TickTiming& t) {
  const bool window_limited =
      started_ && static_cast<double>(std::min(prev_backlog_, in.backlog_bytes)) >=
                      kBusyFraction * static_cast<double>(prev_window_);
  update_drain(in, t.dt, window_limited);
  const bool used_rate =
      started_ && static_cast<double>(in.drained_bytes) >= kBusyFraction * prev_rate_ * t.dt_s;
  return window_limited || used_rate;
}

// A slowdown every slowdown_interval, slotted on the shared wall clock when the caller knows it,
// else on its own clock, so that the base latencies are re-learned with the copy held at the
// floor.  Runs before this tick's samples are taken: they belong to the new epoch.
void Controller::start_periodic_slowdown(const TickInput& in) {
  const Duration slot_clock = in.wall_clock.value_or(in.now.time_since_epoch());
  const std::int64_t slot = slot_clock / cfg_.slowdown_interval;
  if (!started_) last_slowdown_slot_ = slot;
  if (!in_slowdown_ && !paused_ && started_ && slot != last_slowdown_slot_) {
    last_slowdown_slot_ = slot;
    start_slowdown(in.now);
  }
}

// Adds this tick's samples to the base-latency filters; returns the copy samples with their
// service time (at the best drain seen: the storage's own speed) taken out.
std::vector<Duration> Controller::learn_base_latencies(const TickInput& in) {
  for (Duration l : in.foreground_latencies) fg_base_.add(l);
  for (Duration l : in.probe_latencies) probe_base_.add(l);
  std::vector<Duration> copy_norm;
  copy_norm.reserve(in.copy_samples.size());
  for (const auto& s : in.copy_samples) {
    const Duration service = from_seconds(static_cast<double>(s.bytes) / drain_max_seen_);
    const Duration n = std::max(Duration::zero(), s.latency - service);
    copy_norm.push_back(n);
    copy_base_.add(n);
  }
  return copy_norm;
}

// The tick brought news: latency samples, or every foreground source read idle.
bool Controller::is_fresh(const TickInput& in) {
  return !in.foreground_latencies.empty() || !in.copy_samples.empty() ||
         !in.probe_latencies.empty() ||
         (in.foreground_idle && in.foreground_outstanding == 0 &&
          !in.foreground_oldest_outstanding);
}

// Queueing delay the foreground saw: its latencies over its base, and (blk-wbt) an outstanding
// request counts as a sample of at least its age.
Duration Controller::foreground_delay(const TickInput& in, TimePoint now) {
  Duration q = Duration::zero();
  const Duration base = fg_base_.value().value_or(Duration::zero());
  for (Duration l : in.foreground_latencies) q = std::max(q, l - base);
  std::optional<Duration> age = in.foreground_oldest_outstanding;
  if (in.foreground_outstanding > 0 && in.foreground_latencies.empty()) {
    if (!fg_quiet_since_) fg_quiet_since_ = now;
    age = std::max(age.value_or(Duration::zero()), now - *fg_quiet_since_);
  } else {
    fg_quiet_since_.reset();
  }
  if (age) q = std::max(q, *age - base);
  return q;
}

// Queueing delay the probe saw, per storage request: its latencies over its own base, and an
// outstanding probe as a sample of at least its age (a probe stuck behind a queue is the first
// sign of a stall the local guests may not show).  Before any base is known, the age counts whole.
Duration Controller::probe_delay(const TickInput& in) const {
  const Duration base = probe_base_.value().value_or(Duration::zero());
  Duration q = Duration::zero();
  if (probe_base_.value())
    for (Duration l : in.probe_latencies) q = std::max(q, l - base);
  if (in.probe_outstanding) q = std::max(q, *in.probe_outstanding - base);
  return from_seconds(seconds(q) / cfg_.probe_requests_per_sample);
}

// Queueing delay the copy's own requests saw: copy samples are numerous, their median is the
// queue they all waited behind; and a copy stall (bytes queued, none drained for longer than they
// should take) counts as a sample of its age.
Duration Controller::copy_delay(const TickInput& in, TimePoint now,
                                std::vector<Duration>& copy_norm) {
  Duration q = Duration::zero();
  const std::optional<Duration> cb = copy_base_.value();
  if (!copy_norm.empty() && cb) {
    auto mid = copy_norm.begin() + static_cast<std::ptrdiff_t>(copy_norm.size() / 2);
    std::nth_element(copy_norm.begin(), mid, copy_norm.end());
    q = std::max(q, *mid - *cb);
  }
  std::optional<Duration> age = in.copy_oldest_outstanding;
  if (in.backlog_bytes > 0 && in.drained_bytes == 0 && in.copy_samples.empty()) {
    if (!copy_quiet_since_) copy_quiet_since_ = now;
    const Duration expected = from_seconds(static_cast<double>(in.backlog_bytes) / drain_est_);
    age = std::max(age.value_or(Duration::zero()), now - *copy_quiet_since_ - expected);
  } else {
    copy_quiet_since_.reset();
  }
  if (age) q = std::max(q, *age - cb.value_or(Duration::zero()));
  return q;
}

// Slowdowns that start or end on this tick: the guest became active (its first samples may sit
// behind our queue, so they are forgotten and its base learned during a slowdown before q is
// trusted), and the end of a slowdown once its time is up and the tick brought news.
void Controller::update_slowdown(const TickInput& in, bool had_fg_base, bool fresh) {
  if (!in_slowdown_ && !paused_ && started_ && !had_fg_base && !in.foreground_latencies.empty()) {
    start_slowdown(in.now);
    fg_base_.reset();
  }
  if (in_slowdown_ && in.now >= slowdown_end_ && fresh) {
    in_slowdown_ = false;
    rate_ = std::min(saved_rate_, kRateHeadroomOverDrain * drain_est_);
  }
}

// Floor-limited (kFloorLimitedDrainShare): the first time, slow start runs again whatever ended
// it (one request ahead of a guest's before the storage's rate was known), and ends once the
// storage's measured rate stops growing -- the delay cannot tell it that the storage is full.
void Controller::update_floor_ramp(const TickTiming& t, bool new_drain_sample, TimePoint now) {
  if (!t.floor_limited || paused_) return;
  if (!floor_entered_) {
    floor_entered_ = true;
    slow_start_ = true;
    ramp_best_ = drain_max_seen_;
    ramp_flat_samples_ = 0;
    return;
  }
  if (!new_drain_sample || in_slowdown_) return;
  if (!slow_start_) {
    follow_slower_storage();
    return;
  }
  const bool above_best = prev_rate_ >= kFloorLimitedGrowth * ramp_best_ ||
                          prev_rate_ >= kFloorRampCeilingFraction * cfg_.ceiling_rate_bytes_per_s;
  if (drain_max_seen_ >= kFloorLimitedGrowth * ramp_best_) {
    ramp_best_ = drain_max_seen_;
    ramp_flat_samples_ = 0;
  } else if (above_best && ++ramp_flat_samples_ >= kFloorLimitedPlateauSamples) {
    // Paced above the best drain and not given more: the storage is full.  The queue the ramp
    // built drains in a slowdown (the copy at the floor rate), then the copy goes on at the share.
    slow_start_ = false;
    rate_ = std::min(rate_, kFloorLimitedDrainShare * drain_max_seen_);
    start_slowdown(now);
  }
}

// Floor-limited after the ramp (kFloorShortfall): samples in a row short of the paced rate make
// the best of them the storage's rate; the higher samples before them no longer count.
void Controller::follow_slower_storage() {
  const double r = drain_samples_.back().bytes_per_s;
  if (r >= kFloorShortfall * prev_rate_) {
    shortfall_samples_ = 0;
    shortfall_best_ = 0;
    return;
  }
  shortfall_best_ = std::max(shortfall_best_, r);
  if (++shortfall_samples_ < kFloorShortfallSamples) return;
  const double rate = std::max(shortfall_best_, cfg_.floor_rate_bytes_per_s);
  std::erase_if(drain_samples_, [rate](const DrainSample& d) { return d.bytes_per_s > rate; });
  drain_max_seen_ = rate;
  drain_est_ = std::min(drain_est_, rate);
  shortfall_samples_ = 0;
  shortfall_best_ = 0;
}

// Emergency stop: the delay passed kEmergencyFactor × the budget.  Returns true on entering it.
bool Controller::enter_pause(TimePoint now) {
  if (paused_) return false;
  paused_ = true;
  paused_since_ = now;
  rate_ *= kEmergencyRateFactor;
  last_decrease_ = now;
  slow_start_ = false;
  ++stats_.emergencies;
  return true;
}

// Leaves the pause once a fresh tick shows the delay at target, or, with no news, once nothing
// has been outstanding for kPauseProbeAfter (a probe: nobody is there to be protected).
void Controller::maybe_resume(const TickInput& in, Duration q, Duration target, bool fresh) {
  const bool nothing_outstanding = in.foreground_outstanding == 0 && in.backlog_bytes == 0 &&
                                   !in.foreground_oldest_outstanding && !in.probe_outstanding;
  if ((fresh && q <= target) ||
      (!fresh && nothing_outstanding && in.now - paused_since_ >= kPauseProbeAfter))
    paused_ = false;
}

// Proportional multiplicative decrease: ×0.9 just above target, ×0.7 at the budget; at most once
// per kDecreaseHoldoff.
void Controller::decrease_rate(TimePoint now, Duration q, Duration target) {
  if (last_decrease_ && now - *last_decrease_ < kDecreaseHoldoff) return;
  const double over = std::clamp((seconds(q) - seconds(target)) / seconds(target), 0.0, 1.0);
  rate_ *= kMildDecreaseFactor - over * (kMildDecreaseFactor - kStrongDecreaseFactor);
  last_decrease_ = now;
  slow_start_ = false;
  ++stats_.decreases;
}

// Slow start doubles every kSlowStartDoublingTime while q stays under half the target (floor-
// limited: until update_floor_ramp ends it); then the rate grows additively, with a gain that
// falls to zero as q reaches the target.
void Controller::increase_rate(Duration q, Duration target, double dt_s, bool floor_limited) {
  if (slow_start_) {
    if (q < target / 2 || floor_limited)
      rate_ *= std::exp2(dt_s / seconds(kSlowStartDoublingTime));
    else
      slow_start_ = false;
    return;
  }
  const double qf = seconds(q) / seconds(target);
  const double gain =
      qf <= kFullIncreaseFraction ? 1.0 : (1.0 - qf) / (1.0 - kFullIncreaseFraction);
  rate_ += cfg_.additive_increase_bytes_per_s2 * dt_s * gain;
}

// The rate between the floor and headroom × drain estimate (itself within floor and ceiling);
// floor-limited, never below kFloorLimitedDrainShare of the storage's measured rate.
void Controller::clamp_rate(bool floor_limited) {
  const double headroom = slow_start_ ? kSlowStartHeadroomOverDrain : kRateHeadroomOverDrain;
  double lo = cfg_.floor_rate_bytes_per_s;
  if (floor_limited)
    lo = std::clamp(kFloorLimitedDrainShare * drain_max_seen_, lo, cfg_.ceiling_rate_bytes_per_s);
  const double hi =
      std::clamp(headroom * drain_est_, cfg_.floor_rate_bytes_per_s, cfg_.ceiling_rate_bytes_per_s);
  rate_ = std::clamp(rate_, lo, std::max(lo, hi));
}

// What the caller may do until the next tick, and when that is.
Decision Controller::decide(TimePoint now, Duration q, Duration target, bool fresh) const {
  Decision d;
  d.rate_bytes_per_s = in_slowdown_ ? cfg_.floor_rate_bytes_per_s : rate_;
  d.window_bytes = in_slowdown_ ? cfg_.min_window_bytes : compute_window();
  if (!fresh && started_) {
    // Never increase on a tick without fresh latency samples.
    d.rate_bytes_per_s = std::min(d.rate_bytes_per_s, prev_rate_);
    d.window_bytes = std::min(d.window_bytes, prev_window_);
  }
  Duration next = cfg_.tick_interval;
  if (paused_ || q > target) next = cfg_.tick_interval / 2;
  if (in_slowdown_ && slowdown_end_ > now) next = std::min(next, slowdown_end_ - now);
  d.next_tick = std::max(next, kMinNextTick);
  d.paused = paused_;
  d.phase = paused_        ? Phase::Paused
            : in_slowdown_ ? Phase::Slowdown
            : slow_start_  ? Phase::SlowStart
                           : Phase::Steady;
  d.queue_delay = q;
  d.drain_estimate_bytes_per_s = drain_est_;
  d.fresh = fresh;
  return d;
}

// The copy's own requests of this tick whose bytes and time at storage are known: each is a lower
// bound of the storage's rate (it served at least those bytes in that time).
void Controller::learn_service_rate(const TickInput& in) {
  for (const auto samples : {in.own_service_samples, in.copy_samples}) {
    for (const CopySample& c : samples) {
      if (c.bytes < kMinServiceSampleBytes || c.latency <= Duration::zero()) continue;
      service_rates_.push_back({in.now, static_cast<double>(c.bytes) / seconds(c.latency), true});
    }
  }
  while (!service_rates_.empty() && in.now - service_rates_.front().at > kServiceRateHorizon)
    service_rates_.pop_front();
}

// The rate the copy's own queue drains at, at least: the drain estimate (its recent best, which
// follows the storage down) or the best of its own requests' service rates of the last
// kServiceRateHorizon, whichever is higher (0: neither known yet).
double Controller::own_queue_rate() const {
  double best = drain_sampled_ ? drain_est_ : 0.0;
  for (const DrainSample& s : service_rates_) best = std::max(best, s.bytes_per_s);
  return best;
}

// The delay charged to the copy.  In a FIFO queue a foreground request waits behind at most the
// copy's own queue (TickInput::own_queue_bytes), which takes own_s at own_queue_rate():
// min(measured, own_s) is not less than the copy's share as long as the caller counted that queue
// whole and the rate is not above the storage's (the window bounds the copy where either fails).  The foreground's own requests (foreground_own_bytes) explain at most guests_s of
// it: measured − guests_s is what they cannot, which includes another host's copy.  The larger of
// the two is charged; without both bounds, all of it.
Controller::Charge Controller::charged_delay(const TickInput& in, Duration measured) const {
  const double rate = own_queue_rate();
  if (!in.own_queue_bytes || !in.foreground_own_bytes || rate <= 0) return {measured, false};
  const Duration own = std::min(measured, from_seconds(static_cast<double>(*in.own_queue_bytes) / rate));
  const Duration guests = from_seconds(static_cast<double>(*in.foreground_own_bytes) / rate);
  const Duration unexplained = measured > guests ? measured - guests : Duration::zero();
  if (unexplained > own) return {unexplained, false};
  return {own, own < measured};
}

Decision Controller::tick(const TickInput& in) {
  const TimePoint now = in.now;
  const TickTiming t = timing(now);
  ++stats_.ticks;
  const std::uint64_t samples_before = drain_sample_count_;
  const bool busy = measure_drain(in, t);
  update_floor_ramp(t, drain_sample_count_ != samples_before, now);
  const bool ramp = t.floor_limited && slow_start_;
  start_periodic_slowdown(in);

  learn_service_rate(in);
  const bool had_fg_base = fg_base_.value().has_value();
  std::vector<Duration> copy_norm = learn_base_latencies(in);
  const std::optional<Duration> fgb = fg_base_.value();
  const std::optional<Duration> cb = copy_base_.value();
  const bool fresh = is_fresh(in);
  const Duration pq = probe_delay(in);
  const Duration measured =
      std::max({foreground_delay(in, now), copy_delay(in, now, copy_norm), pq, Duration::zero()});
  const Charge charge = charged_delay(in, measured);
  const Duration q = charge.delay;
  // A delay charged from the copy's own queue is the most any request can wait behind the copy,
  // not a sample of what requests waited: it is steered to the whole budget, where measured
  // delays are steered to a fraction of it for their noise and overshoot.
  const bool own_bounded = charge.own_queue_bound;
  const Duration target = own_bounded ? std::max(t.target, from_seconds(t.budget_s)) : t.target;

  const bool emergency_now = q > t.stall;
  update_slowdown(in, had_fg_base, fresh);
  bool entered_pause = false;
  if (emergency_now)
    entered_pause = enter_pause(now);
  else if (paused_)
    maybe_resume(in, q, target, fresh);
  else if (!in_slowdown_ && q > target && !ramp)
    decrease_rate(now, q, target);
  else if (!in_slowdown_ && fresh && busy)
    increase_rate(q, target, t.dt_s, ramp);
  clamp_rate(t.floor_limited);

  Decision d = decide(now, q, target, fresh);
  d.emergency = entered_pause;
  d.foreground_base = fgb;
  d.copy_base = cb;
  d.probe_base = probe_base_.value();
  d.probe_delay = pq;
  d.measured_delay = measured;
  d.own_queue_bounded = own_bounded;
  // Said once the storage's rate is measured (the ramp is over): before, a service time from the
  // start rate would claim a floor that storage able to meet the budget does not have.
  d.floor_limited = t.floor_limited && floor_entered_ && !slow_start_;
  if (d.floor_limited) d.floor_latency = from_seconds(t.unit_s);
  d.storage_rate_bytes_per_s = drain_max_seen_;
  d.own_queue_rate_bytes_per_s = own_queue_rate();
  started_ = true;
  last_now_ = now;
  prev_window_ = d.window_bytes;
  prev_rate_ = d.rate_bytes_per_s;
  prev_backlog_ = in.backlog_bytes;
  return d;
}

}  // namespace qcommit::throttle
