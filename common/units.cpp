// SPDX-License-Identifier: GPL-2.0-or-later
#include "common/units.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace qcommit::units {
namespace {

constexpr const char* kDurationExamples = " (examples: 20ms, 1.5s, 500us)";
constexpr const char* kSizeExamples = " (examples: 4096, 64K, 50M, 1.5G)";

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// "12.5ms" → number "12.5", unit "ms"; false without leading digits.
bool split(const std::string& s, std::string& number, std::string& unit) {
  size_t n = 0;
  bool digits = false, dot = false;
  for (; n < s.size(); ++n) {
    if (std::isdigit(static_cast<unsigned char>(s[n]))) digits = true;
    else if (s[n] == '.' && !dot) dot = true;
    else break;
  }
  if (!digits) return false;
  number = s.substr(0, n);
  unit = trim(s.substr(n));
  return true;
}

// The decimal number split() found (digits and one '.': from_chars cannot fail but on range).
std::optional<double> number_value(const std::string& number) {
  double v = 0;
  const auto [end, ec] =
      std::from_chars(number.data(), number.data() + number.size(), v, std::chars_format::fixed);
  if (ec != std::errc{} || end != number.data() + number.size() || !std::isfinite(v))
    return std::nullopt;
  return v;
}

std::optional<double> ns_per_unit(const std::string& unit) {
  if (unit == "ns") return 1.0;
  if (unit == "us") return 1e3;
  if (unit == "ms") return 1e6;
  if (unit == "s") return 1e9;
  return std::nullopt;
}

// "K", "KiB", "kb", "" → the multiplier; nullopt for anything else.
std::optional<double> bytes_per_unit(std::string unit) {
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() == 3 && unit.compare(1, 2, "IB") == 0) unit.resize(1);
  if (unit.size() == 2 && unit[1] == 'B') unit.resize(1);
  constexpr double kKiB = 1024.0;
  if (unit.empty() || unit == "B") return 1.0;
  if (unit == "K") return kKiB;
  if (unit == "M") return kKiB * kKiB;
  if (unit == "G") return kKiB * kKiB * kKiB;
  if (unit == "T") return kKiB * kKiB * kKiB * kKiB;
  return std::nullopt;
}

}  // namespace

std::optional<std::chrono::nanoseconds> read_duration(std::string_view text, std::string& error) {
  const std::string s = trim(text);
  std::string number, unit;
  if (!split(s, number, unit)) {
    error = "bad duration '" + s + "'" + kDurationExamples;
    return std::nullopt;
  }
  if (unit.empty()) {
    error = number_value(number) == 0.0
                ? "a duration needs a unit, and must be more than 0 (e.g. 20ms)"
                : "a duration needs a unit: " + number + "ms or " + number + "s";
    return std::nullopt;
  }
  const auto per_unit = ns_per_unit(unit);
  if (!per_unit) {
    error = "bad duration unit in '" + s + "' (use ns, us, ms or s)";
    return std::nullopt;
  }
  const auto v = number_value(number);
  const double max_ns = std::chrono::duration<double, std::nano>(kMaxDuration).count();
  if (!v || !(*v * *per_unit <= max_ns)) {
    error = "duration '" + s + "' is longer than one hour";
    return std::nullopt;
  }
  return std::chrono::nanoseconds(static_cast<std::int64_t>(std::llround(*v * *per_unit)));
}

std::optional<std::chrono::nanoseconds> read_wait(std::string_view text, std::string& error) {
  const std::string s = trim(text);
  std::string number, unit;
  if (split(s, number, unit) && unit.empty() && number_value(number) == 0.0)
    return std::chrono::nanoseconds::zero();
  return read_duration(s, error);
}

std::optional<std::chrono::nanoseconds> read_budget(std::string_view text, std::string& error) {
  const auto d = read_duration(text, error);
  if (!d) return std::nullopt;
  if (auto e = budget_problem(*d)) {
    error = *e;
    return std::nullopt;
  }
  return d;
}

std::optional<std::string> budget_problem(std::chrono::nanoseconds budget) {
  if (budget <= std::chrono::nanoseconds::zero()) return "must be more than 0";
  if (budget > kMaxBudget) return "must be at most " + std::to_string(kMaxBudget.count()) + "s";
  return std::nullopt;
}

std::optional<double> read_size(std::string_view text, std::string& error) {
  const std::string s = trim(text);
  std::string number, unit;
  if (!split(s, number, unit)) {
    error = "bad size '" + s + "'" + kSizeExamples;
    return std::nullopt;
  }
  const auto per_unit = bytes_per_unit(unit);
  if (!per_unit) {
    error = "bad size unit in '" + s + "' (use K, M, G or T)";
    return std::nullopt;
  }
  const auto v = number_value(number);
  if (!v || !(*v * *per_unit <= kMaxSizeBytes)) {
    error = "size '" + s + "' is larger than 1 PiB";
    return std::nullopt;
  }
  return *v * *per_unit;
}

std::optional<double> read_rate(std::string_view text, std::string& error) {
  std::string s = trim(text);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, "/s") == 0) s.resize(s.size() - 2);
  const auto rate = read_size(s, error);
  if (!rate) return std::nullopt;
  if (*rate < kMinRateBytesPerS) {
    error = "at least 4K (bytes per second), e.g. 50M";
    return std::nullopt;
  }
  if (*rate > kMaxRateBytesPerS) {
    error = "at most 1T (bytes per second)";
    return std::nullopt;
  }
  return rate;
}

std::string mib_text(double bytes) {
  char buf[48];
  const int n = std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return std::string(buf,
                     static_cast<std::size_t>(std::clamp(n, 0, static_cast<int>(sizeof buf) - 1)));
}

}  // namespace qcommit::units
