// SPDX-License-Identifier: GPL-2.0-or-later
// Which processes hold a file open, read from /proc: the engine names the holders of an image it
// cannot lock, qcommitd finds the QEMU that writes an image.
//
// The walk never waits for a file's storage. Attributes come from statx(AT_STATX_DONT_SYNC) with
// the smallest mask (type and inode: no size or times, which would make NFS flush first), so a
// process holding a file on a dead NFS or FUSE mount cannot hang it; and when only descriptors
// open for writing count, the access mode is read from fdinfo before anything is stat'ed.
#pragma once

#include <fcntl.h>  // AT_STATX_*
#include <sys/stat.h>
#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qcommit::engine {

// A file's identity: device and inode, or for a block device the device it is (st_rdev), since a
// QEMU in a mount namespace of its own reaches it through another /dev node. Files are compared
// by identity, never by name.
struct FileId {
  bool block = false;
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

// statx(2)'s signature: every attribute the walk reads goes through one (a seam for tests).
using StatxFn = int (*)(int dirfd, const char* path, int flags, unsigned int mask,
                        struct statx* out);

// The statx flags and mask the walk uses (exposed so that tests can check them).
inline constexpr int kProcWalkStatxFlags = AT_STATX_DONT_SYNC;
inline constexpr unsigned int kProcWalkStatxMask = STATX_TYPE | STATX_INO;

// Where the walk reads from: the proc root and the statx it calls.
struct ProcSource {
  std::string root = "/proc";
  StatxFn statx = &::statx;
};

// Which descriptors count: any, or only those opened for writing (O_WRONLY or O_RDWR).
enum class Access { any, writing };

// A process holding a file: its PID and command name (/proc/PID/comm).
struct Holder {
  pid_t pid = 0;
  std::string name;
};

// `path`'s identity (following symlinks); nullopt when it cannot be stat'ed.
[[nodiscard]] std::optional<FileId> file_id(const std::string& path, const ProcSource& src = {});

// The command name of process `pid` ("" when it is gone).
[[nodiscard]] std::string process_name(pid_t pid, const ProcSource& src = {});

// The files process `pid` holds open with `access`, one entry per descriptor.
[[nodiscard]] std::vector<FileId> open_files(pid_t pid, Access access,
                                             const ProcSource& src = {});

// Every process but this one that holds `path` open with `access`, in /proc order. With `only`,
// just the processes whose command name it accepts (their descriptors are not even read
// otherwise). Empty when `path` cannot be stat'ed or /proc is unreadable.
[[nodiscard]] std::vector<Holder> holders_of(const std::string& path, Access access,
                                             bool (*only)(std::string_view name) = nullptr,
                                             const ProcSource& src = {});

// "pid 1234 (qemu-system-x86), pid 99 (qemu-img)"; "" for none.
[[nodiscard]] std::string describe(const std::vector<Holder>& holders);

// QEMU by its command name: qemu* (qemu-system-*, qemu-kvm, and QEMU's tools) or kvm (Proxmox).
[[nodiscard]] bool runs_qemu(std::string_view name);

// A QEMU that runs a guest: runs_qemu, but none of QEMU's command-line tools (qemu-img,
// qemu-io, qemu-nbd), which hold an image for one task, not for a guest's lifetime.
[[nodiscard]] bool runs_guest(std::string_view name);

}  // namespace qcommit::engine
