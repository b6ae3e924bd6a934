// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/units.h"

#include <cmath>
#include <cstdio>

#include "cli/options.h"
#include "common/units.h"

namespace qcommit::cli {

namespace {

// The value a units:: reader gives, or UsageError "OPTION VALUE: problem".
template <class T>
T or_usage_error(const std::optional<T>& v, const std::string& option, const std::string& s,
                 const std::string& error) {
  if (!v) throw UsageError(option + " " + s + ": " + error);
  return *v;
}

}  // namespace

std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& option) {
  std::string error;
  const auto d = or_usage_error(units::read_duration(s, error), option, s, error);
  if (d.count() <= 0) throw UsageError(option + " " + s + ": must be more than 0");
  return d;
}

std::chrono::nanoseconds parse_budget(const std::string& s, const std::string& option) {
  std::string error;
  return or_usage_error(units::read_budget(s, error), option, s, error);
}

std::chrono::nanoseconds parse_wait(const std::string& s, const std::string& option) {
  std::string error;
  return or_usage_error(units::read_wait(s, error), option, s, error);
}

uint64_t parse_size(const std::string& s, const std::string& option) {
  std::string error;
  return static_cast<uint64_t>(or_usage_error(units::read_size(s, error), option, s, error));
}

double parse_rate(const std::string& s, const std::string& option) {
  std::string error;
  return or_usage_error(units::read_rate(s, error), option, s, error);
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
