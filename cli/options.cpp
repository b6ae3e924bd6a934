// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/options.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <new>

#include "cli/merge_users.h"
#include "common/defaults.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace {

// A missing argument as the synopsis names it: IMAGE for a positional one, --name otherwise
// (Program_options says "the option '--image' is required but missing" for both).
std::string missing_argument(const po::required_option& e,
                             const po::positional_options_description& pos) {
  std::string name = e.get_option_name();
  name.erase(0, name.find_first_not_of('-'));
  constexpr unsigned kPositionsLooked = 16;
  for (unsigned i = 0; i < std::min(pos.max_total_count(), kPositionsLooked); ++i) {
    if (pos.name_for_position(i) != name) continue;
    for (char& c : name) c = c == '-' ? '_' : char(std::toupper(static_cast<unsigned char>(c)));
    return "missing " + name;
  }
  return "missing --" + name;
}

}  // namespace

bool parse(const Args& args, po::options_description& opts, po::positional_options_description& pos,
           po::variables_map& vm, const char* synopsis, const char* examples,
           const po::options_description* hidden) {
  opts.add_options()("help,h", "show this help");
  po::options_description all;
  all.add(opts);
  if (hidden) all.add(*hidden);
  try {
    po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << "usage: " << synopsis << "\n\n" << opts << "\n" << examples;
      return false;
    }
    po::notify(vm);
  } catch (const po::required_option& e) {
    throw UsageError(missing_argument(e, pos) + " (usage: " + synopsis + ")");
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + " (usage: " + synopsis + ")");
  }
  return true;
}

int run_reporting_failures(const std::string& cmd, const std::function<int()>& body,
                           FailureExits exits) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "qcommit %s: %s\n", cmd.c_str(), e.what());
    return exits.usage;
  } catch (const qcow2::CorruptionError& e) {
    std::fprintf(stderr, "qcommit: %s (image is corrupt)\n", e.what());
    return exits.corrupt;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "qcommit: out of memory\n");
    return exits.error;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qcommit: %s\n", e.what());
    return exits.error;
  }
}

Output parse_output(const std::string& s) {
  if (s == "json") return Output::kJson;
  if (s == "human") return Output::kHuman;
  throw UsageError("--output must be 'human' or 'json', not '" + s + "'");
}

void add_backing_policy(po::options_description& opts, std::vector<std::string>& dirs) {
  opts.add_options()(
      "allow-backing-dir", po::value(&dirs)->composing(),
      "also follow backing files inside this directory tree (repeatable; default: only "
      "the image's own directory)");
}

void add_policy_args(po::options_description& opts, PolicyArgs& a, const PolicyArgsUsage& usage) {
  const std::string budget_help =
      std::string("added latency the guests on the same storage may see, e.g. 20ms") +
      (usage.budget_off ? ", or 'off'" : "") +
      (usage.budget_from_policy
           ? " (default: the policy of BASE's pool in the qcommitd configuration, else its "
             "[default], else "
           : " (default ") +
      defaults::budget_text() + ")";
  const std::string config_help =
      std::string("qcommitd configuration with the per-pool policies (default ") +
      defaults::kConfigPath + ")";
  const std::string connect_help =
      std::string("libvirt connection URI (default ") + defaults::kUri + ")";
  const std::string max_rate_help =
      std::string(
          "never copy faster than this many bytes per second, e.g. 50M or 1.5G (a size: K, M, G, "
          "T; at least ") +
      usage.max_rate_least + "), like virsh blockcommit --bandwidth; " +
      (usage.max_rate_use ? usage.max_rate_use : "");
  const std::string output_help = std::string("human or json") + usage.output_json;
  auto add = opts.add_options();
  add("budget", po::value(&a.budget), budget_help.c_str());
  if (usage.config) add("config", po::value(&a.config_path), config_help.c_str());
  add("connect,c", po::value(&a.uri), connect_help.c_str());
  add("uri", po::value(&a.uri), "the same as --connect");
  if (usage.max_rate_use) add("max-rate", po::value(&a.max_rate), max_rate_help.c_str());
  add("output", po::value(&a.output), output_help.c_str());
}

void note_given(PolicyArgs& a, const po::variables_map& vm) {
  a.budget_given = vm.count("budget") > 0;
  a.config_given = vm.count("config") > 0;
  a.uri_given = vm.count("connect") || vm.count("uri");
}

std::vector<std::string> backing_policy(const std::string& image,
                                        const std::vector<std::string>& extra) {
  std::vector<std::string> dirs = extra;
  dirs.push_back(std::filesystem::absolute(image).parent_path().string());
  // Where this host keeps images: a template in a pool of its own is followed without a flag.
  for (std::string& d : libvirt_image_directories(defaults::kUri)) dirs.push_back(std::move(d));
  return dirs;
}

std::optional<ChainCommand> parse_chain_command(const Args& args, const ChainCommandUsage& usage) {
  po::options_description opts("options");
  std::string image, output = "human";
  opts.add_options()("image", po::value(&image)->required(), "image file")(
      "output", po::value(&output), usage.output_help);
  std::vector<std::string> allow_dirs;
  add_backing_policy(opts, allow_dirs);
  po::positional_options_description pos;
  pos.add("image", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm, usage.synopsis, usage.examples)) return std::nullopt;
  ChainCommand cmd{.image = image, .output = parse_output(output), .chain = {}};
  cmd.chain.allowed_backing_dirs = backing_policy(image, allow_dirs);
  return cmd;
}

}  // namespace qcommit::cli
