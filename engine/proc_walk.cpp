// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/proc_walk.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>

namespace qcommit::engine {
namespace {

struct DirCloser {
  void operator()(DIR* d) const { ::closedir(d); }
};
using Dir = std::unique_ptr<DIR, DirCloser>;

// Numeric entries of a /proc directory (PIDs, descriptor numbers).
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

// Calls `visit` with the identity of every file `proc_pid` holds open with `access` until it
// returns true; returns whether it did. Only the descriptors that count are stat'ed, through the
// fd link, which leads to the open file itself whatever its name now.
template <typename Visit>
bool visit_open_files(const std::string& proc_pid, Access access, const ProcSource& src,
                      Visit&& visit) {
  for (const std::string& fd : numeric_entries(proc_pid + "/fd")) {
    if (access == Access::writing && !open_for_writing(proc_pid, fd)) continue;
    if (const auto id = file_id(proc_pid + "/fd/" + fd, src); id && visit(*id)) return true;
  }
  return false;
}

std::string read_name(const std::string& proc_pid) {
  std::ifstream f(proc_pid + "/comm");
  std::string name;
  std::getline(f, name);
  return name;
}

}  // namespace

std::optional<FileId> file_id(const std::string& path, const ProcSource& src) {
  struct statx sx {};
  if (src.statx(AT_FDCWD, path.c_str(), kProcWalkStatxFlags, kProcWalkStatxMask, &sx) != 0)
    return std::nullopt;
  if (S_ISBLK(sx.stx_mode)) return FileId{true, makedev(sx.stx_rdev_major, sx.stx_rdev_minor), 0};
  return FileId{false, makedev(sx.stx_dev_major, sx.stx_dev_minor), static_cast<ino_t>(sx.stx_ino)};
}

std::string process_name(pid_t pid, const ProcSource& src) {
  return read_name(src.root + "/" + std::to_string(pid));
}

std::vector<FileId> open_files(pid_t pid, Access access, const ProcSource& src) {
  std::vector<FileId> out;
  visit_open_files(src.root + "/" + std::to_string(pid), access, src, [&](const FileId& id) {
    out.push_back(id);
    return false;
  });
  return out;
}

std::vector<Holder> holders_of(const std::string& path, Access access,
                               bool (*only)(std::string_view name), const ProcSource& src) {
  std::vector<Holder> out;
  const auto want = file_id(path, src);
  if (!want) return out;
  const std::string self = std::to_string(::getpid());
  for (const std::string& pid : numeric_entries(src.root)) {
    if (pid == self) continue;
    const std::string proc_pid = src.root + "/" + pid;
    std::string name;
    if (only) {
      name = read_name(proc_pid);
      if (!only(name)) continue;
    }
    if (!visit_open_files(proc_pid, access, src, [&](const FileId& id) { return id == *want; }))
      continue;
    if (!only) name = read_name(proc_pid);
    out.push_back({static_cast<pid_t>(std::strtol(pid.c_str(), nullptr, 10)), name});
  }
  return out;
}

std::string describe(const std::vector<Holder>& holders) {
  std::string out;
  for (const Holder& h : holders) {
    if (!out.empty()) out += ", ";
    out += "pid " + std::to_string(h.pid) + " (" + h.name + ")";
  }
  return out;
}

bool runs_qemu(std::string_view name) { return name.starts_with("qemu") || name == "kvm"; }

bool runs_guest(std::string_view name) {
  return runs_qemu(name) && name != "qemu-img" && name != "qemu-io" && name != "qemu-nbd";
}

}  // namespace qcommit::engine
