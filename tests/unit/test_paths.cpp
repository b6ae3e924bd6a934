// SPDX-License-Identifier: GPL-2.0-or-later
// Backing file names resolved as QEMU and the kernel resolve them, and the open policy: nothing
// that is not a regular file or block device, and nothing outside the allowed directories, is
// ever opened for I/O. "Opened" is observed with inotify: an open(2) for reading or writing
// raises IN_OPEN on the file, a lookup with O_PATH does not.
#include <doctest/doctest.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "qcow2/chain.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;
using qcow2::Chain;
using qcow2::Error;
using qcow2::resolve_backing;

namespace fs = std::filesystem;

namespace {

inline constexpr uint64_t kImageBytes = 1ull << 20;
inline constexpr uint8_t kRealByte = 0x5a;
inline constexpr uint8_t kDecoyByte = 0xa5;

std::vector<uint8_t> with_backing(const std::string& backing, std::optional<std::string> fmt = {}) {
  ImageSpec s;
  s.size = kImageBytes;
  s.backing = backing;
  s.backing_format = std::move(fmt);
  return ImageBuilder(s).bytes();
}

std::string real(const std::string& path) {
  char buf[PATH_MAX];
  REQUIRE(::realpath(path.c_str(), buf) != nullptr);
  return buf;
}

// Counts open(2)s of one file (IN_OPEN) from construction on. Closes its descriptor on exit.
class OpenWatch {
 public:
  explicit OpenWatch(const std::string& path) : fd_(inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) {
    REQUIRE(fd_ >= 0);
    REQUIRE(inotify_add_watch(fd_, path.c_str(), IN_OPEN) >= 0);
  }
  OpenWatch(const OpenWatch&) = delete;
  OpenWatch& operator=(const OpenWatch&) = delete;
  ~OpenWatch() { ::close(fd_); }
  [[nodiscard]] int opens() const {
    int n = 0;
    alignas(inotify_event) std::array<char, 4096> buf{};
    for (;;) {
      const ssize_t got = ::read(fd_, buf.data(), buf.size());
      if (got <= 0) return n;
      for (ssize_t off = 0; off < got;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf.data() + off);
        if (ev->mask & IN_OPEN) ++n;
        off += ssize_t(sizeof(inotify_event) + ev->len);
      }
    }
  }

 private:
  int fd_;
};

// A listening-less AF_UNIX socket file bound at `path`, closed (the file stays) on exit.
struct SocketFile {
  int fd = -1;
  explicit SocketFile(const std::string& path) : fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    REQUIRE(fd >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    REQUIRE(path.size() < sizeof a.sun_path);
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    REQUIRE(::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
  }
  SocketFile(const SocketFile&) = delete;
  SocketFile& operator=(const SocketFile&) = delete;
  ~SocketFile() { ::close(fd); }
};

}  // namespace

TEST_CASE("qcow2.paths.resolve_like_qemu") {
  // Joined to the image's path up to its last '/', textually: no normalisation.
  CHECK(resolve_backing("top.qcow2", "base.qcow2") == "base.qcow2");
  CHECK(resolve_backing("./top.qcow2", "base.qcow2") == "./base.qcow2");
  CHECK(resolve_backing("d/top.qcow2", "link/../base.qcow2") == "d/link/../base.qcow2");
  CHECK(resolve_backing("/a/b/../c/top.qcow2", "../base.qcow2") == "/a/b/../c/../base.qcow2");
  CHECK(resolve_backing("d//top.qcow2", "./b") == "d//./b");
  CHECK(resolve_backing("d/top.qcow2", "/abs/../b.qcow2") == "/abs/../b.qcow2");
  CHECK(resolve_backing("/d/top.qcow2", "file:/x/../b.qcow2") == "/x/../b.qcow2");
  // Any ':' before the first '/' makes a protocol name for QEMU; only file: is followed.
  for (const std::string name : {"nbd:x", "a b:c.qcow2", "vm:1.qcow2"}) {
    CAPTURE(name);
    CHECK_THROWS_AS((void)resolve_backing("/d/top.qcow2", name), qcow2::UnsupportedError);
  }
}

TEST_CASE("qcow2.paths.symlink_dotdot_follows_the_kernel") {
  // link -> real/sub; "link/../base.img" is real/base.img for the kernel (and QEMU), while a
  // lexical reading makes it ./base.img (the decoy).
  TempDir d;
  fs::create_directories(d.path / "real" / "sub");
  fs::create_directory_symlink("real/sub", d.path / "link");
  d.write("real/base.img", std::vector<uint8_t>(kImageBytes, kRealByte));
  d.write("base.img", std::vector<uint8_t>(kImageBytes, kDecoyByte));
  const auto top = d.write("top.qcow2", with_backing("link/../base.img", "raw"));
  OpenWatch decoy(d.file("base.img"));
  Chain chain = Chain::open(top);
  REQUIRE(chain.depth() == 2);
  CHECK(chain.layer(1).path == d.file("link/../base.img"));
  CHECK(chain.layer(1).real_path == real(d.file("real/base.img")));
  CHECK(chain.layer(0).real_path == real(top));
  std::vector<uint8_t> out(4096);
  chain.read(0, out);
  CHECK(out == std::vector<uint8_t>(out.size(), kRealByte));
  CHECK(decoy.opens() == 0);
}

