// SPDX-License-Identifier: GPL-2.0-or-later
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "plugin/hypervisor/hypervisor.h"
#include "plugin/host/proc_fds.h"
#include "plugin/host/process.h"
#include "plugin/govern/writeback.h"

using namespace qcommit::plugin;

namespace {
// Page cache of one file, 4 KiB pages: 0 clean, 1 dirty, 2 writeback.
struct Cache {
  std::vector<int> pages;
  explicit Cache(std::uint64_t size) : pages(size / 4096, 0) {}
  std::uint64_t count(int state, const ByteRange& r) const {
    std::uint64_t n = 0;
    for (std::uint64_t p = r.offset / 4096; p < (r.offset + r.length) / 4096; ++p)
      n += pages[p] == state;
    return n * 4096;
  }
  std::uint64_t total(int state) const { return count(state, {0, pages.size() * 4096}); }
};
}  // namespace

TEST_CASE("plugin.writeback.planner_respects_window") {
  constexpr std::uint64_t kSize = 64ull << 20;
  Cache c(kSize);
  WritebackPlanner planner(WritebackConfig{64 * 1024, 4096});
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::size_t> page(0, c.pages.size() - 1);
  const std::uint64_t window = 1 << 20;
  std::uint64_t written_back = 0;
  for (int tick = 0; tick < 400; ++tick) {
    // The job dirties 512 random pages (2 MiB) per tick for 200 ticks.
    if (tick < 200)
      for (int i = 0; i < 512; ++i) c.pages[page(rng)] = 1;
    const std::uint64_t wb = c.total(2);
    WritebackPlan plan =
        planner.plan({kSize, wb, window}, [&](const ByteRange& r) { return c.count(1, r); });
    std::uint64_t issued = 0;
    for (const auto& r : plan.ranges) {
      issued += c.count(1, r);
      for (std::uint64_t p = r.offset / 4096; p < (r.offset + r.length) / 4096; ++p)
        if (c.pages[p] == 1) c.pages[p] = 2;
    }
    CHECK(issued == plan.dirty_bytes_issued);
    // Never more queued at storage than the window (one piece allowed when idle).
    if (wb > 0)
      CHECK(wb + issued <= window);
    else
      CHECK(issued <= std::max<std::uint64_t>(window, 64 * 1024));
    // Storage completes 1 MiB of writeback per tick.
    std::uint64_t done = 0;
    for (auto& p : c.pages)
      if (p == 2 && done < (1u << 20)) p = 0, done += 4096;
    written_back += done;
  }
  CHECK(c.total(1) == 0);  // everything dirtied was eventually written back
  CHECK(c.total(2) == 0);
  CHECK(written_back > 0);
}

TEST_CASE("plugin.writeback.window_in_several_requests") {
  // Everything dirty: under a 256 KiB window the pacer's ranges are single 64 KiB pieces (four
  // requests at storage, the next waiting while one is written), not one 256 KiB range; under
  // 1 MiB, 256 KiB ranges.
  WritebackPlanner planner(WritebackConfig{64 * 1024, 4096});
  const auto all_dirty = [](const ByteRange& r) { return r.length; };
  const std::uint64_t small = 256 * 1024;
  auto plan = planner.plan({64 << 20, 0, small, writeback_range_bytes(small, 64 * 1024)},
                           all_dirty);
  CHECK(plan.dirty_bytes_issued == small);
  REQUIRE(plan.ranges.size() == 4);
  for (const auto& r : plan.ranges) CHECK(r.length == 64 * 1024);
  const std::uint64_t big = 1 << 20;
  plan = planner.plan({64 << 20, 0, big, writeback_range_bytes(big, 64 * 1024)}, all_dirty);
  REQUIRE(plan.ranges.size() == 4);
  for (const auto& r : plan.ranges) CHECK(r.length == 256 * 1024);
  // No limit: one range.
  plan = planner.plan({64 << 20, 0, big, 0}, all_dirty);
  CHECK(plan.ranges.size() == 1);
  // A window below four pieces: ranges of one piece; below one piece: one piece.
  CHECK(writeback_range_bytes(200 * 1024, 64 * 1024) == 64 * 1024);
  CHECK(writeback_range_bytes(16 * 1024, 64 * 1024) == 64 * 1024);
  CHECK(writeback_range_bytes(3 << 20, 64 * 1024) == 768 * 1024);
}

