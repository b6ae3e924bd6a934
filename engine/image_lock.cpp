#include "engine/image_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/proc_walk.h"
#include "qcow2/error.h"

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

}  // namespace

std::string describe_holders(const std::string& path) {
  return describe(holders_of(path, Access::any));
}

ImageLock::ImageLock(const std::string& path, uint32_t perm, uint32_t shared) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw qcow2::IoError(path, std::string("cannot open: ") + std::strerror(errno), errno);
  // Check first, as QEMU does, then take our bytes; a race between the two is caught by the
  // other side's check.
  for (int i = 0; i < 4; ++i) {
    const uint32_t bit = 1u << i;
    std::string conflict;
    if ((perm & bit) && locked_by_other(fd_, kLockSharedBase + uint64_t(i)))
      conflict = std::string("another process does not allow ") + perm_name(i);
    else if (!(shared & bit) && locked_by_other(fd_, kLockPermBase + uint64_t(i)))
      conflict = std::string("another process holds the ") + perm_name(i) + " permission";
    if (!conflict.empty()) {
      ::close(fd_);
      fd_ = -1;
      std::string who = describe_holders(path);
      throw qcow2::Error(path, "image is in use: " + conflict + (who.empty() ? "" : " (held by " + who + ")"));
    }
  }
  for (int i = 0; i < 4; ++i) {
    const uint32_t bit = 1u << i;
    bool ok = true;
    if (perm & bit) ok = lock_shared(fd_, kLockPermBase + uint64_t(i));
    if (ok && !(shared & bit)) ok = lock_shared(fd_, kLockSharedBase + uint64_t(i));
    if (!ok) {
      int err = errno;
      ::close(fd_);
      fd_ = -1;
      throw qcow2::IoError(path, std::string("cannot lock image: ") + std::strerror(err), err);
    }
  }
}

ImageLock::~ImageLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the open file description drops its OFD locks
}

}  // namespace qcommit::engine
