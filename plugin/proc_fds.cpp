#include "plugin/proc_fds.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

namespace qcommit::plugin {
namespace {

// A file's identity: device and inode, or for a block device the device it is (QEMU runs in a
// mount namespace of its own where /dev nodes are other inodes).
struct FileId {
  bool block = false;
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

// AT_STATX_DONT_SYNC: cached attributes will do (no round trip to an NFS or FUSE server, which
// may hang).
std::optional<FileId> file_id(const std::string& path) {
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), AT_STATX_DONT_SYNC, STATX_TYPE | STATX_INO, &sx) != 0)
    return std::nullopt;
  if (S_ISBLK(sx.stx_mode)) return FileId{true, makedev(sx.stx_rdev_major, sx.stx_rdev_minor), 0};
  return FileId{false, makedev(sx.stx_dev_major, sx.stx_dev_minor), static_cast<ino_t>(sx.stx_ino)};
}

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};
using Dir = std::unique_ptr<DIR, DirCloser>;

// Numeric entries of a /proc directory (PIDs, fd numbers).
std::vector<std::string> numeric_entries(const std::string& dir) {
  std::vector<std::string> out;
  Dir d(::opendir(dir.c_str()));
  if (!d) return out;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos)
      out.push_back(name);
  }
  return out;
}

// Whether the descriptor was opened for writing (the "flags:" line of fdinfo is octal).
bool open_for_writing(const std::string& proc_pid, const std::string& fd) {
  std::ifstream f(proc_pid + "/fdinfo/" + fd);
  std::string key;
  while (f >> key) {
    if (key == "flags:") {
      std::string octal;
      f >> octal;
      const unsigned long flags = std::strtoul(octal.c_str(), nullptr, 8);
      return (flags & O_ACCMODE) == O_WRONLY || (flags & O_ACCMODE) == O_RDWR;
    }
    std::string rest;
    std::getline(f, rest);
  }
  return false;
}

// The files `proc_pid` holds open for writing (only those are stat'ed).
std::vector<FileId> written_files(const std::string& proc_pid) {
  std::vector<FileId> out;
  for (const std::string& fd : numeric_entries(proc_pid + "/fd")) {
    if (!open_for_writing(proc_pid, fd)) continue;
    // The fd link leads to the open file itself, whatever its name now.
    if (const auto id = file_id(proc_pid + "/fd/" + fd)) out.push_back(*id);
  }
  return out;
}

// QEMU by its command name: qemu-system-*, or kvm (Proxmox).  Other holders of an image open
// for writing (virtlockd, backup tools) are not the guest's.
bool runs_qemu(const std::string& proc_pid) {
  std::ifstream f(proc_pid + "/comm");
  std::string comm;
  std::getline(f, comm);
  return comm.rfind("qemu", 0) == 0 || comm == "kvm";
}

}  // namespace

std::optional<pid_t> writer_of(const std::string& path, const std::string& proc) {
  const auto want = file_id(path);
  if (!want) return std::nullopt;
  const std::string self = std::to_string(::getpid());
  for (const std::string& pid : numeric_entries(proc)) {
    if (pid == self || !runs_qemu(proc + "/" + pid)) continue;
    for (const FileId& id : written_files(proc + "/" + pid))
      if (id == *want) return static_cast<pid_t>(std::stol(pid));
  }
  return std::nullopt;
}

std::optional<std::string> lowest_written(pid_t pid, const std::vector<std::string>& chain,
                                          const std::string& proc) {
  const std::vector<FileId> written = written_files(proc + "/" + std::to_string(pid));
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    const auto id = file_id(*it);
    if (!id) continue;
    for (const FileId& w : written)
      if (w == *id) return *it;
  }
  return std::nullopt;
}

std::optional<std::string> commit_base_in_use(const std::string& active,
                                              const std::vector<std::string>& chain) {
  const auto pid = writer_of(active);
  if (!pid) return std::nullopt;
  return lowest_written(*pid, chain);
}

}  // namespace qcommit::plugin
