// SPDX-License-Identifier: GPL-2.0-or-later
// Waiting image locks (ImageLock::acquire): re-checked until the holder lets go or the deadline
// passes, with a manual clock; and against real holders: qemu-io holding a shared lock is
// waited out, a QEMU running a guest (qemu-system) is refused at once, also when it starts
// during the wait.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/image_lock.h"

namespace qcommit::test {
namespace {

namespace fs = std::filesystem;
using namespace engine;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kMaxRecheck = 50ms;          // the longest a release may go unnoticed
constexpr auto kStartedWithin = 200ms;      // a waiting acquisition after the holder's exit
constexpr auto kHolderStartLimit = 20s;     // for qemu-io or QEMU to take their locks

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/qcommit-lockwait-XXXXXX";
    REQUIRE(::mkdtemp(tmpl));
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  [[nodiscard]] std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// Time that passes only when the code under test sleeps; `on_sleep` runs after each sleep.
class ManualClock : public LockWaitClock {
 public:
  [[nodiscard]] LockClock::time_point now() const override { return now_; }
  void sleep_for(LockClock::duration d) const override {
    sleeps.push_back(d);
    now_ += d;
    if (on_sleep) on_sleep(sleeps.size());
  }
  mutable std::vector<LockClock::duration> sleeps;
  std::function<void(size_t count)> on_sleep;

