// SPDX-License-Identifier: GPL-2.0-or-later
// The /proc walker (engine/proc_walk.h) against real processes holding real files: identity
// rather than names, access modes from fdinfo, command-name filters, block devices by the device
// they are (a loop device reached through a second node), and a walk that does not hang when a
// process holds a file on a FUSE mount whose server is stopped.
#include "engine/proc_walk.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/image_lock.h"

namespace qcommit::test {
namespace {

namespace fs = std::filesystem;
using namespace engine;

constexpr int kStartPolls = 500;
constexpr useconds_t kStartPollUs = 10'000;

// A scratch directory, removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/qcommit-procwalk-XXXXXX";
    REQUIRE(::mkdtemp(tmpl));
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  [[nodiscard]] std::string operator/(const std::string& name) const { return path + "/" + name; }
};

void touch(const std::string& path) {
  std::ofstream f(path);
  REQUIRE(f);
}

// A child running `script` under sh with $1 = `arg`; its standard descriptors are /dev/null
// opened read-only and it inherits no others, so that the only descriptors it holds for writing
// are the script's.
// Returns once the script has exec'ed a program named `name`.
pid_t spawn(const std::string& script, const std::string& arg, const std::string& name) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const int null = ::open("/dev/null", O_RDONLY);
    for (int fd = 0; fd <= 2; ++fd) ::dup2(null, fd);
    ::close_range(3, ~0U, 0);
    ::execl("/bin/sh", "sh", "-c", script.c_str(), "sh", arg.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < kStartPolls && process_name(child) != name; ++i) ::usleep(kStartPollUs);
  REQUIRE(process_name(child) == name);
  return child;
}

void stop(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

std::vector<pid_t> pids(const std::vector<Holder>& holders) {
  std::vector<pid_t> out;
  for (const Holder& h : holders) out.push_back(h.pid);
  std::sort(out.begin(), out.end());
  return out;
}

bool is_holder_fake(std::string_view name) { return name == "holder-fake"; }

// Every statx the walk makes, recorded (the seam in ProcSource).
struct StatxCall {
  std::string path;
  int flags = 0;
  unsigned int mask = 0;
};
std::vector<StatxCall> g_statx_calls;
int recording_statx(int dirfd, const char* path, int flags, unsigned int mask, struct statx* out) {
  g_statx_calls.push_back({path, flags, mask});
  return ::statx(dirfd, path, flags, mask, out);
}

}  // namespace

