// SPDX-License-Identifier: GPL-2.0-or-later
// Whether a target's storage can be shared with other hosts, from the type of the filesystem it
// is on (statfs(2) f_type): what the shared-queue probe's `auto` mode (plugin/policy/config.h) asks; and
// whether the page cache is the storage itself (tmpfs, ramfs), which a merge's resume asks before it
// drops cached pages to read BASE again (engine/merge.cpp).
//
// Shared: network and cluster filesystems (NFS, SMB/CIFS, CephFS, GlusterFS and others over
// FUSE, 9p, AFS, Lustre, GPFS, OCFS2, GFS2).  FUSE counts as shared: GlusterFS, CephFS's and
// MooseFS's clients mount that way, and the kernel does not tell them from a local one.  Local:
// everything else, including a type this list does not know (a block device's node is on
// devtmpfs; no probe file can stand for a LUN anyway).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace qcommit::engine {

struct StorageKind {
  std::string fs;       // "nfs", "ext4", ..., or "type 0x..." when not known here
  bool shared = false;  // other hosts can have it mounted too
  bool in_memory = false;  // the page cache is the storage (tmpfs, ramfs): nothing behind it
  bool stacked = false;    // over another filesystem (overlayfs, eCryptfs): see storage_kind_beneath
};

// Pure: the kind of a statfs(2) f_type.
[[nodiscard]] StorageKind storage_kind_of(std::uint64_t f_type);

// statfs(2) of `path`; nullopt when it fails.
[[nodiscard]] std::optional<StorageKind> storage_kind_at(const std::string& path);

// fstatfs(2) of an open file; nullopt when it fails.
[[nodiscard]] std::optional<StorageKind> storage_kind_of_fd(int fd);

// The kind of the filesystem an open file's data lives on: through a stacked filesystem
// (overlayfs' upper or lower layer, eCryptfs' lower directory, engine/mounts.h) to the one
// beneath; where that cannot be told, the stacked one itself.
[[nodiscard]] std::optional<StorageKind> storage_kind_beneath(int fd);

}  // namespace qcommit::engine
