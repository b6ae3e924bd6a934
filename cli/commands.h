// SPDX-License-Identifier: GPL-2.0-or-later
// Subcommands of the qcommit CLI. Each returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace qcommit::cli {

// Exit codes (documented in README.md).
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;      // bad input, I/O error, refused operation
inline constexpr int kExitUsage = 2;      // bad command line
inline constexpr int kExitCorrupt = 3;    // corrupt image (check: see below)
// merge --delete: merged, but not every merged layer was deleted (each one left is named with
// its reason; the same command again deletes them)
inline constexpr int kExitNotAllDeleted = 4;
// `check` exits as `qemu-img check` does, so that scripts written for it read the same verdict:
inline constexpr int kCheckExitError = 1;        // the check could not run (bad input, I/O error)
inline constexpr int kCheckExitCorrupt = 2;      // corruptions found
inline constexpr int kCheckExitLeaks = 3;        // leaked clusters only
inline constexpr int kCheckExitUnsupported = 63;  // not a qcow2 image: this format has no checks

using Args = std::vector<std::string>;

int cmd_info(const Args& args);
int cmd_map(const Args& args);
int cmd_demo(const Args& args);
int cmd_merge(const Args& args);
int cmd_check(const Args& args);
int cmd_plan(const Args& args);
int cmd_doctor(const Args& args);
int cmd_report(const Args& args);
int cmd_status(const Args& args);  // asks qcommitd over its control socket
int cmd_live(const Args& args);    // governed libvirt block commit of a running domain


}  // namespace qcommit::cli
