// Sizes and durations on the command line: "20ms", "1.5s", "off"; "50M", "1G", "4096".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/merge.h"

namespace qcommit::cli {

// Throws UsageError on bad input.
std::chrono::nanoseconds parse_duration(const std::string& s);
uint64_t parse_size(const std::string& s);
std::string format_size(uint64_t bytes);  // "1.5 GiB"
std::string human_size(uint64_t bytes);   // "1.5 GiB (1610612736 bytes)", as qcommit info prints

}  // namespace qcommit::cli
