// SPDX-License-Identifier: GPL-2.0-or-later
// The defaults a user meets, in one place: qcommit's and qcommitd's options, the policy file's
// built-in values and the --help texts that name them all come from here. No dependencies, so
// every layer may include it.
#pragma once

#include <chrono>
#include <string>

namespace qcommit::defaults {

// Added latency a governed merge or block job may cost the guests sharing its storage (--budget,
// the policy file's budget=, a domain's <qcommit:policy budget=/>).
inline constexpr std::chrono::milliseconds kBudget{20};
// The copy's rate bounds under a policy (floor=, ceiling=), bytes per second.
inline constexpr double kFloorBytesPerS = 1024.0 * 1024.0;
inline constexpr double kCeilingBytesPerS = 1024.0 * 1024.0 * 1024.0;

// The shared-queue probe's period (the policy file's probe=): a 4 KiB write + flush this often on
// the job's target storage, where other hosts can share it (probe=auto, the default).
inline constexpr std::chrono::milliseconds kProbePeriod{100};

// How long `qcommit merge` waits for another process to release an image (--wait).
inline constexpr std::chrono::seconds kLockWait{10};

inline constexpr const char* kConfigPath = "/etc/qcommit/qcommitd.conf";  // --config
inline constexpr const char* kUri = "qemu:///system";                     // --connect, --uri
inline constexpr const char* kSocketPath = "/run/qcommit/qcommitd.sock";  // qcommitd --socket

// The values above as the duration grammar writes them (for --help and option defaults).
[[nodiscard]] inline std::string budget_text() { return std::to_string(kBudget.count()) + "ms"; }
[[nodiscard]] inline std::string lock_wait_text() {
  return std::to_string(kLockWait.count()) + "s";
}

}  // namespace qcommit::defaults
