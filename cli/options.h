// Shared command-line parsing helpers (Boost.Program_options).
#pragma once

#include <boost/program_options.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace qcommit::cli {

namespace po = boost::program_options;

enum class Output { kHuman, kJson };

// Parses args into vm; prints help and returns false if --help was given.
// Throws UsageError (a std::runtime_error) on bad options.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool parse(const Args& args, po::options_description& opts, po::positional_options_description& pos,
           po::variables_map& vm, const char* synopsis, const char* examples);

Output parse_output(const std::string& s);

// The backing-file policy option shared by every command that follows a chain:
// backing files must lie inside the image's own directory tree, or one given with
// --allow-backing-dir (repeatable; "/" allows everything).
void add_backing_policy(po::options_description& opts, std::vector<std::string>& dirs);
std::vector<std::string> backing_policy(const std::string& image, const std::vector<std::string>& extra);

}  // namespace qcommit::cli
