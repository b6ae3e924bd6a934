// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit live`'s options: what the command line asks for, checked and derived in one step.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/options.h"
#include "common/defaults.h"
#include "plugin/govern/job_pacing.h"
#include "plugin/govern/writeback.h"
#include "plugin/live/live.h"

namespace qcommit::cli {

// A failure that ends the command with one line and exit 1.
struct LiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// --budget, --connect, --max-rate, --output: PolicyArgs (budget: the built-in default, set by
// add_live_options).
struct LiveArgs : PolicyArgs {
  plugin::LiveRequest req;
  std::string probe;     // --probe, "" when not given (the policy's default: auto)
  std::string wait = defaults::lock_wait_text();
  std::string daemon_socket = defaults::kSocketPath;
  std::string qmp;
  std::string overlay_dir;
  std::string strategy = plugin::to_string(plugin::kDefaultLiveStrategy);
  std::string page_cache_name = "auto";
  bool dry_run = false;
  std::vector<std::string> pos;
  // Derived by validate().
  std::optional<double> max_rate_bytes_per_s;
  bool json_out = false;
  plugin::PageCacheSource page_cache = plugin::PageCacheSource::kAuto;
  plugin::Duration wait_limit{};
};

// Parses and checks `qcommit live`'s arguments into `a` (UsageError on bad ones). False when
// --help was asked for (and printed).
[[nodiscard]] bool parse_live_args(const Args& args, LiveArgs& a);

}  // namespace qcommit::cli