TEST_CASE("plugin.writeback.liveness_small_window") {
  // Window smaller than a piece: still one piece when nothing is under writeback.
  WritebackPlanner planner(WritebackConfig{256 * 1024, 16});
  auto plan = planner.plan({1 << 20, 0, 64 * 1024}, [](const ByteRange& r) { return r.length; });
  CHECK(plan.ranges.size() == 1);
  auto blocked =
      planner.plan({1 << 20, 4096, 64 * 1024}, [](const ByteRange& r) { return r.length; });
  CHECK(blocked.ranges.empty());
  CHECK(WritebackConfig{1000, 1}.validate());
}

TEST_CASE("plugin.writeback.cachestat_probe") {
  // cachestat(2) came with Linux 6.5: the probe must agree with the running kernel's version.
  struct utsname u {};
  REQUIRE(::uname(&u) == 0);
  int major = 0, minor = 0;
  REQUIRE(std::sscanf(u.release, "%d.%d", &major, &minor) == 2);
  MESSAGE("kernel " << u.release << ", cachestat "
                    << std::string(cachestat_available() ? "yes" : "no"));
  CHECK(cachestat_available() == (major > 6 || (major == 6 && minor >= 5)));
}

TEST_CASE("plugin.writeback.meminfo") {
  auto s = parse_meminfo("MemTotal: 100 kB\nDirty:   12 kB\nWriteback:  3 kB\n");
  REQUIRE(s);
  CHECK(s->dirty_bytes == 12 * 1024);
  CHECK(s->writeback_bytes == 3 * 1024);
  CHECK_FALSE(s->per_file);
  CHECK_FALSE(parse_meminfo("MemTotal: 1 kB\n"));
}

TEST_CASE("plugin.writeback.system_file_meminfo") {
  // The fallback a kernel before 6.5 gets, forced: the host-wide count, an upper bound of the
  // file's dirty pages.
  char path[] = "/var/tmp/qcommit-meminfo-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  SystemTargetFiles files(PageCacheSource::kMeminfo);
  auto f = files.open(path);
  REQUIRE(f);
  const std::vector<char> buf(32 << 20, 'x');
  REQUIRE(write(fd, buf.data(), buf.size()) == static_cast<ssize_t>(buf.size()));
  auto pc = f->page_cache();
  REQUIRE(pc);
  CHECK_FALSE(pc->per_file);
  CHECK(pc->dirty_bytes + pc->writeback_bytes >= (16u << 20));
  CHECK_FALSE(f->page_cache_in({0, buf.size()}).has_value());  // no per-range counts
  CHECK(f->start_settle());  // the fdatasync the governor runs back to back
  for (int i = 0; i < 500 && f->settling(); ++i) usleep(10000);
  CHECK_FALSE(f->settling());
  CHECK(parse_page_cache_source("meminfo") == PageCacheSource::kMeminfo);
  CHECK(parse_page_cache_source("auto") == PageCacheSource::kAuto);
  CHECK_FALSE(parse_page_cache_source("bdi").has_value());
  close(fd);
  unlink(path);
}

TEST_CASE("plugin.writeback.system_file") {
  // The real adapter on a real file: cachestat sees our dirty pages, writeback starts.
  char path[] = "/tmp/qcommit-wb-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  std::vector<char> buf(1 << 20, 'x');
  REQUIRE(write(fd, buf.data(), buf.size()) == static_cast<ssize_t>(buf.size()));
  SystemTargetFiles files;
  auto f = files.open(path);
  REQUIRE(f);
  CHECK(f->size() == buf.size());
  CHECK(f->device().has_value());
  auto pc = f->page_cache();
  REQUIRE(pc);
  CHECK(pc->dirty_bytes + pc->writeback_bytes > 0);
  f->start_writeback({0, buf.size()});
  fdatasync(fd);
  auto after = f->page_cache();
  REQUIRE(after);
  if (after->per_file) CHECK(after->dirty_bytes == 0);
  close(fd);
  unlink(path);
}

TEST_CASE("plugin.writeback.target_that_cannot_be_opened_is_said") {
  // A target the daemon cannot open (a unit's sandbox hiding /home, permissions): one note
  // naming it and why, instead of governing silently without its page cache.
  std::vector<std::string> notes;
  SystemTargetFiles files(PageCacheSource::kAuto,
                          [&](const std::string& s) { notes.push_back(s); });
  CHECK_FALSE(files.open("/nonexistent-qcommit-dir/base.qcow2"));
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].rfind("target /nonexistent-qcommit-dir/base.qcow2: cannot open it (No such file "
                       "or directory): ",
                       0) == 0);
}

