#include "plugin/proc_fds.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

namespace qcommit::plugin {
namespace {

struct FileId {
  dev_t dev;
  ino_t ino;
  bool operator==(const FileId&) const = default;
};

std::optional<FileId> file_id(const std::string& path) {
  struct stat sb {};
  if (::stat(path.c_str(), &sb) != 0) return std::nullopt;
  return FileId{sb.st_dev, sb.st_ino};
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

// The files `proc_pid` holds open for writing.
std::vector<FileId> written_files(const std::string& proc_pid) {
  std::vector<FileId> out;
  for (const std::string& fd : numeric_entries(proc_pid + "/fd")) {
    // stat follows the fd link to the open file itself, whatever its name now.
    const auto id = file_id(proc_pid + "/fd/" + fd);
    if (id && open_for_writing(proc_pid, fd)) out.push_back(*id);
  }
  return out;
}

}  // namespace

std::optional<pid_t> writer_of(const std::string& path, const std::string& proc) {
  const auto want = file_id(path);
  if (!want) return std::nullopt;
  const std::string self = std::to_string(::getpid());
  for (const std::string& pid : numeric_entries(proc)) {
    if (pid == self) continue;
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
