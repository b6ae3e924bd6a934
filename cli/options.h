// SPDX-License-Identifier: GPL-2.0-or-later
// Shared command-line parsing helpers (Boost.Program_options).
#pragma once

#include <boost/program_options.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/defaults.h"
#include "qcow2/chain.h"

namespace qcommit::cli {

namespace po = boost::program_options;

enum class Output { kHuman, kJson };

// Parses args into vm; prints help and returns false if --help was given.
// Throws UsageError (a std::runtime_error) on bad options.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `hidden`: options parsed but not listed in --help (positional arguments the synopsis names).
bool parse(const Args& args, po::options_description& opts, po::positional_options_description& pos,
           po::variables_map& vm, const char* synopsis, const char* examples,
           const po::options_description* hidden = nullptr);

Output parse_output(const std::string& s);

// The exit codes of a command's failures; `check` has qemu-img check's.
struct FailureExits {
  int usage = kExitUsage;
  int corrupt = kExitCorrupt;
  int error = kExitError;
};
inline constexpr FailureExits kCheckFailureExits{kCheckExitError, kCheckExitCorrupt,
                                                 kCheckExitError};

// Runs `body` (a command) and turns what it throws into one line on stderr and an exit code.
int run_reporting_failures(const std::string& cmd, const std::function<int()>& body,
                           FailureExits exits = {});

// The backing-file policy option shared by every command that follows a chain:
// backing files must lie inside the image's own directory tree, a directory where the host's
// libvirt (qemu:///system) keeps images (its storage pools, its domains' disks), or one given with
// --allow-backing-dir (repeatable; "/" allows everything).
void add_backing_policy(po::options_description& opts, std::vector<std::string>& dirs);
std::vector<std::string> backing_policy(const std::string& image,
                                        const std::vector<std::string>& extra);

// The options qcommit merge, plan and live share: the budget, the policy file, the libvirt
// connection, the rate cap and the output.  Each command sets the defaults it starts from
// (budget: "" for the policy's, or a duration) before parsing.
struct PolicyArgs {
  std::string budget;  // --budget, "" when not given and the command has no default
  std::string config_path = defaults::kConfigPath;
  std::string uri = defaults::kUri;
  std::string max_rate;  // --max-rate, "" when not given
  std::string output = "human";
  // Set by note_given() after parsing.
  bool budget_given = false, config_given = false, uri_given = false;
};
// How one command offers them: which of them, and what its help says where commands differ.
struct PolicyArgsUsage {
  bool budget_off = true;              // --budget off: no budget at all
  bool budget_from_policy = true;      // the default budget is the policy's (else the built-in)
  bool config = true;                  // --config: the policy file is read
  const char* max_rate_use = nullptr;  // what --max-rate does here (nullptr: not offered)
  const char* max_rate_least = "4K";   // the smallest --max-rate
  const char* output_json = "";        // after "human or json": what the JSON is
};
// Adds --budget, --config, -c/--connect and --uri, --max-rate and --output to `opts`.
void add_policy_args(po::options_description& opts, PolicyArgs& a, const PolicyArgsUsage& usage);
// Which of them the command line gave.
void note_given(PolicyArgs& a, const po::variables_map& vm);

// The command line of a command that reads one image's chain (info, map): IMAGE, --output
// (described by `output_help`) and the backing-file policy.
struct ChainCommand {
  std::string image;
  Output output = Output::kHuman;
  qcow2::ChainOptions chain;  // allowed_backing_dirs set from the policy
};
struct ChainCommandUsage {
  const char* output_help;
  const char* synopsis;
  const char* examples;
};
// Empty after --help; throws UsageError on bad options.
std::optional<ChainCommand> parse_chain_command(const Args& args, const ChainCommandUsage& usage);

}  // namespace qcommit::cli