TEST_CASE("qcow2.paths.relative_top_and_loop_by_identity") {
  // The top named relative to the working directory: its backing names join to that spelling.
  TempDir d;
  fs::create_directory(d.path / "sub");
  d.write("sub/base.img", std::vector<uint8_t>(kImageBytes, kRealByte));
  d.write("sub/top.qcow2", with_backing("base.img", "raw"));
  const fs::path cwd = fs::current_path();
  fs::current_path(d.path);
  const auto restore = [&] { fs::current_path(cwd); };
  try {
    Chain chain = Chain::open("sub/top.qcow2");
    REQUIRE(chain.depth() == 2);
    CHECK(chain.layer(1).path == "sub/base.img");
    CHECK(chain.layer(1).real_path == real(d.file("sub/base.img")));
    // qemu-img names it "./sub/base.img" for "./sub/top.qcow2": the same spelling.
    Chain dotted = Chain::open("./sub/top.qcow2");
    REQUIRE(dotted.depth() == 2);
    CHECK(dotted.layer(1).path == "./sub/base.img");
  } catch (...) {
    restore();
    throw;
  }
  restore();
  // The same file through a symlinked directory is the same layer: a loop.
  fs::create_directory_symlink("sub", d.path / "alias");
  const auto a = d.write("sub/a.qcow2", with_backing("../alias/a.qcow2"));
  expect_error<Error>([&] { (void)Chain::open(a); }, a, "loop");
}

TEST_CASE("qcow2.paths.special_backing_files_are_never_opened") {
  TempDir d;
  REQUIRE(::mkfifo(d.file("fifo").c_str(), 0600) == 0);
  // A character device of our own (the null device's numbers), not a system one.
  const bool have_cdev = ::mknod(d.file("cdev").c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0;
  fs::create_directory(d.path / "dir");
  SocketFile sock(d.file("sock"));
  struct Case {
    std::string name, kind;
  };
  std::vector<Case> cases = {{"fifo", "a FIFO"}, {"dir", "a directory"}, {"sock", "a socket"}};
  if (have_cdev) cases.push_back({"cdev", "a character device"});
  else MESSAGE("mknod refused (not root?): the character device case uses /dev/null itself");
  if (!have_cdev) cases.push_back({"/dev/null", "a character device"});
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const auto top = d.write("top-" + fs::path(c.name).filename().string() + ".qcow2", with_backing(c.name, "raw"));
    const std::string target = c.name.front() == '/' ? c.name : d.file(c.name);
    std::optional<OpenWatch> watch;
    if (c.name.front() != '/') watch.emplace(target);  // /dev/null is opened by everyone
    expect_error<Error>([&] { (void)Chain::open(top); }, top, c.kind);
    expect_error<Error>([&] { (void)Chain::open(top); }, top, "'" + c.name + "'");
    if (watch) CHECK(watch->opens() == 0);
    // Named directly (as TOP or BASE), the same refusal, naming the file.
    expect_error<Error>([&] { (void)qcow2::FileDevice::open(target); }, target, c.kind);
    if (watch) CHECK(watch->opens() == 0);
  }
}

TEST_CASE("qcow2.paths.outside_allowed_dirs_is_never_opened") {
  TempDir d;
  fs::create_directory(d.path / "allowed");
  fs::create_directory(d.path / "outside");
  const auto outside = d.write("outside/base.img", std::vector<uint8_t>(kImageBytes, kDecoyByte));
  // A symlink inside the allowed tree pointing out of it is outside.
  fs::create_symlink("../outside/base.img", d.path / "allowed" / "link.img");
  const auto via_link = d.write("allowed/top1.qcow2", with_backing("link.img", "raw"));
  const auto via_dotdot = d.write("allowed/top2.qcow2", with_backing("../outside/base.img", "raw"));
  qcow2::ChainOptions o;
  o.allowed_backing_dirs = {d.file("allowed")};
  OpenWatch watch(outside);
  expect_error<Error>([&] { (void)Chain::open(via_link, o); }, via_link, "outside the allowed directories");
  expect_error<Error>([&] { (void)Chain::open(via_dotdot, o); }, via_dotdot, "outside the allowed directories");
  CHECK(watch.opens() == 0);
  // Allowed through a symlinked spelling of the allowed directory itself.
  fs::create_directory_symlink("outside", d.path / "alias");
  o.allowed_backing_dirs = {d.file("alias")};
  Chain chain = Chain::open(via_link, o);
  CHECK(chain.layer(1).real_path == real(outside));
  CHECK(watch.opens() == 1);
}
