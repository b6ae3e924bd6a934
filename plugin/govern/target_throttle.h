// SPDX-License-Identifier: GPL-2.0-or-later
// A throttle filter node under a block job's target, so that QEMU meters the job's writes instead
// of the storage queueing them.
//
// QEMU's mirror (an active commit) copies up to 16 MiB of consecutive dirty clusters per
// iteration, as up to 16 requests of 1 MiB in flight together, and only then sleeps the burst off
// at the job's speed: with cache=none (the requests reach the storage as they are) a guest write
// that lands in a burst waits behind up to 16 MiB, ~330 ms at 50 MB/s, whatever the speed
// (docs/benchmarks.md).  `block-commit` has no buf-size.  A throttle filter between the target's
// format node and its file node holds the job's requests in QEMU and lets them out at the
// filter's write rate: the storage then has about one 1 MiB request of the job's at a time
// (lab, QEMU 7.2, 256 MiB, 26 MiB/s: probe p99 17.7 ms, max 17.9 ms after the filter went in).
// During an active commit only the job writes to the target (the guest writes to the top);
// reads are not limited.
//
// Steps (QMP, each its own command): find the target's format node (query-named-block-nodes) and
// its children (x-debug-query-block-graph); object-add a throttle-group with the write rate;
// blockdev-add a throttle node over the file node (no parent yet: it takes no permissions);
// blockdev-reopen the format node with `file` the throttle node and every other option as the
// node was opened with.  Removal reopens it with its file node again, then blockdev-del and
// object-del.  A reopen is all-or-nothing: when it fails the graph is as before.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "plugin/host/json.h"

namespace qcommit::plugin {

// One QMP command: QEMU's "return", or nullopt with *error set to one line.
using QmpCall = std::function<std::optional<json::Value>(
    std::string_view command, const json::Value& args, std::string* error)>;

// What the format node was opened with beyond what QEMU reports back: the disk's discard mode as
// its configuration gives it ("unmap" or "ignore").
struct FormatNodeOptions {
  std::string discard = "ignore";
};

// The target's nodes and the options its format node is reopened with (without `file`).
struct TargetNodes {
  std::string format_node;
  std::string file_node;
  json::Value
      reopen_options;  // driver, node-name, read-only, cache, detect-zeroes, discard, backing
};

// The target's format node: the node whose filename is `target_path` with a format driver (qcow2
// or raw) and whose `file` child is the protocol node of the same path.  An error line when there
// is none, more than one, or a driver or child this does not know how to reopen.
[[nodiscard]] std::variant<TargetNodes, std::string> find_target_nodes(
    const json::Value& named_nodes, const json::Value& graph, const std::string& target_path,
    const FormatNodeOptions& given);

// The names a filter for `tag` (e.g. the job's adoption number) uses: one group and one node.
struct TargetThrottle {
  TargetNodes nodes;
  std::string group_id;
  std::string filter_node;
  std::uint64_t bytes_per_s = 0;  // the write rate set last
};

[[nodiscard]] json::Value throttle_limits(std::uint64_t bytes_per_s);

// Puts the filter in at `bytes_per_s`.  On error nothing of it is left in QEMU (what was added
// is deleted again) and the error line says which step failed.
[[nodiscard]] std::variant<TargetThrottle, std::string> insert_target_throttle(
    const QmpCall& qmp, const std::string& target_path, const FormatNodeOptions& given,
    const std::string& tag, std::uint64_t bytes_per_s);
// A new write rate (qom-set of the group's limits); nullopt on success.
[[nodiscard]] std::optional<std::string> set_target_throttle(const QmpCall& qmp, TargetThrottle& t,
                                                             std::uint64_t bytes_per_s);
// Takes the filter out again; nullopt on success.  The format node is reopened (with its options
// as they are now, and its file node) only while the filter is still its file child; the reopen
// waits for the requests the filter holds (QEMU drains the node).
[[nodiscard]] std::optional<std::string> remove_target_throttle(const QmpCall& qmp,
                                                                const TargetThrottle& t,
                                                                const FormatNodeOptions& given);

// Filters a qcommit process that is gone left in QEMU (killed before it could take them out):
// throttle nodes named qcommit-tf-PID-N whose PID `alive` says runs no more.  Each is set
// unlimited (what it holds goes to storage at once: up to one 16 MiB burst), then taken out
// of its parent's file edge (the parent reopened with the filter's own child and the options
// `options_for(the image's path: the filter's child's filename)` gives; none: left in, with an
// error line) and deleted with its group.  Then throttle groups named qcommit-tg-PID-N of gone
// processes that no filter uses (the process died between adding the group and the filter) are
// deleted.  One line per filter or group removed ("removed ...") or not ("...: why").
[[nodiscard]] std::vector<std::string> remove_orphan_throttles(
    const QmpCall& qmp, const std::function<bool(long)>& alive,
    const std::function<std::optional<FormatNodeOptions>(const std::string&)>& options_for);

}  // namespace qcommit::plugin
