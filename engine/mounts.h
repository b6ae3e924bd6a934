// SPDX-License-Identifier: GPL-2.0-or-later
// The mount table (/proc/self/mountinfo), read in one place: `qcommit doctor` names the mount a
// disk's layers lie on, and the storage-kind table sees through stacked filesystems (overlayfs,
// eCryptfs) to the filesystem a file's data actually lives on.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qcommit::engine {

struct MountEntry {
  dev_t dev = 0;               // st_dev of the filesystem (major:minor)
  std::string root;            // the directory of the filesystem mounted here
  std::string point;           // where it is mounted
  std::string type;            // "ext4", "overlay", "ecryptfs", "fuse.sshfs", ...
  std::string source;          // the mount source ("/dev/sda1", the eCryptfs lower directory)
  std::string super_options;   // "rw,lowerdir=...,upperdir=...,workdir=..."
};

// One line of /proc/self/mountinfo; nullopt for a line that is not one. Pure (tests).
[[nodiscard]] std::optional<MountEntry> parse_mountinfo_line(const std::string& line);

// Every mount of this process's namespace (empty when /proc is unreadable).
[[nodiscard]] std::vector<MountEntry> read_mounts();

// Of the mounts of the filesystem on `dev`, the deepest under which `path` lies (a filesystem may
// be mounted more than once); failing that, any of them.
[[nodiscard]] std::optional<MountEntry> mount_of(dev_t dev, const std::string& path,
                                                 const std::vector<MountEntry>& mounts);

// The deepest mount whose mount point contains `path` (an absolute path without symlinks).
[[nodiscard]] std::optional<MountEntry> mount_containing(const std::string& path,
                                                         const std::vector<MountEntry>& mounts);

// Where the file `real_path` (absolute, no symlinks) of a stacked filesystem lives in the layer
// beneath: overlayfs' upper directory where the file was copied up, else the first lower
// directory that has it; eCryptfs' lower directory. nullopt for other filesystems or when it
// cannot be told.
[[nodiscard]] std::optional<std::string> stacked_lower_path(const std::string& real_path,
                                                            const std::vector<MountEntry>& mounts);

}  // namespace qcommit::engine
