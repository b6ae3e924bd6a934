// SPDX-License-Identifier: GPL-2.0-or-later
// Shared command-line parsing helpers (Boost.Program_options).
#pragma once

#include <boost/program_options.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
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
