// SPDX-License-Identifier: GPL-2.0-or-later
// What a QEMU process's command line says of its disks' aio modes (threads, native, io_uring), for
// the QMP adapter: QMP does not report a node's aio (QEMU 7.2: neither query-block nor
// query-named-block-nodes nor x-debug-query-block-graph carries it), while the options QEMU was
// started with do.  Pure (no I/O but read_cmdline), exposed for tests.
//
// The options read: -drive (QemuOpts: key=value,... with ",," for a comma in a value), -blockdev
// and -device (the same key=value form with dotted keys, "driver" implied for a first element
// without '=', or one JSON object).  A disk added later over QMP (hot-plug) is not there: its
// mode is unknown.  An external snapshot's overlay (blockdev-snapshot-sync) opens with the flags
// of the layer it replaces, so the mode the disk started with still holds after one.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace qcommit::plugin {

struct QemuCommandLine {
  // One option's value as dotted keys ("file.aio" for {"file": {"aio": ...}} or file.aio=...).
  using Options = std::map<std::string, std::string>;
  std::vector<Options> drives, blockdevs, devices;
};

// The -drive, -blockdev and -device options of `argv` (argv[0] included or not).  An option QEMU
// could not have parsed is left out.
[[nodiscard]] QemuCommandLine parse_qemu_command_line(const std::vector<std::string>& argv);

// /proc/PID/cmdline, split at its NULs; empty when it cannot be read.
[[nodiscard]] std::vector<std::string> read_cmdline(pid_t pid);

// Where a disk is found on the command line: its BlockBackend name (-drive id=; "" for
// -blockdev + -device), the qdev id of its device ("" when none), its root node name.
struct DiskNames {
  std::string drive;
  std::string qdev_id;
  std::string root_node;
};

// The aio mode of the disk's protocol node (file, host_device, host_cdrom) as the command line
// sets it: "threads", "native", "io_uring", or "" when the node is there without one (QEMU's
// default: threads); nullopt when the command line does not lead to such a node.  The disk is
// the -drive of that id, else the -blockdev of its root node, else of the -device's drive=;
// from a format or filter node the way down is its "file" child (a node name or nested options).
[[nodiscard]] std::optional<std::string> aio_of(const QemuCommandLine& cl, const DiskNames& disk);

}  // namespace qcommit::plugin