 private:
  mutable LockClock::time_point now_{};
};

// Whether anybody holds one of QEMU's permission bytes (100..103) on `path`: a probe that takes
// no lock itself, so that it cannot make a starting holder fail.
bool perm_bytes_locked(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = off_t(kLockPermBase);
  fl.l_len = 4;
  const bool locked = ::fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
  ::close(fd);
  return locked;
}

// Runs `argv` with its output in `log`.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ::dup2(out, 1);
    ::dup2(out, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  return child;
}

// Runs `argv` with its output in `log`; returns once it holds a lock on `image`.
pid_t start_holder(const std::vector<std::string>& argv, const std::string& log,
                   const std::string& image) {
  const pid_t child = spawn(argv, log);
  const auto t0 = Clock::now();
  while (!perm_bytes_locked(image) && Clock::now() - t0 < kHolderStartLimit) {
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child) break;
    std::this_thread::sleep_for(5ms);
  }
  std::string output;
  std::getline(std::ifstream(log), output, '\0');
  REQUIRE_MESSAGE(perm_bytes_locked(image), argv[0] << " took no lock: " << output);
  return child;
}

pid_t start_qemu_io_sleep(const TempDir& d, const std::string& image, int sleep_ms) {
  return start_holder({"qemu-io", "-r", "-f", "qcow2", "-c", "sleep " + std::to_string(sleep_ms), image},
                      d / "qemu-io.log", image);
}

std::vector<std::string> qemu_system_args(const std::string& image, bool read_only) {
  return {"qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none", "-S",
          "-drive", "file=" + image + ",format=qcow2,if=none,id=d0" + (read_only ? ",readonly=on" : "")};
}

void stop(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

void create_image(const std::string& path) {
  const std::string cmd = "qemu-img create -q -f qcow2 " + path + " 16M";
  REQUIRE(std::system(cmd.c_str()) == 0);
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// A file held by a reader lock of this process (OFD locks of two open files conflict like two
// processes'), until release_after's sleep of the clock.
struct HeldImage {
  TempDir d;
  std::string image = d / "image";
  std::optional<ImageLock> holder;
  HeldImage() {
    std::ofstream(image) << "x";
    holder.emplace(ImageLock::reader(image));
  }
  void release_after(size_t sleeps, ManualClock& clock) {
    clock.on_sleep = [this, sleeps](size_t count) {
      if (count == sleeps) holder.reset();
    };
  }
};

TEST_CASE("engine.lock_wait.rechecks_until_released") {
  // A conflicting lock of this process (OFD locks of two open files conflict like two
  // processes'), released after the tenth sleep: the acquisition takes it at the next check.
  HeldImage held;
  const std::string& image = held.image;
  ManualClock clock;
  held.release_after(10, clock);
  std::vector<std::string> notices;
  const auto notice = [&](const WaitNotice& n) { notices.push_back(n.message); };
  {
    const ImageLock lock = ImageLock::acquire(image, ImageLock::kWriterPerm, ImageLock::kWriterShared,
                                              30s, notice, clock);
    CHECK(clock.sleeps.size() == 10);
    for (const auto s : clock.sleeps) CHECK(s <= kMaxRecheck);
    REQUIRE(notices.size() == 1);
    CHECK(notices[0] == "waiting up to 30 s for another process to release " + image +
                            " (another process holds the consistent read permission)");
    // Held now: a reader is refused.
    CHECK_THROWS_AS((void)ImageLock::reader(image), ImageInUse);
  }
  CHECK_NOTHROW((void)ImageLock::reader(image));  // and released with the lock
}

TEST_CASE("engine.lock_wait.two_starting_at_once") {
  // Two writers start at once: B tries while A has taken its bytes but not yet looked for
  // others'. B must see A's bytes and refuse; A then finds nobody and holds the image. (Had A
  // looked before taking, both would have found nothing and both would write.)
  TempDir d;
  const std::string image = d / "image";
  std::ofstream(image) << "x";
  bool b_refused = false;
  const auto b_tries = [&] {
    try {
      (void)ImageLock::writer(image);
    } catch (const ImageInUse&) {
      b_refused = true;
    }
  };
  {
    const ImageLock a = ImageLock::acquire(image, ImageLock::kWriterPerm, ImageLock::kWriterShared,
                                           0s, nullptr, LockWaitClock{}, b_tries);
    CHECK(b_refused);
    CHECK_THROWS_AS((void)ImageLock::reader(image), ImageInUse);  // A holds it
  }

  // A QEMU that has taken its write permission byte in that window but not yet checked: A sees
  // it and refuses (the QEMU, checking next, proceeds alone).
  UniqueFd qemu;
  const auto qemu_takes_write = [&] {
    qemu = UniqueFd(::open(image.c_str(), O_RDONLY | O_CLOEXEC));
    struct flock fl {};
    fl.l_type = F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = off_t(kLockPermBase + 1);  // the write permission
    fl.l_len = 1;
    REQUIRE(::fcntl(qemu.get(), F_OFD_SETLK, &fl) == 0);
  };
  CHECK_THROWS_AS((void)ImageLock::acquire(image, ImageLock::kWriterPerm, ImageLock::kWriterShared,
                                           0s, nullptr, LockWaitClock{}, qemu_takes_write),
                  ImageInUse);
}

TEST_CASE("engine.lock_wait.waiting_takes_nothing") {
  // While another process holds the image, the retries take none of our bytes, not even for a
  // moment: a QEMU starting then would find them and fail for good. Ours are taken once, when
  // the image looks free.
  HeldImage held;
  const std::string& image = held.image;
  ManualClock clock;
  held.release_after(3, clock);
  int took = 0;
  {
    const ImageLock lock = ImageLock::acquire(image, ImageLock::kWriterPerm,
                                              ImageLock::kWriterShared, 30s, nullptr, clock,
                                              [&] { ++took; });
    CHECK(clock.sleeps.size() == 3);
    CHECK(took == 1);
  }
}

TEST_CASE("engine.lock_wait.deadline") {
  TempDir d;
  const std::string image = d / "image";
  std::ofstream(image) << "x";
  const ImageLock holder = ImageLock::reader(image);
  std::vector<std::string> notices;
  const auto notice = [&](const WaitNotice& n) { notices.push_back(n.message); };
  const std::string refusal =
      image + ": image is in use: another process holds the consistent read permission";

  // Never released: refused once 1.5 s have passed, re-checked in steps of at most 50 ms up to
  // the deadline itself.
  ManualClock clock;
  try {
    (void)ImageLock::acquire(image, ImageLock::kWriterPerm, ImageLock::kWriterShared, 1500ms, notice,
                             clock);
    FAIL("acquired a lock that another open file holds");
  } catch (const ImageInUse& e) {
    CHECK(std::string(e.what()) == refusal);
    CHECK_FALSE(e.held_by_guest());
  }
  LockClock::duration waited{};
  for (const auto s : clock.sleeps) {
    CHECK(s <= kMaxRecheck);
    waited += s;
  }
  CHECK(waited == 1500ms);
  CHECK(clock.sleeps.size() >= size_t(1500ms / kMaxRecheck));
  REQUIRE(notices.size() == 1);
  CHECK(notices[0].rfind("waiting up to 1500 ms for another process to release " + image, 0) == 0);

  // wait 0: refused at once, as the constructor does, without a notice.
  ManualClock at_once;
  notices.clear();
  try {
    (void)ImageLock::acquire(image, ImageLock::kWriterPerm, ImageLock::kWriterShared, 0s, notice,
                             at_once);
    FAIL("acquired a lock that another open file holds");
  } catch (const ImageInUse& e) {
    CHECK(std::string(e.what()) == refusal);
  }
  CHECK(at_once.sleeps.empty());
  CHECK(notices.empty());
  try {
    ImageLock plain(image, ImageLock::kWriterPerm, ImageLock::kWriterShared);
    FAIL("acquired a lock that another open file holds");
  } catch (const ImageInUse& e) {
    CHECK(std::string(e.what()) == refusal);
  }
}

TEST_CASE("engine.lock_wait.outlasts_qemu_io") {
  // qemu-io holds a shared lock for 2 s; a writer waiting up to 10 s gets the image within
  // 200 ms of qemu-io's exit.
  TempDir d;
  const std::string image = d / "base.qcow2";
  create_image(image);
  const pid_t qio = start_qemu_io_sleep(d, image, 2000);

  std::vector<std::string> notices;
  std::vector<WaitNotice> told;
  const auto notice = [&](const WaitNotice& n) {
    notices.push_back(n.message);
    told.push_back(n);
  };
  // wait 0 is today's refusal, at once and without a notice.
  const auto t_refused = Clock::now();
  CHECK_THROWS_AS((void)ImageLock::writer(image, 0s, notice), ImageInUse);
  CHECK(Clock::now() - t_refused < 1s);
  CHECK(notices.empty());

  std::atomic<Clock::rep> exited{0};
  std::thread reaper([&] {
    ::waitpid(qio, nullptr, 0);
    exited = Clock::now().time_since_epoch().count();
  });
  const auto t0 = Clock::now();
  std::optional<ImageLock> lock;
  try {
    lock.emplace(ImageLock::writer(image, 10s, notice));
  } catch (const std::exception& e) {
    FAIL_CHECK("the waiting writer was refused: " << std::string(e.what()));
    ::kill(qio, SIGKILL);
  }
  const auto t_locked = Clock::now();
  reaper.join();
  const Clock::time_point t_exit{Clock::duration(exited.load())};
  MESSAGE("waited " << seconds(t_locked - t0) << " s; locked " << seconds(t_locked - t_exit)
                    << " s after qemu-io exited");
  REQUIRE(lock.has_value());
  CHECK(t_locked - t0 > 1s);  // it did wait for qemu-io
  CHECK(t_locked - t_exit < kStartedWithin);
  REQUIRE(notices.size() == 1);
  CHECK(notices[0] == "waiting up to 10 s for pid " + std::to_string(qio) + " (qemu-io) to release " +
                          image + " (another process holds the consistent read permission)");
  // ... and the same in members: what is awaited, the image, who holds it, for how long at most.
  REQUIRE(told.size() == 1);
  CHECK(told[0].what == WaitFor::kLock);
  CHECK(told[0].path == image);
  REQUIRE(told[0].holders.size() == 1);
  CHECK(told[0].holders[0].pid == qio);
  CHECK(told[0].holders[0].name == "qemu-io");
  CHECK(told[0].conflict == "another process holds the consistent read permission");
  CHECK(told[0].timeout == std::optional<std::chrono::nanoseconds>(10s));
  // The lock is held: qemu-io cannot open the image now.
  const std::string probe = "qemu-io -r -f qcow2 -c 'read 0 512' " + image + " >/dev/null 2>&1";
  CHECK(std::system(probe.c_str()) != 0);
}

TEST_CASE("engine.lock_wait.deadline_names_qemu_io") {
  // qemu-io holds a shared lock for 5 s; a writer waiting 1 s is refused after 1 s, naming it.
  TempDir d;
  const std::string image = d / "base.qcow2";
  create_image(image);
  const pid_t qio = start_qemu_io_sleep(d, image, 5000);
  std::vector<std::string> notices;
  const auto t0 = Clock::now();
  try {
    (void)ImageLock::writer(image, 1s, [&](const WaitNotice& n) { notices.push_back(n.message); });
    FAIL_CHECK("acquired the image qemu-io holds");
  } catch (const ImageInUse& e) {
    const auto took = Clock::now() - t0;
    MESSAGE("refused after " << seconds(took) << " s: " << std::string(e.what()));
    CHECK(took >= 1s);
    CHECK(took < 3s);
    CHECK(std::string(e.what()) == image +
                                       ": image is in use: another process holds the consistent read "
                                       "permission (held by pid " +
                                       std::to_string(qio) + " (qemu-io))");
    CHECK_FALSE(e.held_by_guest());
  }
  CHECK(notices.size() == 1);
  stop(qio);
}

TEST_CASE("engine.lock_wait.guest_refused_at_once") {
  // A QEMU running a guest on the image is no transient holder: refused at once.
  TempDir d;
  const std::string image = d / "base.qcow2";
  create_image(image);
  const pid_t qemu = start_holder(qemu_system_args(image, false), d / "qemu.log", image);
  std::vector<std::string> notices;
  const auto t0 = Clock::now();
  try {
    (void)ImageLock::writer(image, 30s, [&](const WaitNotice& n) { notices.push_back(n.message); });
    FAIL_CHECK("acquired the image a running QEMU holds");
  } catch (const ImageInUse& e) {
    const auto took = Clock::now() - t0;
    MESSAGE("refused after " << seconds(took) << " s: " << std::string(e.what()));
    CHECK(took < 2s);
    CHECK(e.held_by_guest());
    CHECK(std::string(e.what()).find("(held by pid " + std::to_string(qemu) + " (qemu-system-x86))") !=
          std::string::npos);
  }
  CHECK(notices.empty());
  stop(qemu);
}

TEST_CASE("engine.lock_wait.guest_started_during_wait") {
  // While a writer waits for qemu-io (3 s), a QEMU starts on the image read-only (compatible with
  // qemu-io, not with the writer): the wait ends in a refusal naming QEMU, long before the 30 s
  // deadline, not in waiting for a guest.
  TempDir d;
  const std::string image = d / "base.qcow2";
  create_image(image);
  const pid_t qio = start_qemu_io_sleep(d, image, 3000);
  pid_t qemu = -1;
  std::vector<std::string> notices;
  const auto t0 = Clock::now();
  try {
    (void)ImageLock::writer(image, 30s, [&](const WaitNotice& n) {
      notices.push_back(n.message);
      qemu = spawn(qemu_system_args(image, true), d / "qemu.log");
    });
    FAIL_CHECK("acquired the image a running QEMU holds");
  } catch (const ImageInUse& e) {
    const auto took = Clock::now() - t0;
    MESSAGE("refused after " << seconds(took) << " s: " << std::string(e.what()));
    CHECK(took < 10s);
    CHECK(e.held_by_guest());
    CHECK(std::string(e.what()).find("pid " + std::to_string(qemu) + " (qemu-system-x86)") !=
          std::string::npos);
  }
  REQUIRE(notices.size() == 1);
  CHECK(notices[0].find("for pid " + std::to_string(qio) + " (qemu-io) to release") != std::string::npos);
  if (qemu > 0) stop(qemu);
  stop(qio);
}

}  // namespace qcommit::test