TEST_CASE("engine.proc_walk.holders") {
  // qemu-fake holds `image` read-write and `shared` read-only; holder-fake holds `shared`
  // read-only and `renamed` (renamed after it was opened). This process holds `image` too.
  TempDir d;
  for (const char* n : {"image", "shared", "before"}) touch(d / n);
  REQUIRE(::symlink((d / "image").c_str(), (d / "image-link").c_str()) == 0);
  REQUIRE(::symlink("/bin/sleep", (d / "qemu-fake").c_str()) == 0);
  REQUIRE(::symlink("/bin/sleep", (d / "holder-fake").c_str()) == 0);
  const pid_t qemu = spawn("exec 3<>\"$1/image\" 4<\"$1/shared\"; exec \"$1/qemu-fake\" 30", d.path,
                           "qemu-fake");
  const pid_t other = spawn("exec 3<\"$1/shared\" 4<\"$1/before\"; exec \"$1/holder-fake\" 30",
                            d.path, "holder-fake");
  const int own = ::open((d / "image").c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(own >= 0);
  REQUIRE(::rename((d / "before").c_str(), (d / "renamed").c_str()) == 0);

  const auto image = holders_of(d / "image", Access::any);
  REQUIRE(image.size() == 1);  // not this process
  CHECK(image[0].pid == qemu);
  CHECK(image[0].name == "qemu-fake");
  CHECK(pids(holders_of(d / "image-link", Access::any)) == std::vector<pid_t>{qemu});
  CHECK(pids(holders_of(d / "image", Access::writing)) == std::vector<pid_t>{qemu});
  CHECK(pids(holders_of(d / "image", Access::writing, runs_qemu)) == std::vector<pid_t>{qemu});
  CHECK(holders_of(d / "image", Access::any, is_holder_fake).empty());
  CHECK(pids(holders_of(d / "shared", Access::any)) == std::vector<pid_t>{std::min(qemu, other), std::max(qemu, other)});
  CHECK(holders_of(d / "shared", Access::writing).empty());
  CHECK(pids(holders_of(d / "shared", Access::any, is_holder_fake)) == std::vector<pid_t>{other});
  CHECK(pids(holders_of(d / "renamed", Access::any)) == std::vector<pid_t>{other});
  CHECK(holders_of(d / "nonexistent", Access::any).empty());
  CHECK(describe_holders(d / "image") == "pid " + std::to_string(qemu) + " (qemu-fake)");

  const auto written = open_files(qemu, Access::writing);
  REQUIRE(written.size() == 1);
  CHECK(written[0] == file_id(d / "image"));
  CHECK(open_files(qemu, Access::any).size() >= 5);  // 0-2, image, shared
  CHECK(process_name(qemu) == "qemu-fake");

  CHECK(runs_qemu("qemu-system-x86"));
  CHECK(runs_qemu("qemu-io"));
  CHECK(runs_qemu("kvm"));
  CHECK_FALSE(runs_qemu("virtlockd"));
  CHECK(runs_guest("qemu-system-x86"));
  CHECK(runs_guest("qemu-kvm"));
  CHECK(runs_guest("kvm"));
  CHECK_FALSE(runs_guest("qemu-io"));
  CHECK_FALSE(runs_guest("qemu-img"));
  CHECK_FALSE(runs_guest("qemu-nbd"));
  CHECK_FALSE(runs_guest("sleep"));

  stop(qemu);
  stop(other);
  ::close(own);
  CHECK(holders_of(d / "image", Access::any).empty());
  CHECK(describe_holders(d / "image").empty());
}

TEST_CASE("engine.proc_walk.statx_dont_sync") {
  // Every attribute read asks for cached attributes only (AT_STATX_DONT_SYNC) and for nothing
  // that would make an NFS client flush first (size, times); with Access::writing only the
  // descriptors open for writing are stat'ed.
  TempDir d;
  for (const char* n : {"image", "a", "b", "c"}) touch(d / n);
  REQUIRE(::symlink("/bin/sleep", (d / "qemu-fake").c_str()) == 0);
  const pid_t qemu = spawn("exec 3<\"$1/a\" 4<\"$1/b\" 5<\"$1/c\" 6<>\"$1/image\"; exec \"$1/qemu-fake\" 30",
                           d.path, "qemu-fake");
  const ProcSource src{"/proc", recording_statx};

  g_statx_calls.clear();
  const auto written = open_files(qemu, Access::writing, src);
  CHECK(written.size() == 1);
  REQUIRE(g_statx_calls.size() == 1);  // fd 6 only: fdinfo is read first
  CHECK(g_statx_calls[0].path == "/proc/" + std::to_string(qemu) + "/fd/6");

  g_statx_calls.clear();
  CHECK(pids(holders_of(d / "image", Access::any, nullptr, src)) == std::vector<pid_t>{qemu});
  CHECK(pids(holders_of(d / "image", Access::writing, runs_qemu, src)) == std::vector<pid_t>{qemu});
  CHECK(g_statx_calls.size() > 2);
  size_t may_sync = 0, asks_more = 0;
  for (const StatxCall& c : g_statx_calls) {
    if ((c.flags & AT_STATX_DONT_SYNC) == 0 || (c.flags & AT_STATX_FORCE_SYNC) != 0) ++may_sync;
    if ((c.mask & (STATX_SIZE | STATX_BLOCKS | STATX_ATIME | STATX_MTIME | STATX_CTIME)) != 0) ++asks_more;
  }
  CHECK_MESSAGE(may_sync == 0, may_sync << " of " << g_statx_calls.size() << " statx calls may ask the storage");
  CHECK_MESSAGE(asks_more == 0, asks_more << " of " << g_statx_calls.size() << " statx calls ask for size or times");
  stop(qemu);
}

TEST_CASE("engine.proc_walk.block_device_by_rdev") {
  // A QEMU in a mount namespace of its own holds a block device through its own /dev node; here
  // a second node of the same loop device stands for it. The holder is found by the device.
  if (::geteuid() != 0 || std::system("command -v losetup >/dev/null 2>&1") != 0) {
    MESSAGE("skipped: needs root and losetup");
    return;
  }
  TempDir d;
  {
    std::ofstream f(d / "backing");
    f << std::string(1 << 20, '\0');
  }
  const std::string attach = "losetup -f --show " + d / "backing" + " > " + d / "dev";
  REQUIRE(std::system(attach.c_str()) == 0);
  std::string loop;
  std::ifstream(d / "dev") >> loop;
  REQUIRE(loop.rfind("/dev/loop", 0) == 0);
  struct stat st {};
  REQUIRE(::stat(loop.c_str(), &st) == 0);
  REQUIRE(::mknod((d / "node").c_str(), S_IFBLK | 0600, st.st_rdev) == 0);
  REQUIRE(::symlink("/bin/sleep", (d / "qemu-fake").c_str()) == 0);
  const pid_t qemu = spawn("exec 3<>\"$1/node\"; exec \"$1/qemu-fake\" 30", d.path, "qemu-fake");
  const auto by_dev = holders_of(loop, Access::writing, runs_qemu);
  const auto by_node = holders_of(d / "node", Access::any);
  const std::string described = describe_holders(loop);  // the image lock's message
  const auto id = file_id(loop);
  stop(qemu);
  const std::string detach = "losetup -d " + loop;
  CHECK(std::system(detach.c_str()) == 0);
  CHECK(pids(by_dev) == std::vector<pid_t>{qemu});
  CHECK(pids(by_node) == std::vector<pid_t>{qemu});
  CHECK(described == "pid " + std::to_string(qemu) + " (qemu-fake)");
  REQUIRE(id.has_value());
  CHECK(id->block);
  CHECK(id->dev == st.st_rdev);
}

TEST_CASE("engine.proc_walk.dead_fuse_mount") {
  // A process holds a file on a FUSE mount whose server is stopped (SIGSTOP): any request to it
  // waits until the server runs again, as on a dead NFS or FUSE mount. Once the cached
  // attributes have expired, a stat that asks the server hangs; the walk must not, and still
  // finds the holder of another file.
  const char* slowfs = std::getenv("QCOMMIT_SLOWFS");
  if (!slowfs || ::geteuid() != 0 || !fs::exists("/dev/fuse")) {
    MESSAGE("skipped: needs root, /dev/fuse and QCOMMIT_SLOWFS");
    return;
  }
  TempDir d;
  fs::create_directories(d / "backing");
  fs::create_directories(d / "mnt");
  touch(d / "image");
  const std::string mount = std::string(slowfs) + " --backing " + d / "backing" + " --mount " +
                            d / "mnt" + " --bandwidth 4G --pidfile " + d / "pid" + " >" +
                            d / "slowfs.log" + " 2>&1 &";
  REQUIRE(std::system(mount.c_str()) == 0);
  const std::string is_mounted = "mountpoint -q " + d / "mnt";
  for (int i = 0; i < kStartPolls && std::system(is_mounted.c_str()) != 0; ++i) ::usleep(kStartPollUs);
  REQUIRE(std::system(is_mounted.c_str()) == 0);
  pid_t server = 0;
  for (int i = 0; i < kStartPolls && server <= 0; ++i) {
    std::ifstream(d / "pid") >> server;
    if (server <= 0) ::usleep(kStartPollUs);
  }
  REQUIRE(server > 0);
  touch(d / "mnt/held");
  REQUIRE(::symlink("/bin/sleep", (d / "holder-fake").c_str()) == 0);
  const pid_t holder = spawn("exec 3<\"$1/mnt/held\" 4<\"$1/image\"; exec \"$1/holder-fake\" 30",
                             d.path, "holder-fake");

  // Stop the server and let the attributes the kernel caches for "held" expire (slowfs caches
  // them for 1 s).
  REQUIRE(::kill(server, SIGSTOP) == 0);
  ::usleep(1'500'000);
  // The walk runs in a child, which is killed if it does not answer in time.
  int answer[2];
  REQUIRE(::pipe(answer) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t walker = ::fork();
  REQUIRE(walker >= 0);
  if (walker == 0) {
    ::close(answer[0]);
    const std::string who = describe_holders(d / "image");
    (void)!::write(answer[1], who.data(), who.size());
    ::_exit(0);
  }
  ::close(answer[1]);
  constexpr auto kWalkLimit = std::chrono::seconds(5);
  int status = 0;
  bool done = false;
  while (!(done = ::waitpid(walker, &status, WNOHANG) == walker) &&
         std::chrono::steady_clock::now() - t0 < kWalkLimit)
    ::usleep(kStartPollUs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!done) {
    ::kill(walker, SIGKILL);
    ::waitpid(walker, nullptr, 0);
  }
  std::string who(256, '\0');
  const ssize_t n = done ? ::read(answer[0], who.data(), who.size()) : 0;
  who.resize(n > 0 ? size_t(n) : 0);
  ::close(answer[0]);
  ::kill(server, SIGCONT);
  stop(holder);
  const std::string unmount = "fusermount3 -u " + d / "mnt" + " || umount -l " + d / "mnt";
  CHECK(std::system(unmount.c_str()) == 0);
  for (int i = 0; i < kStartPolls && fs::exists(d / "pid"); ++i) ::usleep(kStartPollUs);

  MESSAGE("walk with a stopped FUSE server took " << seconds << " s");
  REQUIRE_MESSAGE(done, "the walk hung on the stopped FUSE mount");
  CHECK(who == "pid " + std::to_string(holder) + " (holder-fake)");
}

}  // namespace qcommit::test
