// SPDX-License-Identifier: GPL-2.0-or-later
#include "throttle/io_stats.h"

#include <algorithm>

namespace qcommit::throttle {

void ForegroundSignals::add(const ForegroundSignals& o) {
  latencies.insert(latencies.end(), o.latencies.begin(), o.latencies.end());
  own_bytes = own_bytes && o.own_bytes ? std::optional(*own_bytes + *o.own_bytes) : std::nullopt;
  outstanding += o.outstanding;
  if (o.oldest_outstanding && (!oldest_outstanding || *o.oldest_outstanding > *oldest_outstanding))
    oldest_outstanding = o.oldest_outstanding;
}

void IoCounterSampler::sample(TimePoint now, const IoCounters& c, Duration interval,
                              ForegroundSignals& out) {
  if (has_prev_ && c.wr_reqs >= prev_.wr_reqs && c.flush_reqs >= prev_.flush_reqs) {
    const std::int64_t dw = c.wr_reqs - prev_.wr_reqs;
    const std::int64_t df = c.flush_reqs - prev_.flush_reqs;
    if (dw > 0)
      out.latencies.push_back(
          Duration(std::max<std::int64_t>(0, (c.wr_total_times_ns - prev_.wr_total_times_ns) / dw)));
    if (df > 0)
      out.latencies.push_back(Duration(
          std::max<std::int64_t>(0, (c.flush_total_times_ns - prev_.flush_total_times_ns) / df)));
    if (dw + df > 0) {
      if (last_completion_) {
        const Duration gap = now - *last_completion_;
        usual_ = usual_ ? Duration((usual_->count() * 3 + gap.count()) / 4) : gap;
      }
      last_completion_ = now;
    } else if (last_completion_ && usual_) {
      const Duration silence = now - *last_completion_;
      const Duration usual = std::max(*usual_, interval);
      const auto threshold =
          Duration(static_cast<std::int64_t>(kStallFactor * static_cast<double>(usual.count())));
      if (silence > threshold && silence <= threshold + kMaxSuspectedStall) {
        const Duration age = silence - usual;
        out.outstanding += 1;
        if (!out.oldest_outstanding || age > *out.oldest_outstanding) out.oldest_outstanding = age;
      }
    }
  } else if (has_prev_) {
    // Counters went backwards: a new QEMU process.  Its history says nothing about this one.
    last_completion_.reset();
    usual_.reset();
    written_.clear();
  }
  note_written(now, c, out);
  prev_ = c;
  has_prev_ = true;
}

// The bytes written since the previous sample join those of the last kForegroundOwnWindow, and
// their sum goes to `out` (unknown where the counters carry no bytes).
void IoCounterSampler::note_written(TimePoint now, const IoCounters& c, ForegroundSignals& out) {
  if (c.wr_bytes < 0) {
    out.own_bytes.reset();
    return;
  }
  if (has_prev_ && prev_.wr_bytes >= 0 && c.wr_bytes > prev_.wr_bytes)
    written_.emplace_back(now, static_cast<std::uint64_t>(c.wr_bytes - prev_.wr_bytes));
  std::erase_if(written_, [&](const auto& w) { return now - w.first > kForegroundOwnWindow; });
  std::uint64_t sum = 0;
  for (const auto& w : written_) sum += w.second;
  if (out.own_bytes) *out.own_bytes += sum;
}

}  // namespace qcommit::throttle
