// SPDX-License-Identifier: GPL-2.0-or-later
// The checkpoint of a merge: which merge it is (the layers above BASE and BASE, by identity) and
// how far its copy got, so that running the same merge again resumes it. It lives beside a file
// BASE (".BASE.qcommit-merge") or, for a block device, in the state directory.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace qcommit::engine {

struct Checkpoint {
  std::string identity;
  uint64_t done = 0;
  // BASE's fingerprint when `done` was committed (engine/base_fingerprint.h): a re-run resumes
  // only into the BASE these commits left. Empty in a checkpoint that has none (then the copy
  // starts over).
  std::string base_state;
  // Set once the copy and the switch are done and --delete starts removing these layers (written
  // by this user only: see load_checkpoint), so that a re-run finds what is left to delete even
  // when TOP is already gone.
  std::vector<std::string> deleting;
};

// Where merges into block devices keep their checkpoints: $QCOMMIT_STATE_DIR or /var/lib/qcommit.
[[nodiscard]] std::string state_directory();
// "path dev ino size mtime" of a layer: a layer changed since the checkpoint is another merge.
[[nodiscard]] std::string layer_identity(const std::string& path);
// std::nullopt: none. Checkpoint{"", 0}: one that cannot be read (a torn or planted one: an
// interrupted run of unknown identity). Never follows a symlink nor opens anything but a file.
[[nodiscard]] std::optional<Checkpoint> load_checkpoint(const std::string& path);
// Durable and atomic (fresh O_EXCL|O_NOFOLLOW file, fsync, rename, directory fsync).
void save_checkpoint(const std::string& path, const Checkpoint& cp);
void remove_checkpoint(const std::string& path);
// fsyncs the directory that holds `path`.
void sync_directory_of(const std::string& path);

}  // namespace qcommit::engine
