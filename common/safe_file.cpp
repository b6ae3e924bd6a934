// SPDX-License-Identifier: GPL-2.0-or-later
#include "common/safe_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace qcommit::safe_file {

namespace {

// Random bytes in a scratch file's name: 64 bits, so that no name can be guessed and planted.
constexpr size_t kNameRandomBytes = 8;
// Names tried before a scratch file's creation gives up (each collision is a planted file).
constexpr int kScratchAttempts = 4;

Opened failure(std::string name, std::string problem, int err) {
  Opened o;
  o.name = std::move(name);
  o.problem = std::move(problem) + ": " + std::strerror(err);
  o.err = err;
  return o;
}

Opened refusal(std::string name, std::string problem) {
  Opened o;
  o.name = std::move(name);
  o.problem = std::move(problem);
  o.err = EPERM;
  return o;
}

// O_DIRECT on a descriptor already open (fcntl F_SETFL), where the filesystem takes it.
bool set_direct(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && ::fcntl(fd, F_SETFL, fl | O_DIRECT) == 0;
}

std::string random_suffix() {
  unsigned char bytes[kNameRandomBytes] = {};
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  std::string s;
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof hex, "%02x", b);
    s += hex;
  }
  return s;
}

// O_TMPFILE is refused this way where the filesystem (NFS, FUSE, older kernels) has no unnamed
// files.
bool no_tmpfile(int err) { return err == EOPNOTSUPP || err == EISDIR || err == EINVAL; }

}  // namespace

Opened create_new(const std::string& path, int flags, unsigned mode, bool direct) {
  Opened o;
  o.name = path;
  o.fd.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | flags, mode));
  if (!o.fd.valid()) {
    const int err = errno;
    if (err == EEXIST) return failure(path, "something is already at this name; refusing to use it", err);
    return failure(path, "cannot create", err);
  }
  o.direct = direct && set_direct(o.fd.get());
  return o;
}

Opened create_scratch(const std::string& dir, const std::string& prefix, bool direct) {
  Opened o;
  o.fd.reset(::open(dir.c_str(), O_RDWR | O_TMPFILE | O_EXCL | O_CLOEXEC, 0600));
  if (o.fd.valid()) {
    o.direct = direct && set_direct(o.fd.get());
    return o;
  }
  if (!no_tmpfile(errno)) return failure(dir, "cannot create a scratch file in this directory", errno);
  Opened last;
  for (int attempt = 0; attempt < kScratchAttempts; ++attempt) {
    last = create_new(dir + "/" + prefix + random_suffix(), 0, 0600, direct);
    if (last.ok()) {
      (void)::unlink(last.name.c_str());  // ours: created with O_EXCL an instant ago
      return last;
    }
    if (last.err != EEXIST) break;
  }
  return last;
}

Opened open_output(const std::string& path, OutputMode mode) {
  const int append = mode == OutputMode::kAppend ? O_APPEND : 0;
  Opened o;
  o.name = path;
  o.fd.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | append, 0644));
  if (!o.fd.valid()) {
    const int err = errno;
    if (err == ELOOP) return refusal(path, "is a symbolic link; refusing to write through it");
    if (err == ENXIO) return refusal(path, "is not a regular file (a FIFO); refusing to write to it");
    return failure(path, "cannot open for writing", err);
  }
  struct stat st {};
  if (::fstat(o.fd.get(), &st) != 0) return failure(path, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) return refusal(path, "is not a regular file; refusing to write to it");
  if (st.st_nlink != 1)
    return refusal(path, "has " + std::to_string(st.st_nlink) + " hard links; refusing to write to it");
  if (st.st_uid != ::geteuid())
    return refusal(path, "belongs to another user (uid " + std::to_string(st.st_uid) +
                             "); refusing to write to it");
  const int fl = ::fcntl(o.fd.get(), F_GETFL);
  if (fl < 0 || ::fcntl(o.fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0) return failure(path, "fcntl", errno);
  if (mode == OutputMode::kTruncate && ::ftruncate(o.fd.get(), 0) != 0) return failure(path, "cannot truncate", errno);
  return o;
}

bool remove_if_same(const std::string& path, int fd) {
  struct stat named {}, open_file {};
  if (::lstat(path.c_str(), &named) != 0 || ::fstat(fd, &open_file) != 0) return false;
  if (named.st_dev != open_file.st_dev || named.st_ino != open_file.st_ino) return false;
  return ::unlink(path.c_str()) == 0;
}

}  // namespace qcommit::safe_file
