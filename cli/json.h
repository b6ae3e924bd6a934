// SPDX-License-Identifier: GPL-2.0-or-later
// --output=json of the CLI: each document on one line, spaced as `{"event": "result", "a": [1, 2]}`
// (json::dump_spaced), built as a json::Ordered so members keep the order they are added in.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "plugin/host/json.h"

namespace qcommit::cli {

// Prints `doc` and a newline on stdout and flushes it: a JSON line reaches a pipe when it
// happens.
inline void print_json(const json::Ordered& doc) {
  const std::string line = json::dump_spaced(doc) + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

// `v` rounded to `decimals` places (seconds to the millisecond, ...).
[[nodiscard]] inline double rounded(double v, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

// A count held in a double (bytes, bytes per second) as the whole number it stands for; 0 for
// negative or not-a-number values.
[[nodiscard]] inline std::uint64_t whole(double v) {
  if (!(v > 0)) return 0;
  if (v >= 18446744073709551616.0) return std::numeric_limits<std::uint64_t>::max();  // 2^64
  return static_cast<std::uint64_t>(std::round(v));
}

// A quantity such as a budget in milliseconds: an integer when it is one (20, not 20.0), else
// the double.
[[nodiscard]] inline json::Ordered quantity(double v) {
  if (std::trunc(v) == v && std::fabs(v) < 9007199254740992.0)
    return json::Ordered(static_cast<std::int64_t>(v));
  return json::Ordered(v);
}

}  // namespace qcommit::cli
