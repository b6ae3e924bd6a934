// SPDX-License-Identifier: GPL-2.0-or-later
// memory.stat parsing, memory cgroup discovery over a fake cgroup root, the completion tracker
// and its waiter with a fake target, and the no-cachestat target against cachestat's truth.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "plugin/govern/completion_clock.h"
#include "plugin/host/memcg.h"
#include "plugin/govern/memcg_target.h"
#include "plugin/govern/writeback.h"

using namespace qcommit::plugin;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct TempDir {
  fs::path path;
  TempDir() {
    char t[] = "/var/tmp/qcommit-memcg-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  void stat_file(const fs::path& dir) const {
    fs::create_directories(path / dir);
    std::ofstream(path / dir / "memory.stat") << "dirty 0\nwriteback 0\n";
  }
};

}  // namespace

TEST_CASE("plugin.memcg.memory_stat_v1_captured") {
  // memory.stat of libvirt's /machine group on this (cgroup v1/v2 hybrid) host.
  const std::string text = slurp(fs::path(QCOMMIT_TEST_DATA) / "memory.stat.v1-machine");
  const auto m = parse_memory_stat(text);
  REQUIRE(m);
  CHECK(*m == MemcgPageCache{0, 0});
}

TEST_CASE("plugin.memcg.memory_stat_synthetic") {
  // v1 with hierarchical totals: the totals count (descendant groups included).
  CHECK(parse_memory_stat("cache 1\ndirty 4096\nwriteback 0\ntotal_dirty 8192\n"
                          "total_writeback 12288\n") == MemcgPageCache{8192, 12288});
  // v1 without totals (local counts).
  CHECK(parse_memory_stat("dirty 4096\nwriteback 8192\n") == MemcgPageCache{4096, 8192});
  // v2.
  CHECK(parse_memory_stat("anon 1\nfile 2\nfile_dirty 40960\nfile_writeback 4096\nshmem 0\n") ==
        MemcgPageCache{40960, 4096});
  // Incomplete or foreign text.
  CHECK_FALSE(parse_memory_stat("file_dirty 1\n"));
  CHECK_FALSE(parse_memory_stat("MemTotal: 1 kB\n"));
  CHECK_FALSE(parse_memory_stat(""));
}

TEST_CASE("plugin.memcg.discovery_libvirt_layouts") {
  TempDir root;
  SUBCASE("v1, systemd: machine.slice scope") {
    const std::string scope = "machine.slice/machine-qemu\\x2d3\\x2dvm1.scope";
    root.stat_file("memory");
    root.stat_file("memory/" + scope);
    const std::string cg = "12:pids:/" + scope + "\n4:memory:/" + scope +
                           "/libvirt/emulator\n1:name=systemd:/" + scope + "\n0::/" + scope + "\n";
    CHECK(memcg_dir(cg, root.path) == root.path / "memory" / scope);
  }
  SUBCASE("v1, without systemd: /machine/qemu-N-NAME.libvirt-qemu, threads in emulator/") {
    root.stat_file("memory");
    root.stat_file("memory/machine/qemu-7-vm2.libvirt-qemu");
    const std::string cg =
        "4:memory:/machine/qemu-7-vm2.libvirt-qemu/emulator\n3:cpu,cpuacct:/"
        "machine/qemu-7-vm2.libvirt-qemu/emulator\n";
    CHECK(memcg_dir(cg, root.path) == root.path / "memory/machine/qemu-7-vm2.libvirt-qemu");
  }
  SUBCASE("v2 only: the scope's group, walking up past groups without memory.stat") {
    const std::string scope = "machine.slice/machine-qemu\\x2d1\\x2dvm.scope";
    root.stat_file(scope);
    fs::create_directories(root.path / scope / "libvirt/emulator");
    CHECK(memcg_dir("0::/" + scope + "/libvirt/emulator\n", root.path) == root.path / scope);
  }
  SUBCASE("hybrid, memory controller on v2 (unified)") {
    root.stat_file("unified/machine/qemu-2-x.libvirt-qemu");
    CHECK(memcg_dir("0::/machine/qemu-2-x.libvirt-qemu\n", root.path) ==
          root.path / "unified/machine/qemu-2-x.libvirt-qemu");
  }
  SUBCASE("nothing with memory.stat") {
    fs::create_directories(root.path / "unified/machine");
    CHECK_FALSE(memcg_dir("0::/machine\n", root.path));
    CHECK_FALSE(memcg_dir("garbage\n", root.path));
  }
}

