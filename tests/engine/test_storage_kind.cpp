// SPDX-License-Identifier: GPL-2.0-or-later
// The filesystem table (engine/storage_kind.h): which filesystems other hosts can share (the
// shared-queue probe's auto mode) and which keep their data only in the page cache (a resume's
// cache drop), from statfs(2)'s f_type and from real files.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include "engine/storage_kind.h"

using namespace qcommit::engine;

TEST_CASE("engine.storage_kind.table") {
  CHECK(storage_kind_of(0x6969).fs == "nfs");
  CHECK(storage_kind_of(0x6969).shared);
  CHECK(storage_kind_of(0xFE534D42).shared);  // SMB3
  CHECK(storage_kind_of(0x00C36400).shared);  // CephFS
  CHECK(storage_kind_of(0x65735546).shared);  // FUSE (GlusterFS, ceph-fuse)
  CHECK(storage_kind_of(0x7461636F).shared);  // OCFS2 on a shared LUN
  CHECK(storage_kind_of(0x01161970).shared);  // GFS2
  CHECK(storage_kind_of(0xEF53).fs == "ext4");
  CHECK_FALSE(storage_kind_of(0xEF53).shared);
  CHECK_FALSE(storage_kind_of(0xEF53).in_memory);
  CHECK_FALSE(storage_kind_of(0x58465342).shared);  // XFS
  CHECK_FALSE(storage_kind_of(0x2FC12FC1).shared);  // ZFS
  CHECK_FALSE(storage_kind_of(0x6969).in_memory);
  CHECK(storage_kind_of(0x01021994).in_memory);  // tmpfs
  CHECK(storage_kind_of(0x858458F6).in_memory);  // ramfs
  const StorageKind unknown = storage_kind_of(0x12345678);
  CHECK(unknown.fs == "type 0x12345678");
  CHECK_FALSE(unknown.shared);
  CHECK_FALSE(unknown.in_memory);
}

TEST_CASE("engine.storage_kind.real_files") {
  // /dev/shm is tmpfs: local, in memory, by path and by open file alike.
  const std::optional<StorageKind> shm = storage_kind_at("/dev/shm");
  REQUIRE(shm.has_value());
  CHECK(shm->fs == "tmpfs");
  CHECK_FALSE(shm->shared);
  CHECK(shm->in_memory);
  const int fd = ::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const std::optional<StorageKind> by_fd = storage_kind_of_fd(fd);
  ::close(fd);
  REQUIRE(by_fd.has_value());
  CHECK(by_fd->fs == "tmpfs");
  CHECK(by_fd->in_memory);
  // A path that does not exist, or a closed descriptor, cannot be told.
  CHECK_FALSE(storage_kind_at("/nonexistent/base.qcow2").has_value());
  CHECK_FALSE(storage_kind_of_fd(-1).has_value());
}
