#include "plugin/overlay_file.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

extern char** environ;

namespace qcommit::plugin {

// A guest's first write into a cluster of the fresh overlay allocates it: cluster write,
// refcount block write, flush, L2 write, flush -- each of them may wait behind a commit chunk of
// the merge (lab, cache=none: ~10 ms each).  With lazy refcounts the refcount write and its
// flush go (the refcounts are rebuilt from the L2 tables if QEMU dies; the overlay is committed
// and dropped at the end anyway).  -u: the backing file is the running guest's active layer,
// which qemu-img must not open.
std::string create_fresh_overlay(const std::string& path, const std::string& backing,
                                      const std::string& backing_format, std::uint64_t size) {
  std::vector<std::string> args = {"qemu-img", "create", "-q", "-f", "qcow2", "-u",
                                   "-b", backing, "-F", backing_format,
                                   "-o", "lazy_refcounts=on,cluster_size=64k", path,
                                   std::to_string(size)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    return std::string("cannot run qemu-img: ") + std::strerror(rc);
  }
  std::string err_text;
  char buf[512];
  for (;;) {
    const ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n > 0) {
      if (err_text.size() < 4096) err_text.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(pipefd[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  ::unlink(path.c_str());
  while (!err_text.empty() && (err_text.back() == '\n' || err_text.back() == ' ')) err_text.pop_back();
  return err_text.empty() ? "qemu-img create failed" : err_text;
}

}  // namespace qcommit::plugin
