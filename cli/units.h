// SPDX-License-Identifier: GPL-2.0-or-later
// Sizes and durations on the command line: "20ms", "1.5s"; "50M", "1G", "4096". Durations follow
// the one grammar of plugin::read_duration (a unit is required), shared with the configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/merge.h"

namespace qcommit::cli {

// Throws UsageError on bad input, naming `option` and showing the fix:
// "--budget 20: a duration needs a unit: 20ms or 20s". Zero is refused too. ("off", where an
// option takes it, is the caller's.)
[[nodiscard]] std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& option = "--budget");
uint64_t parse_size(const std::string& s);
std::string format_size(uint64_t bytes);  // "1.5 GiB"
std::string human_size(uint64_t bytes);   // "1.5 GiB (1610612736 bytes)", as qcommit info prints

}  // namespace qcommit::cli
