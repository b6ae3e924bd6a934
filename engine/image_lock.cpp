// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/image_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

namespace qcommit::engine {

namespace {

const char* perm_name(int i) {
  switch (i) {
    case 0: return "consistent read";
    case 1: return "write";
    case 2: return "write unchanged";
    case 3: return "resize";
  }
  return "?";
}

// True when somebody holds a lock on `byte` that conflicts with an exclusive lock.
bool locked_by_other(int fd, uint64_t byte) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = off_t(byte);
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return false;
  return fl.l_type != F_UNLCK;
}

bool lock_shared(int fd, uint64_t byte) {
  struct flock fl {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = off_t(byte);
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

// The first conflict with what others hold ("" for none). Checked after our own bytes are
// taken, as QEMU does (raw_apply_lock_bytes, then raw_check_lock_bytes): of two processes that
// start at once, the one that checks last sees the other's bytes. (Checked before taking, both
// could check, find nothing, then both take.)
std::string first_conflict(int fd, uint32_t perm, uint32_t shared) {
  for (int i = 0; i < 4; ++i) {
    const uint32_t bit = 1u << i;
    if ((perm & bit) && locked_by_other(fd, kLockSharedBase + uint64_t(i)))
      return std::string("another process does not allow ") + perm_name(i);
    if (!(shared & bit) && locked_by_other(fd, kLockPermBase + uint64_t(i)))
      return std::string("another process holds the ") + perm_name(i) + " permission";
  }
  return "";
}

// Takes our bytes: "" when all are ours, a conflict when another process holds one exclusively
// (QEMU never does; another tool may). Throws for any other refusal of the kernel.
std::string take_bytes(const std::string& path, int fd, uint32_t perm, uint32_t shared) {
  for (int i = 0; i < 4; ++i) {
    const uint32_t bit = 1u << i;
    const bool ok = (!(perm & bit) || lock_shared(fd, kLockPermBase + uint64_t(i))) &&
                    ((shared & bit) || lock_shared(fd, kLockSharedBase + uint64_t(i)));
    if (ok) continue;
    const int err = errno;
    if (err == EAGAIN || err == EACCES)
      return "another process holds an exclusive lock on the image";
    throw qcow2::IoError(path, std::string("cannot lock image: ") + std::strerror(err), err);
  }
  return "";
}

// kLockRecheckInterval give or take a quarter, so that two processes that found each other's
// bytes at the same moment do not retry in step until their deadlines.
LockClock::duration recheck_interval() {
  static std::minstd_rand jitter(std::random_device{}());
  const auto base = std::chrono::duration_cast<LockClock::duration>(kLockRecheckInterval);
  std::uniform_int_distribution<LockClock::rep> quarter(-base.count() / 4, base.count() / 4);
  return base + LockClock::duration(quarter(jitter));
}

std::string in_use_message(const std::string& conflict, const std::vector<Holder>& holders) {
  const std::string who = describe(holders);
  return "image is in use: " + conflict + (who.empty() ? "" : " (held by " + who + ")");
}

bool any_guest(const std::vector<Holder>& holders) {
  return std::any_of(holders.begin(), holders.end(),
                     [](const Holder& h) { return runs_guest(h.name); });
}

WaitNotice lock_wait_notice(const std::string& path, LockClock::duration wait,
                            std::vector<Holder> holders, const std::string& conflict) {
  const std::string who = holders.empty() ? "another process" : describe(holders);
  WaitNotice n;
  n.what = WaitFor::kLock;
  n.message = "waiting up to " + wait_duration_text(wait) + " for " + who + " to release " + path +
              " (" + conflict + ")";
  n.timeout = wait;
  n.path = notice_path(path);
  n.holders = std::move(holders);
  n.conflict = conflict;
  return n;
}

}  // namespace

LockClock::time_point deadline_after(LockClock::time_point start, LockClock::duration wait) {
  return wait < LockClock::time_point::max() - start ? start + wait : LockClock::time_point::max();
}

std::string wait_duration_text(LockClock::duration d) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
}

LockClock::time_point LockWaitClock::now() const { return LockClock::now(); }

void LockWaitClock::sleep_for(LockClock::duration d) const { std::this_thread::sleep_for(d); }

ImageInUse::ImageInUse(const std::string& path, const std::string& conflict,
                       std::vector<Holder> holders)
    : qcow2::Error(path, in_use_message(conflict, holders)), holders_(std::move(holders)) {}

bool ImageInUse::held_by_guest() const { return any_guest(holders_); }

std::vector<Holder> wait_until_closed(const std::string& path, LockClock::duration wait,
                                      const LockWaitNotice& on_wait, const LockWaitClock& clock) {
  const LockClock::time_point start = clock.now();
  const LockClock::time_point deadline = deadline_after(start, wait);
  bool told = false;
  for (;;) {
    std::vector<Holder> holders = holders_of(path, Access::any);
    const LockClock::time_point now = clock.now();
    if (holders.empty() || now >= deadline || any_guest(holders)) return holders;
    if (!told && on_wait) {
      WaitNotice n;
      n.what = WaitFor::kClose;
      n.message = "waiting up to " + wait_duration_text(wait) + " for " + describe(holders) +
                  " to close " + path + " before deleting it";
      n.timeout = wait;
      n.path = notice_path(path);
      n.holders = holders;
      on_wait(n);
    }
    told = true;
    clock.sleep_for(std::min<LockClock::duration>(kLockRecheckInterval, deadline - now));
  }
}

std::string describe_holders(const std::string& path) {
  return describe(holders_of(path, Access::any));
}

ImageLock::ImageLock(const std::string& path, uint32_t perm, uint32_t shared)
    : ImageLock(acquire(path, perm, shared, LockClock::duration::zero(), nullptr)) {}

ImageLock ImageLock::acquire(const std::string& path, uint32_t perm, uint32_t shared,
                             LockClock::duration wait, const LockWaitNotice& on_wait,
                             const LockWaitClock& clock,
                             const std::function<void()>& between_take_and_check) {
  const LockClock::time_point start = clock.now();
  const LockClock::time_point deadline = deadline_after(start, wait);
  bool waiting = false;
  LockClock::time_point next_holders_walk{};
  for (;;) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid())
      throw qcow2::IoError(path, std::string("cannot open: ") + std::strerror(errno), errno);
    // A look first, taking nothing: while the image is held, a retry must not take our bytes
    // even for a moment (a QEMU starting then would find them and fail for good: it does not
    // retry). Only when it looks free are our bytes taken and the look repeated.
    std::string conflict = first_conflict(fd.get(), perm, shared);
    if (conflict.empty()) conflict = take_bytes(path, fd.get(), perm, shared);
    if (conflict.empty()) {
      if (between_take_and_check) between_take_and_check();
      conflict = first_conflict(fd.get(), perm, shared);
      if (conflict.empty()) return ImageLock(path, std::move(fd));
    }
    fd.reset();  // our bytes go with it: nothing of ours stays while others are waited for
    const LockClock::time_point now = clock.now();
    if (!waiting || now >= deadline) {
      // The first refusal, or the one at the deadline: named with who holds the image now.
      std::vector<Holder> holders = holders_of(path, Access::any);
      if (wait <= LockClock::duration::zero() || now >= deadline || any_guest(holders))
        throw ImageInUse(path, conflict, std::move(holders));
      if (on_wait) on_wait(lock_wait_notice(path, wait, std::move(holders), conflict));
      waiting = true;
      next_holders_walk = now + kLockHoldersRecheckInterval;
    } else if (now >= next_holders_walk) {
      // A guest started during the wait: no reason to wait for it any longer.
      std::vector<Holder> holders = holders_of(path, Access::any);
      if (any_guest(holders)) throw ImageInUse(path, conflict, std::move(holders));
      next_holders_walk = now + kLockHoldersRecheckInterval;
    }
    clock.sleep_for(std::min<LockClock::duration>(recheck_interval(), deadline - now));
  }
}

}  // namespace qcommit::engine
