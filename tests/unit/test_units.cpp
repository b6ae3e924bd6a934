// SPDX-License-Identifier: GPL-2.0-or-later
// common/units: the one grammar of durations, sizes and rates, and the bounds every option and
// configuration key shares (qcommit(1), DURATIONS AND SIZES).
#include <doctest/doctest.h>

#include <chrono>
#include <string>

#include "common/units.h"

using namespace std::chrono_literals;
using qcommit::units::budget_problem;
using qcommit::units::read_budget;
using qcommit::units::read_duration;
using qcommit::units::read_rate;
using qcommit::units::read_size;
using qcommit::units::read_wait;

namespace {
// The error a reader gives for `text`, "" when it accepts it.
template <class Reader>
std::string error_of(Reader read, const char* text) {
  std::string e;
  return read(text, e) ? std::string() : e;
}
}  // namespace

TEST_CASE("units.durations") {
  std::string e;
  for (const char* s : {"20ms", "20 ms", "0.02s", ".02s", "20000us", "20000000ns", " 20ms "})
    CHECK(read_duration(s, e) == std::chrono::nanoseconds(20ms));
  CHECK(error_of(read_duration, "20") == "a duration needs a unit: 20ms or 20s");
  CHECK(error_of(read_duration, "0") == "a duration needs a unit, and must be more than 0 (e.g. 20ms)");
  CHECK(error_of(read_duration, "20m").find("bad duration unit") == 0);
  CHECK(error_of(read_duration, "1e3ms").find("bad duration unit") == 0);
  CHECK(error_of(read_duration, "-5ms").find("bad duration '-5ms'") == 0);
  CHECK(error_of(read_duration, "3601s") == "duration '3601s' is longer than one hour");
  CHECK(read_duration("3600s", e) == std::chrono::nanoseconds(1h));
}

TEST_CASE("units.wait and budget bounds") {
  std::string e;
  CHECK(read_wait("0", e) == std::chrono::nanoseconds::zero());
  CHECK(read_wait("0s", e) == std::chrono::nanoseconds::zero());
  CHECK(read_wait("1.5s", e) == std::chrono::nanoseconds(1500ms));
  CHECK(error_of(read_wait, "5").find("needs a unit") != std::string::npos);
  CHECK(read_budget("60s", e) == std::chrono::nanoseconds(60s));
  CHECK(error_of(read_budget, "61s") == "must be at most 60s");
  CHECK(error_of(read_budget, "90s") == "must be at most 60s");
  CHECK(error_of(read_budget, "0ms") == "must be more than 0");
  CHECK(budget_problem(20ms) == std::nullopt);
  CHECK(budget_problem(0ms) == "must be more than 0");
}

TEST_CASE("units.sizes and rates") {
  std::string e;
  CHECK(read_size("4096", e) == 4096.0);
  CHECK(read_size("64K", e) == 65536.0);
  CHECK(read_size("64k", e) == 65536.0);
  CHECK(read_size("1MiB", e) == 1048576.0);
  CHECK(read_size("1MB", e) == 1048576.0);
  CHECK(read_size("1.5G", e) == 1.5 * 1024 * 1024 * 1024);
  CHECK(error_of(read_size, "1X").find("bad size unit in '1X'") == 0);
  CHECK(error_of(read_size, "-5M").find("bad size '-5M'") == 0);
  CHECK(error_of(read_size, "1e3").find("bad size unit") == 0);
  CHECK(read_rate("50M", e) == 50.0 * 1024 * 1024);
  CHECK(read_rate("50M/s", e) == 50.0 * 1024 * 1024);
  CHECK(read_rate("4K", e) == 4096.0);
  CHECK(error_of(read_rate, "0") == "at least 4K (bytes per second), e.g. 50M");
  CHECK(error_of(read_rate, "2T") == "at most 1T (bytes per second)");
}
