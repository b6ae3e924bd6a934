// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/storage_kind.h"

#include <sys/statfs.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <system_error>
#include <vector>

#include "engine/mounts.h"

namespace qcommit::engine {

namespace fs = std::filesystem;

namespace {

struct KnownFs {
  std::uint64_t magic;  // linux/magic.h and the filesystems' own headers
  const char* name;
  bool shared;
  bool in_memory = false;
  bool stacked = false;
};

constexpr std::array kKnownFilesystems{
    KnownFs{0x6969, "nfs", true},
    KnownFs{0xFF534D42, "cifs", true},
    KnownFs{0xFE534D42, "smb3", true},
    KnownFs{0x517B, "smb", true},
    KnownFs{0x00C36400, "ceph", true},
    KnownFs{0x65735546, "fuse", true},
    KnownFs{0x01021997, "9p", true},
    KnownFs{0x6B414653, "afs", true},
    KnownFs{0x5346414F, "afs", true},
    KnownFs{0x0BD00BD0, "lustre", true},
    KnownFs{0x47504653, "gpfs", true},
    KnownFs{0x7461636F, "ocfs2", true},
    KnownFs{0x01161970, "gfs2", true},
    KnownFs{0xEF53, "ext4", false},
    KnownFs{0x58465342, "xfs", false},
    KnownFs{0x9123683E, "btrfs", false},
    KnownFs{0x2FC12FC1, "zfs", false},
    KnownFs{0xF2F52010, "f2fs", false},
    KnownFs{0x01021994, "tmpfs", false, true},
    KnownFs{0x858458F6, "ramfs", false, true},
    KnownFs{0x794C7630, "overlayfs", false, false, true},
    KnownFs{0xF15F, "ecryptfs", false, false, true},
};

}  // namespace

StorageKind storage_kind_of(std::uint64_t f_type) {
  for (const KnownFs& k : kKnownFilesystems)
    if (k.magic == f_type) return {k.name, k.shared, k.in_memory, k.stacked};
  char name[32];
  std::snprintf(name, sizeof name, "type 0x%llx", static_cast<unsigned long long>(f_type));
  return {name, false};
}

namespace {

// f_type is a signed word on some ABIs: the magic is its low 32 bits.
StorageKind kind_of_statfs(const struct statfs& s) {
  return storage_kind_of(static_cast<std::uint64_t>(s.f_type) & 0xFFFFFFFFu);
}

}  // namespace

std::optional<StorageKind> storage_kind_at(const std::string& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return std::nullopt;
  return kind_of_statfs(s);
}

std::optional<StorageKind> storage_kind_of_fd(int fd) {
  struct statfs s {};
  if (::fstatfs(fd, &s) != 0) return std::nullopt;
  return kind_of_statfs(s);
}

namespace {
// Stacked filesystems seen through at most this deep (an overlay over an overlay, ...).
constexpr int kMaxStackDepth = 4;
}  // namespace

std::optional<StorageKind> storage_kind_beneath(int fd) {
  std::optional<StorageKind> kind = storage_kind_of_fd(fd);
  if (!kind || !kind->stacked) return kind;
  std::error_code ec;
  fs::path path = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  if (ec) return kind;
  const std::vector<MountEntry> mounts = read_mounts();
  for (int depth = 0; depth < kMaxStackDepth && kind->stacked; ++depth) {
    const std::optional<std::string> lower = stacked_lower_path(path.string(), mounts);
    if (!lower) break;
    const std::optional<StorageKind> beneath = storage_kind_at(*lower);
    if (!beneath) break;
    kind = beneath;
    path = fs::weakly_canonical(*lower, ec);
    if (ec) break;
  }
  return kind;
}

}  // namespace qcommit::engine
