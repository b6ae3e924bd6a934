// SPDX-License-Identifier: GPL-2.0-or-later
// The byte-range locks QEMU takes on image files (OFD locks on bytes 100+perm and 200+perm), so
// that a running QEMU and qcommit refuse each other instead of corrupting an image.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/proc_walk.h"
#include "engine/wait_notice.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

// QEMU's permission bits (block/block-common.h) and lock byte bases (block/file-posix.c).
inline constexpr uint32_t kPermConsistentRead = 0x01;
inline constexpr uint32_t kPermWrite = 0x02;
inline constexpr uint32_t kPermWriteUnchanged = 0x04;
inline constexpr uint32_t kPermResize = 0x08;
inline constexpr uint32_t kPermAll = 0x0f;
inline constexpr uint64_t kLockPermBase = 100;
inline constexpr uint64_t kLockSharedBase = 200;

// A waiting acquisition tries again this often, so it starts soon after the holder lets go.
inline constexpr std::chrono::milliseconds kLockRecheckInterval{20};
// ... and looks again this often for who holds the image (a walk over all of /proc), so that a
// guest started during the wait is refused then rather than at the deadline.
inline constexpr std::chrono::milliseconds kLockHoldersRecheckInterval{1000};

using LockClock = std::chrono::steady_clock;

// Time for waiting acquisitions: the real clock unless a test gives its own.
class LockWaitClock {
 public:
  virtual ~LockWaitClock() = default;
  [[nodiscard]] virtual LockClock::time_point now() const;
  virtual void sleep_for(LockClock::duration d) const;
};

// The image is locked by another process: "image is in use: <conflict> (held by pid N (name))".
// Every process that has the file open is named, since OFD locks do not say whose they are.
class ImageInUse : public qcow2::Error {
 public:
  ImageInUse(const std::string& path, const std::string& conflict, std::vector<Holder> holders);
  [[nodiscard]] const std::vector<Holder>& holders() const { return holders_; }
  // Whether one of them is a QEMU running a guest (runs_guest): such a holder is not waited for.
  [[nodiscard]] bool held_by_guest() const;

 private:
  std::vector<Holder> holders_;
};

// Holds QEMU-compatible locks on one file for its lifetime (RAII). Throws ImageInUse (a
// qcow2::Error) naming the file and, where it can be found, the process that holds the
// conflicting lock; qcow2::IoError when the file cannot be opened or locked.
class ImageLock {
 public:
  // perm: what we do with the file; shared: what we allow others to do. Refuses at once.
  ImageLock(const std::string& path, uint32_t perm, uint32_t shared);
  ImageLock(ImageLock&&) noexcept = default;
  ImageLock& operator=(ImageLock&&) noexcept = default;

  // Like the constructor, but while another process holds a conflicting lock, tries again every
  // kLockRecheckInterval until `wait` has passed, then throws ImageInUse naming the holders then.
  // `on_wait` (may be empty) is called once, when the first try fails, with a WaitFor::kLock
  // notice ("waiting up to 30 s for pid 5087 (qemu-io) to release base.qcow2 (another process
  // holds the consistent read permission)", the holders, the conflict). A QEMU running a guest
  // among the holders is refused at once (ImageInUse::held_by_guest), also when it appears during
  // the wait; holders this process cannot see (another PID namespace, another host) are waited
  // for like any other. wait <= 0: the constructor's behaviour exactly.
  // Each try takes our bytes first and then looks for conflicting ones, as QEMU does, so that of
  // two processes starting at once at least one sees the other. `between_take_and_check` (tests)
  // runs in that window.
  [[nodiscard]] static ImageLock acquire(const std::string& path, uint32_t perm, uint32_t shared,
                                         LockClock::duration wait, const LockWaitNotice& on_wait,
                                         const LockWaitClock& clock = LockWaitClock{},
                                         const std::function<void()>& between_take_and_check = {});

  // Reading an image while nobody changes it.
  static constexpr uint32_t kReaderPerm = kPermConsistentRead;
  static constexpr uint32_t kReaderShared = kPermConsistentRead | kPermWriteUnchanged;
  // Writing an image exclusively (others may not even read it consistently while we change it).
  static constexpr uint32_t kWriterPerm = kPermConsistentRead | kPermWrite | kPermResize;
  static constexpr uint32_t kWriterShared = kPermWriteUnchanged;

  [[nodiscard]] static ImageLock reader(const std::string& path) {
    return ImageLock(path, kReaderPerm, kReaderShared);
  }
  [[nodiscard]] static ImageLock writer(const std::string& path) {
    return ImageLock(path, kWriterPerm, kWriterShared);
  }
  [[nodiscard]] static ImageLock reader(const std::string& path, LockClock::duration wait,
                                        const LockWaitNotice& on_wait) {
    return acquire(path, kReaderPerm, kReaderShared, wait, on_wait);
  }
  [[nodiscard]] static ImageLock writer(const std::string& path, LockClock::duration wait,
                                        const LockWaitNotice& on_wait) {
    return acquire(path, kWriterPerm, kWriterShared, wait, on_wait);
  }

 private:
  ImageLock(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}

  std::string path_;
  UniqueFd fd_;  // closing the open file description drops its OFD locks
};

// Waits until no other process has `path` open (a monitoring agent's qemu-img info closes it in
// milliseconds), looking every kLockRecheckInterval for up to `wait`; `on_wait` (may be empty) is
// told once, when the first look finds a holder (a WaitFor::kClose notice). Returns the holders left: none once the file is
// closed; those of the last look at the deadline; at once, those of a look that finds a QEMU
// running a guest (no transient holder).
[[nodiscard]] std::vector<Holder> wait_until_closed(const std::string& path,
                                                    LockClock::duration wait,
                                                    const LockWaitNotice& on_wait,
                                                    const LockWaitClock& clock = LockWaitClock{});

// `start` + `wait`, or the end of time when that does not fit.
[[nodiscard]] LockClock::time_point deadline_after(LockClock::time_point start,
                                                   LockClock::duration wait);

// A wait's length in messages: "10 s", or "1500 ms" when not whole seconds.
[[nodiscard]] std::string wait_duration_text(LockClock::duration d);

// "pid 1234 (qemu-system-x86)" for every process that has `path` open, or "" if none is found.
[[nodiscard]] std::string describe_holders(const std::string& path);

}  // namespace qcommit::engine
