// SPDX-License-Identifier: GPL-2.0-or-later
// Percentiles of latency samples: one definition for every figure the product reports (qcommitd's
// status, `qcommit merge`'s progress), the nearest rank: the smallest sample that at least
// `percent` % of the samples do not exceed.  The lab's scripts compute theirs the same way.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

namespace qcommit::throttle {

inline constexpr unsigned kP99Percent = 99;  // the percentile every latency figure reports

inline constexpr unsigned kAllPercent = 100;

// The 0-based index of the nearest-rank `percent` percentile among `n` sorted samples (n > 0):
// rank ceil(n * percent / 100), counted from 1; a percent above 100 counts as 100 (the max).
[[nodiscard]] constexpr std::size_t nearest_rank_index(std::size_t n, unsigned percent) {
  const std::size_t p = std::min(percent, kAllPercent);
  const std::size_t rank = (n * p + kAllPercent - 1) / kAllPercent;
  return rank == 0 ? 0 : std::min(rank, n) - 1;
}

// The `percent` percentile of `samples` (taken by value: reordered); nullopt when there are none.
template <class T>
[[nodiscard]] std::optional<T> percentile(std::vector<T> samples, unsigned percent) {
  if (samples.empty()) return std::nullopt;
  const std::size_t idx = nearest_rank_index(samples.size(), percent);
  std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(idx),
                   samples.end());
  return samples[idx];
}

}  // namespace qcommit::throttle