TEST_CASE("plugin.writeback.block_device_is_its_own_storage") {
  // Two block device nodes in one directory (as LVs in /dev, all on devtmpfs) are two storages,
  // each its own device; a regular file beside them is its filesystem's.
  if (::geteuid() != 0) {
    MESSAGE("skipped: mknod needs root");
    return;
  }
  char dir[] = "/tmp/qcommit-blk-XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string a = std::string(dir) + "/lv-a", b = std::string(dir) + "/lv-b",
                    f = std::string(dir) + "/file";
  REQUIRE(::mknod(a.c_str(), S_IFBLK | 0600, makedev(7, 240)) == 0);
  REQUIRE(::mknod(b.c_str(), S_IFBLK | 0600, makedev(7, 241)) == 0);
  { std::ofstream(f) << "x"; }
  struct stat d {};
  REQUIRE(::stat(dir, &d) == 0);
  CHECK(cached_storage_device(a) == std::optional<std::uint64_t>(makedev(7, 240)));
  CHECK(cached_storage_device(b) == std::optional<std::uint64_t>(makedev(7, 241)));
  CHECK(cached_storage_device(f) == std::optional<std::uint64_t>(d.st_dev));
  const int fd = ::open(f.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  CHECK(target_device(fd) == std::optional<std::uint64_t>(d.st_dev));
  ::close(fd);
  // An open block device (the nodes above name no driver): a loop device's own number.
  { std::ofstream(f) << std::string(1 << 20, '\0'); }
  const std::string attach = "losetup -f --show " + f + " > " + dir + "/loop 2>/dev/null";
  if (std::system(attach.c_str()) == 0) {
    std::string loop;
    std::ifstream(std::string(dir) + "/loop") >> loop;
    struct stat st {};
    REQUIRE(::stat(loop.c_str(), &st) == 0);
    const int lfd = ::open(loop.c_str(), O_RDONLY | O_CLOEXEC);
    CHECK(lfd >= 0);
    if (lfd >= 0) {
      CHECK(target_device(lfd) == std::optional<std::uint64_t>(st.st_rdev));
      ::close(lfd);
    }
    CHECK(std::system(("losetup -d " + loop).c_str()) == 0);
  } else {
    MESSAGE("no loop device: the open block device is not checked");
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("plugin.writeback.commit_base_from_proc") {
  // A process holding the files as QEMU does during `--top mid2 --base mid`: the active layer
  // and mid read-write, mid2 and base read-only; its command name starts with "qemu".  Started
  // first, another holder of the active layer (as virtlockd is) that is not QEMU.  The chain
  // names mid through a symlink.
  char dir[] = "/tmp/qcommit-procfds-XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string d = dir;
  for (const char* n : {"active", "mid2", "mid", "base"}) {
    FILE* f = std::fopen((d + "/" + n).c_str(), "w");
    REQUIRE(f);
    std::fclose(f);
  }
  REQUIRE(symlink((d + "/mid").c_str(), (d + "/mid-link").c_str()) == 0);
  REQUIRE(symlink("/bin/sleep", (d + "/qemu-fake").c_str()) == 0);
  REQUIRE(symlink("/bin/sleep", (d + "/lockd-fake").c_str()) == 0);
  auto spawn = [&](const char* script) {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      execl("/bin/sh", "sh", "-c", script, "sh", d.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    return child;
  };
  const pid_t lockd = spawn("exec 3<>\"$1/active\"; exec \"$1/lockd-fake\" 30");
  usleep(50000);
  const pid_t qemu = spawn(
      "exec 3<>\"$1/active\" 4<\"$1/mid2\" 5<>\"$1/mid\" 6<\"$1/base\"; exec \"$1/qemu-fake\" 30");
  // Wait until the shell has exec'ed (the command name is set then).
  std::optional<std::string> base;
  for (int i = 0; i < 300 && !base; ++i) {
    base = commit_base_in_use(d + "/active", {d + "/mid2", d + "/mid-link", d + "/base"});
    if (!base) usleep(10000);
  }
  CHECK(writer_of(d + "/active") == qemu);
  CHECK(base == d + "/mid-link");
  CHECK_FALSE(commit_base_in_use(d + "/active", {d + "/mid2", d + "/base"}).has_value());
  CHECK_FALSE(writer_of(d + "/base").has_value());  // held, but read-only
  CHECK_FALSE(commit_base_in_use(d + "/nonexistent", {d + "/mid"}).has_value());
  for (pid_t p : {lockd, qemu}) {
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  // QEMU gone, the other holder gone: nobody.
  CHECK_FALSE(writer_of(d + "/active").has_value());
  for (const char* n : {"active", "mid2", "mid", "base", "mid-link", "qemu-fake", "lockd-fake"})
    unlink((d + "/" + n).c_str());
  rmdir(dir);
}

TEST_CASE("plugin.writeback.issued_ranges") {
  IssuedRanges r(3);
  r.add({0, 65536});
  r.add({65536, 65536});  // adjacent: merged
  REQUIRE(r.ranges().size() == 1);
  CHECK(r.ranges()[0] == ByteRange{0, 131072});
  r.add({1 << 20, 4096});
  r.add({2 << 20, 4096});
  r.add({3 << 20, 4096});  // past the cap: the last two are joined over the gap
  REQUIRE(r.ranges().size() == 3);
  CHECK(r.ranges()[2] == ByteRange{2 << 20, (1 << 20) + 4096});
  // Ranges with nothing left under writeback are dropped; the others are summed.
  // Ranges with nothing left under writeback are dropped (and reported clean when nothing in
  // them is dirty either); the others are summed.
  std::vector<ByteRange> clean;
  auto wb = r.under_writeback(
      [](const ByteRange& b) -> std::optional<PageCacheState> {
        if (b.offset == 0) return PageCacheState{0, 0, true};
        return PageCacheState{0, b.length / 2, true};
      },
      &clean);
  REQUIRE(wb);
  CHECK(*wb == 2048 + ((1 << 20) + 4096) / 2);
  CHECK(r.ranges().size() == 2);
  REQUIRE(clean.size() == 1);
  CHECK(clean[0] == ByteRange{0, 131072});
  // Written back but dirty again: dropped from the list, not reported clean.
  r.add({8 << 20, 4096});
  clean.clear();
  wb = r.under_writeback(
      [](const ByteRange& b) -> std::optional<PageCacheState> {
        return PageCacheState{b.offset == (8u << 20) ? 4096u : 0u, 0, true};
      },
      &clean);
  REQUIRE(wb);
  CHECK(*wb == 0);
  CHECK(r.ranges().empty());
  CHECK(clean.size() == 2);
  // A failed reading keeps the list.
  r.add({0, 4096});
  CHECK_FALSE(r.under_writeback([](const ByteRange&) { return std::optional<PageCacheState>{}; }));
  CHECK(r.ranges().size() == 1);
}

TEST_CASE("plugin.writeback.system_file_range") {
  // cachestat of one range on a real file: dirty pages of that range only.
  char path[] = "/tmp/qcommit-wbr-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  std::vector<char> buf(1 << 20, 'y');
  REQUIRE(pwrite(fd, buf.data(), buf.size(), 4 << 20) == static_cast<ssize_t>(buf.size()));
  SystemTargetFiles files;
  auto f = files.open(path);
  REQUIRE(f);
  auto in = f->page_cache_in({4 << 20, 1 << 20});
  // Dropping a clean range evicts it; dirty pages stay (checked below via cachestat).
  auto out = f->page_cache_in({0, 4 << 20});
  if (in) {  // kernels without cachestat(2) have no per-range reading
    CHECK(in->dirty_bytes + in->writeback_bytes > 0);
    REQUIRE(out);
    CHECK(out->dirty_bytes + out->writeback_bytes == 0);
    REQUIRE(fdatasync(fd) == 0);
    f->drop_cached({4 << 20, 1 << 20});
    unsigned char vec[256] = {};
    void* m = mmap(nullptr, 1 << 20, PROT_READ, MAP_SHARED, fd, 4 << 20);
    REQUIRE(m != MAP_FAILED);
    REQUIRE(mincore(m, 1 << 20, vec) == 0);
    int resident = 0;
    for (unsigned char v : vec) resident += v & 1;
    munmap(m, 1 << 20);
    CHECK(resident == 0);  // written, clean, dropped: no longer cached
  }
  close(fd);
  unlink(path);
}

TEST_CASE("plugin.writeback.planner_reports_a_lap") {
  WritebackPlanner p;
  const WritebackInput in{64ull << 20, 0, 1 << 20};
  const WritebackPlan clean = p.plan(in, [](const ByteRange&) { return std::uint64_t{0}; });
  CHECK(clean.lapped);
  CHECK(clean.ranges.empty());
  // Dirty everywhere: the window fills long before a lap.
  const WritebackPlan dirty = p.plan(in, [](const ByteRange& r) { return r.length; });
  CHECK_FALSE(dirty.lapped);
  CHECK(dirty.dirty_bytes_issued <= (1u << 20));
}

TEST_CASE("plugin.writeback.system_probe_file") {
  // The shared-queue probe beside a real file: a write + fdatasync in the background that leaves
  // no file behind and reports its latency once.
  char dir[] = "/tmp/qcommit-probe-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string target = std::string(dir) + "/base.qcow2";
  const int fd = ::open(target.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  close(fd);
  SystemTargetFiles files;
  ProbeOpening opened = files.open_probe(target);
  REQUIRE(opened.file);
  CHECK(opened.why_not.empty());
  std::unique_ptr<ProbeFile> probe = std::move(opened.file);
  CHECK_FALSE(probe->take().has_value());  // none started
  REQUIRE(probe->start());
  for (int i = 0; i < 5000 && probe->busy(); ++i) usleep(1000);
  REQUIRE_FALSE(probe->busy());
  const auto latency = probe->take();
  REQUIRE(latency.has_value());
  CHECK(*latency > std::chrono::nanoseconds::zero());
  CHECK_FALSE(probe->take().has_value());  // reported once
  CHECK(probe->failure().empty());
  // Nothing but the target in the directory: the probe file was unlinked when opened.
  const std::string listing = "ls -A " + std::string(dir) + " | wc -l";
  FILE* p = popen(listing.c_str(), "r");
  REQUIRE(p);
  int entries = -1;
  CHECK(fscanf(p, "%d", &entries) == 1);
  pclose(p);
  CHECK(entries == 1);
  // No probe where the target is not a regular file (a block device's node in /dev), and each
  // refusal says why, naming the file.
  const ProbeOpening of_dir = files.open_probe(dir);
  CHECK_FALSE(of_dir.file);
  CHECK(of_dir.why_not == "the target " + std::string(dir) +
                              " is not a regular file (a probe file elsewhere would measure "
                              "other storage)");
  const ProbeOpening missing = files.open_probe("/nonexistent/base.qcow2");
  CHECK_FALSE(missing.file);
  CHECK(missing.why_not ==
        "cannot stat the target /nonexistent/base.qcow2: No such file or directory");
  probe.reset();
  unlink(target.c_str());
  rmdir(dir);
}

TEST_CASE("plugin.writeback.commit_extents_of_layers") {
  // What a non-active commit of two qcow2 layers copies: the union of what each has of its own
  // (qemu-img/qemu-io made), merged; a raw layer cannot be read as qcow2: no answer.
  using qcommit::plugin::run_process;
  char tmpl[] = "/tmp/qcommit-extents-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  const std::string base = dir + "/base.raw", mid = dir + "/mid.qcow2", top = dir + "/top.qcow2";
  auto ok = [](std::vector<std::string> argv) {
    return run_process(std::move(argv)).exit_code == 0;
  };
  REQUIRE(ok({"qemu-img", "create", "-q", "-f", "raw", base, "64M"}));
  REQUIRE(ok({"qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", base, mid}));
  REQUIRE(ok({"qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", mid, top}));
  REQUIRE(ok({"qemu-io", "-c", "write 512K 1536K", mid}));
  REQUIRE(ok({"qemu-io", "-c", "write 0 1M", "-c", "write -z 3M 1M", "-c", "write 60M 64K", top}));
  qcommit::plugin::SystemTargetFiles files;
  const auto e = files.commit_extents({top, mid});
  REQUIRE(e);
  const std::vector<ByteRange> want{{0, 2u << 20}, {3u << 20, 1u << 20}, {60u << 20, 64u << 10}};
  CHECK(*e == want);
  CHECK_FALSE(files.commit_extents({top, base}));
  std::filesystem::remove_all(dir);
}

TEST_CASE("plugin.writeback.storage_kind") {
  // The filesystem table itself is tested in tests/engine/test_storage_kind.cpp.
  // Real files: /dev/shm is tmpfs (local); a path that does not exist cannot be told.
  SystemTargetFiles files;
  const std::optional<StorageKind> shm = files.storage_kind("/dev/shm");
  REQUIRE(shm.has_value());
  CHECK(shm->fs == "tmpfs");
  CHECK_FALSE(shm->shared);
  CHECK_FALSE(files.storage_kind("/nonexistent/base.qcow2").has_value());
}
