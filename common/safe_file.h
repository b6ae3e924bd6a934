// SPDX-License-Identifier: GPL-2.0-or-later
// Every file qcommit and qcommitd create or open for writing, other than the images of the chain
// they were given, goes through here. Whoever can write in a directory next to an image (another
// tenant, a guest's owner) can plant a symlink, a FIFO or a hard link at a name the program is
// about to use; run as root, following it would overwrite any file: another VM's disk, an LV.
//
// - A file of our own (a probe's or a measurement's scratch file, a checkpoint's next version, a
//   fresh overlay) is created, never opened: O_CREAT|O_EXCL|O_NOFOLLOW, so that anything already
//   at the name, a dangling symlink included, makes the creation fail instead of being followed.
//   Scratch files have no name at all where the filesystem allows it (O_TMPFILE), else an
//   unpredictable one that is unlinked at once.
// - An output the user named (a trace, a report) may exist: it is opened without following a
//   symlink and without blocking on a FIFO, and written only if it is a regular file with one
//   link that belongs to the user running the program.
//
// No dependencies beyond libc: every layer may use it. Results carry the problem as text and the
// errno; the caller words the error with the file's name.
#pragma once

#include <string>

#include "common/unique_fd.h"

namespace qcommit::safe_file {

struct Opened {
  UniqueFd fd;
  std::string name;     // the name created or opened ("" for an unnamed scratch file)
  std::string problem;  // empty on success
  int err = 0;          // errno of the failure, 0 on success
  bool direct = false;  // opened with O_DIRECT (asked for and taken)

  [[nodiscard]] bool ok() const { return fd.valid(); }
};

// Creates `path`, which must not exist (not even as a symlink), mode `mode` (less the umask),
// opened O_RDWR plus `flags` (e.g. O_APPEND). With `direct`, O_DIRECT where the filesystem takes
// it (Opened::direct says whether it did).
[[nodiscard]] Opened create_new(const std::string& path, int flags = 0, unsigned mode = 0600,
                                bool direct = false);

// A scratch file in directory `dir` that nothing can be planted at: unnamed (O_TMPFILE) where
// the filesystem allows it, else created as `dir`/`prefix`<random> with create_new and unlinked
// at once. Read-write, mode 0600, O_DIRECT where asked for and possible.
[[nodiscard]] Opened create_scratch(const std::string& dir, const std::string& prefix,
                                    bool direct = false);

enum class OutputMode { kTruncate, kAppend };

// An output file the user named: created (mode 0644 less the umask) when absent; else opened
// only if it is a regular file, not a symlink, with one link, owned by the effective user; then
// truncated (kTruncate) or written at its end (kAppend). Never blocks on a FIFO.
[[nodiscard]] Opened open_output(const std::string& path, OutputMode mode = OutputMode::kTruncate);

// Removes `path` only if it still names the file open as `fd` (a name swapped since is left
// alone). Returns false when it did not remove it.
bool remove_if_same(const std::string& path, int fd);

}  // namespace qcommit::safe_file
