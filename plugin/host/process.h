// SPDX-License-Identifier: GPL-2.0-or-later
// Running helper programs (qemu-img) without a shell: arguments are passed as data.  Used by
// qcommitd (the fresh overlay of a two-phase merge) and by the CLI (demo, doctor).
#pragma once

#include <string>
#include <vector>

namespace qcommit::plugin {

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs argv[0] (looked up in PATH) and captures its output.
ProcessResult run_process(const std::vector<std::string>& argv);

// Runs and throws std::runtime_error with the output if the exit code is not 0.
std::string run_checked(const std::vector<std::string>& argv);

}  // namespace qcommit::plugin
