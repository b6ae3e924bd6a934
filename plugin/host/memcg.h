// SPDX-License-Identifier: GPL-2.0-or-later
// A process's memory cgroup and the page-cache counts in its memory.stat: where the kernel has no
// cachestat(2), the dirty and writeback pages of the cgroup that QEMU runs in bound those of a
// job's target (QEMU's own writes are charged to it; the guest's cached writes count too).
//
// libvirt puts each QEMU in a cgroup of its own: with systemd
// machine.slice/machine-qemu\x2dN\x2dNAME.scope, without it /machine/qemu-N-NAME.libvirt-qemu
// (and on cgroup v1, threads in sub-groups such as emulator/ or vcpuN/ of the cpu controllers).
// Everything here but read_memcg_page_cache is pure over text or a directory tree, so that tests
// run it on a fake root.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace qcommit::plugin {

struct MemcgPageCache {
  std::uint64_t dirty_bytes = 0;
  std::uint64_t writeback_bytes = 0;
  bool operator==(const MemcgPageCache&) const = default;
};

// memory.stat text, cgroup v1 (`dirty`, `writeback`; `total_dirty`, `total_writeback`, which
// include descendant groups, are preferred when present) or v2 (`file_dirty`, `file_writeback`,
// hierarchical already).  Values are bytes.  nullopt when neither pair is complete.
[[nodiscard]] std::optional<MemcgPageCache> parse_memory_stat(const std::string& text);

// The memory cgroup directory of a process, from its /proc/PID/cgroup text, under the cgroup
// filesystem root `cgroup_root` (/sys/fs/cgroup): the v1 memory hierarchy when the memory
// controller is mounted as v1 (cgroup_root/memory), else the unified one (cgroup_root/unified on a
// hybrid host, cgroup_root itself on a v2-only one).  From the process's group it walks up to the
// nearest directory that has memory.stat (a v2 root has none).  nullopt when none is found.
[[nodiscard]] std::optional<std::filesystem::path> memcg_dir(
    const std::string& proc_cgroup_text, const std::filesystem::path& cgroup_root);

// memcg_dir of process `pid` from proc_root/PID/cgroup.
[[nodiscard]] std::optional<std::filesystem::path> memcg_dir_of(
    pid_t pid, const std::filesystem::path& proc_root = "/proc",
    const std::filesystem::path& cgroup_root = "/sys/fs/cgroup");

// parse_memory_stat of dir/memory.stat; nullopt when it cannot be read.
[[nodiscard]] std::optional<MemcgPageCache> read_memcg_page_cache(const std::filesystem::path& dir);

}  // namespace qcommit::plugin
