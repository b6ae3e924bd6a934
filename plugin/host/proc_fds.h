// SPDX-License-Identifier: GPL-2.0-or-later
// Which images a process (QEMU) holds open, and how, read from /proc: libvirt does not say which
// image a non-active block commit writes into, but QEMU reopens that image read-write for the
// job while the rest of the backing chain stays read-only. The walk itself is engine/proc_walk.h.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

namespace qcommit::plugin {

// The first QEMU process (command name qemu* or kvm; not this one) that holds `path` open for
// writing; nullopt when none or /proc is unreadable.  Files are compared by identity
// (engine::FileId), not by name.
[[nodiscard]] std::optional<pid_t> writer_of(const std::string& path,
                                             const std::string& proc = "/proc");

// Of `chain` (backing files, top to bottom), the lowest one that process `pid` holds open for
// writing; nullopt when it holds none of them so.
[[nodiscard]] std::optional<std::string> lowest_written(pid_t pid,
                                                        const std::vector<std::string>& chain,
                                                        const std::string& proc = "/proc");

// A non-active commit's base: the lowest backing image that the QEMU running `active` (the
// disk's active layer) has open for writing.
[[nodiscard]] std::optional<std::string> commit_base_in_use(const std::string& active,
                                                            const std::vector<std::string>& chain);

}  // namespace qcommit::plugin
