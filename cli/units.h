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

// The latency-budget governor for an offline merge into `base` (the directory of TOP when base
// is empty): our own write latencies, a 4 KiB O_DSYNC probe on the target's filesystem, and the
// target's dirty/writeback pages.
std::shared_ptr<engine::CopyGovernor> make_budget_governor(std::chrono::nanoseconds budget,
                                                           const std::string& top,
                                                           const std::string& base,
                                                           const std::string& trace_path, bool probe);

}  // namespace qcommit::cli
