// SPDX-License-Identifier: GPL-2.0-or-later
// Sizes, rates and durations on the command line: "20ms", "1.5s"; "50M", "1G", "4096"; "50M/s".
// The grammar and the bounds are common/units.h's, shared with qcommitd's configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/merge.h"

namespace qcommit::cli {

// Each throws UsageError on bad input, naming `option` and showing the fix:
// "--budget 20: a duration needs a unit: 20ms or 20s". ("off", where an option takes it, is the
// caller's.)
// A duration more than 0.
[[nodiscard]] std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& option = "--budget");
// A latency budget: more than 0, at most units::kMaxBudget.
[[nodiscard]] std::chrono::nanoseconds parse_budget(const std::string& s, const std::string& option = "--budget");
// A wait: a duration, or 0 ("0", "0s": do not wait).
[[nodiscard]] std::chrono::nanoseconds parse_wait(const std::string& s, const std::string& option = "--wait");
[[nodiscard]] uint64_t parse_size(const std::string& s, const std::string& option = "size");
// Bytes per second ("50M", "50M/s"), units::kMinRateBytesPerS to units::kMaxRateBytesPerS.
[[nodiscard]] double parse_rate(const std::string& s, const std::string& option);
std::string format_size(uint64_t bytes);  // "1.5 GiB"
std::string human_size(uint64_t bytes);   // "1.5 GiB (1610612736 bytes)", as qcommit info prints

}  // namespace qcommit::cli