TEST_CASE("plugin.memcg.tracker_late_and_out_of_order") {
  CompletionTracker t;
  const auto a = t.issue({0, 65536});
  const auto b = t.issue({65536, 65536});
  const auto c = t.issue({1 << 20, 4096});
  CHECK(t.in_flight_bytes() == 65536 * 2 + 4096);
  CHECK(t.oldest()->id == a);
  CHECK(t.complete(c));  // out of order
  CHECK(t.in_flight_bytes() == 65536 * 2);
  CHECK_FALSE(t.complete(c));    // twice
  CHECK_FALSE(t.complete(999));  // never issued
  CHECK(t.in_flight_in({32768, 65536}) == 65536);
  CHECK(t.complete(a));
  CHECK(t.oldest()->id == b);
  CHECK(t.in_flight_in({0, 65536}) == 0);
  CHECK(t.complete(b));
  CHECK(t.in_flight_bytes() == 0);
  CHECK(t.issued_bytes() == t.completed_bytes());
  CHECK_FALSE(t.oldest());
  // A range known to put fewer bytes in flight than its length.
  const auto d = t.issue({0, 1 << 20}, 8192);
  CHECK(t.in_flight_bytes() == 8192);
  CHECK(t.in_flight_in({0, 4096}) == 4096);
  CHECK(t.in_flight_in({0, 1 << 20}) == 8192);
  CHECK(t.complete(d));
  CHECK(t.in_flight_bytes() == 0);
}

