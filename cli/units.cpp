// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/units.h"

#include <cmath>
#include <cstdio>

#include "cli/options.h"
#include "plugin/config.h"

namespace qcommit::cli {

std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& option) {
  std::string error;
  const auto d = plugin::read_duration(s, error);
  if (!d) throw UsageError(option + " " + s + ": " + error);
  if (d->count() <= 0) throw UsageError(option + " " + s + ": must be more than 0");
  return *d;
}

uint64_t parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (...) {
    throw UsageError("bad size '" + s + "' (examples: 4096, 50M, 1.5G)");
  }
  std::string unit = s.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b') && unit != "b") unit.pop_back();
  if (unit.size() == 2 && unit[1] == 'i') unit.pop_back();
  double mul = 1;
  if (unit.empty()) mul = 1;
  else if (unit == "K" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "m") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") mul = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "t") mul = 1024.0 * 1024 * 1024 * 1024;
  else throw UsageError("bad size unit in '" + s + "' (K, M, G, T)");
  if (v < 0 || !std::isfinite(v)) throw UsageError("size must not be negative: '" + s + "'");
  return uint64_t(v * mul);
}

namespace {
// bytes expressed in the largest binary unit (up to units[max_unit]) that keeps the value >= 1.
struct Scaled {
  double value;
  int unit;
};
constexpr const char* kSizeUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
Scaled scale_size(uint64_t bytes, int max_unit) {
  Scaled s{double(bytes), 0};
  while (s.value >= 1024 && s.unit < max_unit) {
    s.value /= 1024;
    ++s.unit;
  }
  return s;
}
}  // namespace

std::string format_size(uint64_t bytes) {
  const Scaled s = scale_size(bytes, 5);
  char buf[32];
  std::snprintf(buf, sizeof buf, s.unit ? "%.1f %s" : "%.0f %s", s.value, kSizeUnits[s.unit]);
  return buf;
}

std::string human_size(uint64_t bytes) {
  const Scaled s = scale_size(bytes, 6);
  char buf[64];
  if (s.unit == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.3g %s (%llu bytes)", s.value, kSizeUnits[s.unit],
                  static_cast<unsigned long long>(bytes));
  return buf;
}

}  // namespace qcommit::cli
