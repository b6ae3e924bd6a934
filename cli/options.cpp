#include "cli/options.h"

#include <filesystem>
#include <iostream>

namespace qcommit::cli {

bool parse(const Args& args, po::options_description& opts, po::positional_options_description& pos,
           po::variables_map& vm, const char* synopsis, const char* examples) {
  opts.add_options()("help,h", "show this help");
  try {
    po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << "usage: " << synopsis << "\n\n" << opts << "\n" << examples;
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + " (usage: " + synopsis + ")");
  }
  return true;
}

Output parse_output(const std::string& s) {
  if (s == "json") return Output::kJson;
  if (s == "human") return Output::kHuman;
  throw UsageError("--output must be 'human' or 'json', not '" + s + "'");
}

void add_backing_policy(po::options_description& opts, std::vector<std::string>& dirs) {
  opts.add_options()("allow-backing-dir", po::value(&dirs)->composing(),
                     "also follow backing files inside this directory tree (repeatable; default: only "
                     "the image's own directory)");
}

std::vector<std::string> backing_policy(const std::string& image, const std::vector<std::string>& extra) {
  std::vector<std::string> dirs = extra;
  dirs.push_back(std::filesystem::absolute(image).parent_path().string());
  return dirs;
}

}  // namespace qcommit::cli
