// SPDX-License-Identifier: GPL-2.0-or-later
// What qcommit waits for when another actor has what it needs for a moment: a process holding an
// image's lock or keeping it open, a device node udev is still creating, a domain shutting down,
// somebody else's block job, a lost connection to the hypervisor. A wait is told once, when it
// begins, as a WaitNotice: its kind, the one line said on stderr, and the members of its kind.
// The CLI shows it as that line or as a "wait" event with --output=json (cli/wait_event.h: one
// builder, so that a member has the same name in every command).
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "engine/proc_walk.h"

namespace qcommit::engine {

enum class WaitFor {
  kLock,            // another process holds a lock on `path` that conflicts with ours
  kClose,           // `holders` have `path` open, which --delete is to remove
  kDeviceNode,      // the device node `path` does not exist yet (or has no device behind it)
  kDomainShutdown,  // `domain` is shutting down; awaited: shut off
  kBlockJob,        // a block job somebody else started runs on `domain` `disk`
  kConnection,      // the connection to the hypervisor (`uri` or `qmp`) was lost
};

// The kind as the "for" member of a "wait" event: "lock", "close", "device-node",
// "domain-shutdown", "block-job", "connection".
[[nodiscard]] constexpr const char* wait_for_name(WaitFor w) {
  switch (w) {
    case WaitFor::kLock: return "lock";
    case WaitFor::kClose: return "close";
    case WaitFor::kDeviceNode: return "device-node";
    case WaitFor::kDomainShutdown: return "domain-shutdown";
    case WaitFor::kBlockJob: return "block-job";
    case WaitFor::kConnection: return "connection";
  }
  return "?";
}

struct WaitNotice {
  WaitFor what = WaitFor::kLock;
  // "waiting up to 10 s for pid 5087 (qemu-io) to release base.qcow2 (another process holds the
  // consistent read permission)"
  std::string message;
  // The longest the wait may last; nullopt: until it ends (a lost libvirt connection).
  std::optional<std::chrono::nanoseconds> timeout;
  std::string path;              // kLock, kClose, kDeviceNode: the file, absolute (the message
                                 // names it as the chain does)
  std::vector<Holder> holders;   // kLock, kClose: the processes that have `path` open (empty when
                                 // none can be seen: another PID namespace, another host)
  std::string conflict;          // kLock: "another process holds the consistent read permission"
  std::string domain;            // kDomainShutdown, kBlockJob
  std::string disk;              // kBlockJob: the disk's target ("vda")
  std::string job;               // kBlockJob: its type ("commit", "active-commit", "backup", ...)
  std::optional<double> percent; // kBlockJob: how far it is, when known
  std::string uri;               // kConnection: the libvirt URI, or
  std::string qmp;               // kConnection: QEMU's QMP socket
};

// Told once per wait, when it begins.
using LockWaitNotice = std::function<void(const WaitNotice& notice)>;

// `path` made absolute and normal for WaitNotice::path (as given when the working directory
// cannot be read).
[[nodiscard]] inline std::string notice_path(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

}  // namespace qcommit::engine
