// SPDX-License-Identifier: GPL-2.0-or-later
// A wait (engine/wait_notice.h) as qcommit shows it: the "wait" event of --output=json, built
// here for every command that waits (merge, live), or the line on stderr.
#pragma once

#include <string_view>

#include "cli/json.h"
#include "engine/wait_notice.h"

namespace qcommit::cli {

// {"event": "wait", "for": KIND, "message": ..., "timeout-s": ..., and the members of KIND}:
//   lock             path, holders [{pid, command}], conflict
//   close            path, holders
//   device-node      path
//   domain-shutdown  domain
//   block-job        domain, disk, job, percent (when known)
//   connection       uri or qmp
// "timeout-s" (seconds) is absent when the wait is unbounded.
[[nodiscard]] json::Ordered wait_event(const engine::WaitNotice& n);

// The event on stdout with --output=json, else "`prefix`: message" on stderr.
void show_wait(const engine::WaitNotice& n, bool json_out, std::string_view prefix);

}  // namespace qcommit::cli
