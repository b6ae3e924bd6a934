// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string_view>

#include "engine/merge.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"

namespace qcommit::engine {

namespace fs = std::filesystem;
using qcow2::IoError;

namespace {
inline constexpr const char* kCheckpointMagic = "qcommit-merge-checkpoint v1";
inline constexpr off_t kMaxCheckpointBytes = 64 << 10;
inline constexpr const char* kCheckpointDeleting = "deleting";
inline constexpr std::string_view kCheckpointBaseState = "base ";
}  // namespace

// Where merges into block devices keep their checkpoints (a file BASE keeps its own beside it).
inline constexpr const char* kDefaultStateDirectory = "/var/lib/qcommit";


std::string state_directory() {
  const char* env = std::getenv("QCOMMIT_STATE_DIR");
  return env && *env ? env : kDefaultStateDirectory;
}



std::string layer_identity(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return path;
  std::ostringstream o;
  o << fs::weakly_canonical(path).string() << ' ' << st.st_dev << ' ' << st.st_ino << ' ' << st.st_size
    << ' ' << st.st_mtim.tv_sec << '.' << st.st_mtim.tv_nsec;
  return o.str();
}

// Opens the checkpoint without following a symlink planted in its place, and only if it is a
// regular file (a FIFO would block, a device would be read).
std::optional<Checkpoint> load_checkpoint(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return std::nullopt;
    return Checkpoint{};  // a symlink or unreadable: an interrupted run of unknown identity
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > kMaxCheckpointBytes)
    return Checkpoint{};
  const bool ours = st.st_uid == ::geteuid() && (st.st_mode & 077) == 0;
  std::string text(size_t(st.st_size), '\0');
  if (::pread(fd.get(), text.data(), text.size(), 0) != ssize_t(text.size())) return Checkpoint{};
  std::istringstream in(text);
  std::string magic, identity, done;
  std::getline(in, magic);
  std::getline(in, identity);
  std::getline(in, done);
  uint64_t n = 0;
  const auto [end, ec] = std::from_chars(done.data(), done.data() + done.size(), n);
  if (magic != kCheckpointMagic || done.empty() || ec != std::errc() || end != done.data() + done.size())
    return Checkpoint{};  // unreadable: restart (leaks are repaired)
  Checkpoint cp{identity, n, {}, {}};
  std::string line;
  if (std::getline(in, line) && line.starts_with(kCheckpointBaseState)) {
    cp.base_state = line.substr(kCheckpointBaseState.size());
    if (!std::getline(in, line)) line.clear();
  }
  if (ours && line == kCheckpointDeleting)
    while (std::getline(in, line))
      if (!line.empty()) cp.deleting.push_back(line);
  return cp;
}

void sync_directory_of(const std::string& path) {
  fs::path dir_path = fs::path(path).parent_path();
  if (dir_path.empty()) dir_path = ".";
  UniqueFd dir(::open(dir_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0 || ::fsync(dir.get()) != 0)
    throw IoError(dir_path.string(), std::string("cannot sync directory: ") + strerror(errno), errno);
}

// Each version is written to a fresh temporary file (O_EXCL|O_NOFOLLOW: a symlink planted at
// its name makes the merge fail instead of overwriting what it points to), forced to disk, then
// renamed over the old one and the directory forced too: after a power loss the checkpoint reads
// back as the old or the new version, never empty. Each version is written after the window it
// names was committed, so it never claims data that is not durable.
void save_checkpoint(const std::string& path, const Checkpoint& cp) {
  const std::string tmp = path + ".tmp";
  if (fs::path(path).parent_path() == fs::path(state_directory()) && ::mkdir(state_directory().c_str(), 0700) != 0 &&
      errno != EEXIST)
    throw IoError(state_directory(), std::string("cannot create state directory: ") + strerror(errno), errno);
  auto fail = [](const std::string& file) {
    throw IoError(file, std::string("cannot write checkpoint: ") + strerror(errno), errno);
  };
  if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) fail(tmp);
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (fd.get() < 0) fail(tmp);
    std::string s = std::string(kCheckpointMagic) + "\n" + cp.identity + "\n" + std::to_string(cp.done) + "\n";
    if (!cp.base_state.empty()) s += std::string(kCheckpointBaseState) + cp.base_state + "\n";
    if (!cp.deleting.empty()) {
      s += std::string(kCheckpointDeleting) + "\n";
      for (const auto& p : cp.deleting) s += p + "\n";
    }
    if (::write(fd.get(), s.data(), s.size()) != ssize_t(s.size()) || ::fsync(fd.get()) != 0) fail(tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(path);
  sync_directory_of(path);
}

// The merge is finished: the checkpoint goes, durably (a stale one would make the next merge into
// BASE repair leaks for nothing, never more).
void remove_checkpoint(const std::string& path) {
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return;
    throw IoError(path, std::string("cannot remove checkpoint: ") + strerror(errno), errno);
  }
  sync_directory_of(path);
}

std::string checkpoint_path(const std::string& base) {
  fs::path p(base);
  struct stat st {};
  if (::stat(base.c_str(), &st) == 0 && S_ISBLK(st.st_mode)) {
    // /dev is a tmpfs that a reboot empties: a block device's checkpoint lives in the state
    // directory, named by the path the merge was given ("/dev/vg/lv" -> "dev%2fvg%2flv").
    std::string name;
    for (char c : fs::absolute(p).string().substr(1)) name += c == '/' ? "%2f" : c == '%' ? "%25" : std::string(1, c);
    return (fs::path(state_directory()) / (name + ".qcommit-merge")).string();
  }
  return (p.parent_path() / ("." + p.filename().string() + ".qcommit-merge")).string();
}

}  // namespace qcommit::engine