TEST_CASE("plugin.memcg.waiter_with_a_fake_target") {
  // A fake target whose writeback completes when the test says so.
  std::mutex mu;
  std::set<std::uint64_t> released;
  std::atomic<int> waits{0};
  WritebackWaiter w([&](const ByteRange& r) {
    ++waits;
    for (;;) {
      {
        std::lock_guard lk(mu);
        if (released.count(r.offset)) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  REQUIRE(w.running());
  w.issued({0, 4096});
  w.issued({4096, 8192});
  CHECK(w.in_flight_bytes() == 12288);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(w.in_flight_bytes() == 12288);  // late: nothing completed yet
  {
    std::lock_guard lk(mu);
    released.insert(4096);  // the second completes first: still waited for in issue order
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(w.in_flight_bytes() == 12288);
  {
    std::lock_guard lk(mu);
    released.insert(0);
  }
  for (int i = 0; i < 1000 && w.in_flight_bytes() != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(w.in_flight_bytes() == 0);
  CHECK(w.completed_bytes() == 12288);
}

TEST_CASE("plugin.writeback.no_cachestat_source_names") {
  CHECK(parse_page_cache_source("no-cachestat") == PageCacheSource::kNoCachestat);
  CHECK(parse_page_cache_source("no-cachestat-shadow") == PageCacheSource::kNoCachestatShadow);
  CHECK(std::string(page_cache_source_name(PageCacheSource::kNoCachestat)) == "no-cachestat");
  CHECK(describe_page_cache_source(PageCacheSource::kNoCachestat).find("memory cgroup") !=
        std::string::npos);
}

// A child in a fresh v1 memory cgroup writes a file with buffered writes; the no-cachestat
// target reads it through that cgroup and issues its writeback in pieces; at every reading the
// estimate (memcg dirty + bytes in flight) is not below cachestat's truth by more than the
// memcg stat lag.  Needs root, a v1 memory hierarchy and cachestat(2) (the truth).
TEST_CASE("plugin.memcg.shadow_estimate_bounds_truth") {
  const fs::path v1 = "/sys/fs/cgroup/memory";
  if (::geteuid() != 0 || !fs::exists(v1 / "cgroup.procs") || !cachestat_available()) {
    MESSAGE("skipped: needs root, a v1 memory cgroup hierarchy and cachestat(2)");
    return;
  }
  const fs::path cg = v1 / ("qcommit-test-" + std::to_string(::getpid()));
  REQUIRE(fs::create_directory(cg));
  char path[] = "/var/tmp/qcommit-shadow-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  constexpr std::uint64_t kFileBytes = 48ull << 20;
  constexpr std::uint64_t kChunk = 256 << 10;  // below the bound: a write between readings
  int go[2];
  REQUIRE(::pipe(go) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    char c;
    (void)!::read(go[0], &c, 1);  // placed in the cgroup by the parent
    std::vector<char> buf(kChunk, 'q');
    for (std::uint64_t off = 0; off < kFileBytes; off += kChunk) {
      if (::pwrite(fd, buf.data(), kChunk, static_cast<off_t>(off)) < 0) ::_exit(1);
      ::usleep(1250);
    }
    ::pause();  // stays in the cgroup until killed
    ::_exit(0);
  }
  std::ofstream(cg / "cgroup.procs") << child << std::endl;
  (void)!::write(go[1], "g", 1);
  const auto dir = memcg_dir_of(child);
  REQUIRE(dir);
  CHECK(*dir == cg);

  constexpr std::uint64_t kWindowBytes = 8ull << 20;
  std::uint64_t worst_short = 0;
  std::uint64_t max_in_flight = 0;
  int readings = 0;
  {
    auto target = open_memcg_target(::open(path, O_RDONLY | O_CLOEXEC), *dir,
                                    [&](const PageCacheState& est, const PageCacheState& truth) {
                                      ++readings;
                                      const std::uint64_t e = est.dirty_bytes + est.writeback_bytes;
                                      const std::uint64_t t =
                                          truth.dirty_bytes + truth.writeback_bytes;
                                      if (t > e) worst_short = std::max(worst_short, t - e);
                                    });
    // Each reading right after a batch of pieces is issued: their writeback is then under way.
    WritebackPlanner planner;
    std::uint64_t writeback = 0;
    for (int i = 0; i < 60; ++i) {
      WritebackInput in{target->size(), writeback, kWindowBytes};
      const auto plan = planner.plan(in, [&](const ByteRange& r) { return target->dirty_in(r); });
      for (const auto& r : plan.ranges) target->start_writeback(r);
      const auto pc = target->page_cache();
      REQUIRE(pc);
      CHECK(pc->per_file);
      writeback = pc->writeback_bytes;
      max_in_flight = std::max(max_in_flight, writeback);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(fd);
  ::unlink(path);
  fs::remove(cg);
  MESSAGE("readings " << readings << ", estimate below truth by at most " << worst_short
                      << " bytes (bound " << memcg_lag_bytes() << "), at most " << max_in_flight
                      << " bytes in flight");
  CHECK(readings == 60);
  CHECK(worst_short <= memcg_lag_bytes());
}

TEST_CASE("plugin.writeback.service_meter_times_busy_periods") {
  using std::chrono::milliseconds;
  using std::chrono::microseconds;
  ServiceMeter m;
  // Two ranges issued together, completing 4 ms and 8 ms later: one period of 8 ms.
  m.issued(milliseconds(100));
  m.issued(milliseconds(100));
  m.completed(256 * 1024, milliseconds(104));
  m.completed(256 * 1024, milliseconds(108));
  // A batch the kernel wrote as one request: the second range's wait returns at once.  Its bytes
  // join its period instead of reading as a range that took no time.
  m.issued(milliseconds(200));
  m.issued(milliseconds(201));
  m.completed(512 * 1024, milliseconds(210));
  m.completed(512 * 1024, milliseconds(210));
  // Nothing issued before: ignored.  A period under kMinServicePeriod: clock noise, no sample.
  m.completed(4096, milliseconds(300));
  m.issued(milliseconds(400));
  m.completed(64 * 1024, milliseconds(400) + microseconds(100));
  // A period longer than kMaxServicePeriod is cut there while ranges are still in flight; the
  // range in flight at the cut was served partly before it: its bytes count in neither period
  // (crediting them to the 10 ms after the cut would read as 100 MiB/s).
  m.issued(milliseconds(500));
  m.issued(milliseconds(500));
  m.completed(1024 * 1024, milliseconds(650));
  m.completed(1024 * 1024, milliseconds(660));
  // The next period starts clean.
  m.issued(milliseconds(700));
  m.completed(256 * 1024, milliseconds(704));
  const auto s = m.take();
  REQUIRE(s.size() == 4);
  CHECK(s[0].bytes == 512 * 1024);
  CHECK(s[0].latency == milliseconds(8));
  CHECK(s[1].bytes == 1024 * 1024);
  CHECK(s[1].latency == milliseconds(10));
  CHECK(s[2].bytes == 1024 * 1024);
  CHECK(s[2].latency == milliseconds(150));
  CHECK(s[3].bytes == 256 * 1024);
  CHECK(s[3].latency == milliseconds(4));
  CHECK(m.take().empty());
}

TEST_CASE("plugin.writeback.waiter_times_its_ranges") {
  // The waiter feeds its meter: two ranges waited for in order, on the test's clock.
  std::atomic<std::int64_t> clock_ms{1000};
  std::atomic<int> released{0};
  WritebackWaiter w([&](const ByteRange&) {
    while (released.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  REQUIRE(w.running());
  w.set_clock([&] { return std::chrono::nanoseconds(std::chrono::milliseconds(clock_ms.load())); });
  w.issued({0, 131072});
  w.issued({131072, 131072});
  clock_ms = 1005;
  released = 1;
  for (int i = 0; i < 1000 && w.in_flight_bytes() != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto s = w.take_service_samples();
  REQUIRE(s.size() == 1);
  CHECK(s[0].bytes == 262144);
  CHECK(s[0].latency == std::chrono::milliseconds(5));
}
