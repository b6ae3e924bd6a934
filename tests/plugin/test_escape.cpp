// SPDX-License-Identifier: GPL-2.0-or-later
// Jobs that escaped governance (plugin/govern/escape.h): found, reported, held at the floor until
// their target is written out to the window, and then -- not before -- their storage's dirty
// pages bounded in the kernel (plugin/govern/bdi_limit.h) in a sysfs tree of the test's own,
// restored at the job's release, at release_all and by the next Governor after a crash.
#include <doctest/doctest.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "plugin/daemon/control.h"
#include "plugin/govern/bdi_limit.h"
#include "plugin/govern/escape.h"
#include "plugin/govern/governor.h"
#include "plugin/host/json.h"
#include "tests/plugin/world.h"

namespace qcommit::plugin::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr std::uint64_t kMiB = 1024 * 1024;
// The fake target's device (FakeFileState::device 7): an anonymous device, as FUSE and NFS have.
const std::string kFakeBdi = "0:7";
// What Linux 6.18 shows for a bdi with default settings on a 24 GiB host (20 % of it).
constexpr std::uint64_t kDefaultMaxBytes = 4973391872;

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// A temporary directory with a sysfs tree below `sys` and a runtime directory `run`.
struct TempTree {
  fs::path root;
  TempTree() {
    std::string tmpl = (fs::temp_directory_path() / "qcommit-bdi-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    root = tmpl;
    fs::create_directories(root / "sys" / "class" / "bdi");
    fs::create_directories(root / "run");
  }
  ~TempTree() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  TempTree(const TempTree&) = delete;
  TempTree& operator=(const TempTree&) = delete;
  [[nodiscard]] fs::path sys() const { return root / "sys"; }
  [[nodiscard]] fs::path state() const { return root / "run" / "bdi-limits"; }
  [[nodiscard]] fs::path attr(const std::string& bdi, const std::string& a) const {
    return sys() / "class" / "bdi" / bdi / a;
  }
  // A bdi with the kernel's defaults (Linux >= 6.2 attributes).
  void add_bdi(const std::string& name, const fs::path& dir) const {
    for (const auto& [a, v] :
         std::map<std::string, std::string>{{"strict_limit", "0\n"},
                                            {"max_bytes", std::to_string(kDefaultMaxBytes) + "\n"},
                                            {"max_ratio", "100\n"},
                                            {"max_ratio_fine", "1000000\n"},
                                            {"min_ratio", "0\n"}})
      put(dir / a, v);
    fs::create_directory_symlink(fs::relative(dir, sys() / "class" / "bdi"),
                                 sys() / "class" / "bdi" / name);
  }
  void add_virtual_bdi(const std::string& name) const {
    add_bdi(name, sys() / "devices" / "virtual" / "bdi" / name);
  }
  [[nodiscard]] std::string value(const std::string& bdi, const std::string& a) const {
    std::string s = slurp(attr(bdi, a));
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  // Every file below the tree with its contents.
  [[nodiscard]] std::map<std::string, std::string> snapshot() const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(root))
      if (e.is_regular_file() && !e.is_symlink()) out[e.path().string()] = slurp(e.path());
    return out;
  }
};

GovernorOptions escape_options(const TempTree& t, std::vector<std::string>& notices, World& w) {
  GovernorOptions opt;
  opt.clock = [&w] { return w.now; };
  opt.sysfs_root = t.sys().string();
  opt.bdi_state_path = t.state().string();
  opt.notice = [&notices](const std::string& m) { notices.push_back(m); };
  return opt;
}

std::size_t count_with(const std::vector<std::string>& lines, const std::string& part) {
  return static_cast<std::size_t>(std::count_if(lines.begin(), lines.end(), [&](const auto& l) {
    return l.find(part) != std::string::npos;
  }));
}

// A world whose job started while the daemon was down: 1 GiB copied and `dirty` bytes of it still
// in BASE's page cache, on 50 MB/s storage.
void escaped_world(World& w, std::uint64_t dirty) {
  w.storage_bytes_per_s = 50e6;
  w.start_job(JobType::ActiveCommit);
  w.hv.jobs[{"vm1", "vda"}].cur = 1ull << 30;
  w.base->dirty = dirty;
}

// Runs `gv` until its one job, escaped and held, is back within its window (at most 30 s);
// whether it got there.
bool run_until_back_within_window(Governed& gv, World& w) {
  for (Duration ran = 0s; ran < 30s; ran += 500ms) {
    gv.run(500ms);
    if (!gv.g.status(w.now).jobs.at(0).escape_held) return true;
  }
  return false;
}

}  // namespace

// Adopted with 200 MiB of BASE dirty (its window is well under 1 MiB): reported escaped with
// the bytes and the storage time they stand for, in status, its JSON and the log; held at the
// minimum speed until its target is down to the window, not merely to the dirty allowance the
// hold-at-floor path gives a governed job; its storage's bdi left alone while the backlog drains
// (a strict limit below it would throttle every writer of the storage), limited from the moment
// the target is back within its window (the state recorded first) and restored when it ends.
TEST_CASE("plugin.governor.escaped_job_held_and_its_storage_limited") {
  TempTree t;
  t.add_virtual_bdi(kFakeBdi);
  World w;
  constexpr std::uint64_t kDirty = 200 * kMiB;
  escaped_world(w, kDirty);
  std::vector<std::string> notices;
  Governed gv(w, DaemonConfig{}, escape_options(t, notices, w));
  gv.run(150ms);

  GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  const JobStatus& j = st.jobs[0];
  CHECK(j.escaped);
  CHECK(j.escape_held);
  CHECK(j.escaped_bytes >= kDirty - 2 * kMiB);  // what the storage drained before the tick
  CHECK(j.escaped_bytes <= kDirty);
  REQUIRE(j.escape_cost.has_value());
  // At the drain rate the job knows at its first tick: the controller's initial rate.
  const double initial = Policy{}.controller_config().initial_rate_bytes_per_s;
  CHECK(std::chrono::duration<double>(*j.escape_cost).count() ==
        doctest::Approx(static_cast<double>(j.escaped_bytes) / initial).epsilon(0.01));
  CHECK(w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s == kMinJobSpeedBytesPerS);
  // The log: once, naming the domain, disk, MiB, seconds and what is done.
  REQUIRE(count_with(notices, "escaped governance") == 1);
  const std::string line = *std::find_if(notices.begin(), notices.end(), [](const auto& l) {
    return l.find("escaped governance") != std::string::npos;
  });
  CAPTURE(line);
  CHECK(line.rfind("domain vm1 disk vda: escaped governance: ", 0) == 0);
  CHECK(line.find(" MiB of /pool/vm1-base.qcow2 dirty or under writeback") != std::string::npos);
  CHECK(line.find(" s of storage at 4.0 MiB/s") != std::string::npos);
  CHECK(line.find("held at the minimum speed") != std::string::npos);
  CHECK(line.find("; kernel dirty limit pending: set once the target is within its window") !=
        std::string::npos);
  // Status JSON (qcommit status).
  std::optional<json::Value> doc =
      json::parse(status_json(st, w.now), json::kControlResponseLimits, nullptr);
  REQUIRE(doc.has_value());
  const json::Value& jj = (*doc)["jobs"][0];
  CHECK(jj["escaped"].get<bool>());
  CHECK(jj["escaped_bytes"].get<std::uint64_t>() == j.escaped_bytes);
  CHECK(jj["escape_cost_s"].get<double>() ==
        doctest::Approx(std::chrono::duration<double>(*j.escape_cost).count()));
  CHECK(jj["escape_held"].get<bool>());
  CHECK(jj["bdi_limit"].get<std::string>() == j.bdi_limit);
  // No kernel limit while ~200 MiB of the storage are dirty: nothing changed, nothing recorded.
  CHECK(j.bdi_limit.empty());
  CHECK(t.value(kFakeBdi, "strict_limit") == "0");
  CHECK(t.value(kFakeBdi, "max_bytes") == std::to_string(kDefaultMaxBytes));
  CHECK_FALSE(fs::exists(t.state()));

  // Held at the floor until BASE's dirty + writeback is within the window: the first speed
  // above the floor comes only then, and the storage is not limited before it.
  std::optional<std::uint64_t> total_at_release, window_at_release;
  bool limited_while_held = false;
  gv.run(30s, [&] {
    if (total_at_release) return;
    if (w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s == kMinJobSpeedBytesPerS) {
      if (gv.g.status(w.now).jobs.at(0).escape_held && t.value(kFakeBdi, "strict_limit") != "0")
        limited_while_held = true;
      return;
    }
    total_at_release = w.base->dirty + w.base->writeback;
    window_at_release = gv.g.status(w.now).jobs.at(0).window_bytes;
  });
  CHECK_FALSE(limited_while_held);
  REQUIRE(total_at_release.has_value());
  CHECK(*total_at_release <= *window_at_release);
  st = gv.g.status(w.now);
  CHECK(st.jobs.at(0).escaped);
  CHECK_FALSE(st.jobs.at(0).escape_held);
  CHECK(count_with(notices, "escaped governance") == 1);
  REQUIRE(count_with(notices, "domain vm1 disk vda: escaped job back within its window after ") ==
          1);
  const std::string back = *std::find_if(notices.begin(), notices.end(), [](const auto& l) {
    return l.find("escaped job back within its window") != std::string::npos;
  });
  CAPTURE(back);
  CHECK(back.find("; kernel dirty limit on: bdi 0:7: max_bytes ") != std::string::npos);
  CHECK(st.jobs.at(0).bdi_limit.rfind("on: bdi 0:7: max_bytes ", 0) == 0);

  // The kernel limit, from then until the job ends: strict, max_bytes twice (window + dirty
  // allowance), recorded first.
  CHECK(t.value(kFakeBdi, "strict_limit") == "1");
  const std::uint64_t max_bytes = std::stoull(t.value(kFakeBdi, "max_bytes"));
  CHECK(max_bytes >= 2 * kDirtyAllowanceBytes);
  CHECK(max_bytes <= 2 * (kDirtyAllowanceBytes + 1 * kMiB));
  CHECK(slurp(t.state()).find("bdi=0:7 strict_limit=0 max_ratio_fine=1000000") !=
        std::string::npos);
  put(t.attr(kFakeBdi, "max_ratio_fine"), "6700\n");  // the kernel's ratio for that max_bytes

  // The job ends: the bdi gets its attributes back, the record goes.
  w.hv.jobs.erase({"vm1", "vda"});
  JobEvent done;
  done.kind = JobEventKind::Completed;
  done.domain = "vm1";
  done.disk = "vda";
  w.hv.emit(done);
  gv.run(100ms);
  CHECK(gv.g.job_count() == 0);
  CHECK(t.value(kFakeBdi, "strict_limit") == "0");
  CHECK(t.value(kFakeBdi, "max_ratio_fine") == "1000000");
  CHECK_FALSE(fs::exists(t.state()));
  CHECK(count_with(notices,
                   "bdi 0:7: dirty limit restored: max_ratio_fine 1000000, "
                   "strict_limit 0") == 1);
}

// A graceful stop (release_all) restores the limit too.
TEST_CASE("plugin.governor.escaped_limit_restored_at_release_all") {
  TempTree t;
  t.add_virtual_bdi(kFakeBdi);
  World w;
  escaped_world(w, 200 * kMiB);
  std::vector<std::string> notices;
  Governed gv(w, DaemonConfig{}, escape_options(t, notices, w));
  gv.run(150ms);
  REQUIRE(t.value(kFakeBdi, "strict_limit") == "0");  // held; limited once back within its window
  REQUIRE(run_until_back_within_window(gv, w));
  REQUIRE(t.value(kFakeBdi, "strict_limit") == "1");
  put(t.attr(kFakeBdi, "max_ratio_fine"), "6700\n");
  gv.g.release_all();
  CHECK(t.value(kFakeBdi, "strict_limit") == "0");
  CHECK(t.value(kFakeBdi, "max_ratio_fine") == "1000000");
  CHECK_FALSE(fs::exists(t.state()));
}

// With kernel limits off (qcommitd --bdi-limit off) an escaped job is held, and no bdi attribute
// is touched.
TEST_CASE("plugin.governor.escaped_without_bdi_limits") {
  TempTree t;
  t.add_virtual_bdi(kFakeBdi);
  const std::map<std::string, std::string> before = t.snapshot();
  World w;
  escaped_world(w, 200 * kMiB);
  std::vector<std::string> notices;
  GovernorOptions opt = escape_options(t, notices, w);
  opt.bdi_limits = false;
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(150ms);
  const GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].escaped);
  CHECK(st.jobs[0].escape_held);
  CHECK(st.jobs[0].bdi_limit.empty());
  CHECK(w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s == kMinJobSpeedBytesPerS);
  CHECK(t.snapshot() == before);
}

// The daemon dies with the limit set: the next Governor with the same state path restores it
// when it starts, and says so.
TEST_CASE("plugin.governor.escaped_limit_restored_after_a_crash") {
  TempTree t;
  t.add_virtual_bdi(kFakeBdi);
  std::map<std::string, std::string> at_crash;
  {
    World w;
    escaped_world(w, 200 * kMiB);
    std::vector<std::string> notices;
    Governed gv(w, DaemonConfig{}, escape_options(t, notices, w));
    gv.run(150ms);
    REQUIRE(t.value(kFakeBdi, "strict_limit") == "0");
    REQUIRE(run_until_back_within_window(gv, w));
    REQUIRE(t.value(kFakeBdi, "strict_limit") == "1");
    put(t.attr(kFakeBdi, "max_ratio_fine"), "6700\n");
    REQUIRE(fs::exists(t.state()));
    at_crash = t.snapshot();  // what a process killed here leaves behind
  }
  for (const auto& [path, text] : at_crash) put(path, text);  // as if it never cleaned up
  REQUIRE(t.value(kFakeBdi, "strict_limit") == "1");
  World w;
  std::vector<std::string> notices;
  Governed gv(w, DaemonConfig{}, escape_options(t, notices, w));
  // Nothing is restored before the daemon owns its control socket (a second qcommitd started
  // by mistake must not undo the running one's limits) ...
  CHECK(t.value(kFakeBdi, "strict_limit") == "1");
  CHECK(fs::exists(t.state()));
  // ... and all of it once it does.
  gv.g.restore_recorded_limits();
  CHECK(t.value(kFakeBdi, "strict_limit") == "0");
  CHECK(t.value(kFakeBdi, "max_ratio_fine") == "1000000");
  CHECK_FALSE(fs::exists(t.state()));
  CHECK(count_with(notices,
                   "bdi 0:7: dirty limit restored: max_ratio_fine 1000000, "
                   "strict_limit 0 (left by a previous qcommitd)") == 1);
}

// The daemon dies with a limit set on a FUSE mount's bdi; the mount goes, and a new one gets the
// same anonymous device number (bdi "0:45" again) with its owner's own settings.  The next daemon
// leaves the new device as it is and says why; the record is removed.
TEST_CASE("plugin.bdi.record_not_applied_to_a_later_device_of_the_same_number") {
  TempTree t;
  t.add_virtual_bdi("0:45");
  std::map<std::string, std::string> at_crash;
  {
    BdiLimits limits(BdiSysfs(t.sys().string()), t.state().string());
    REQUIRE(limits.limit(1, makedev(0, 45), 64 * kMiB).on);
    REQUIRE(t.value("0:45", "strict_limit") == "1");
    at_crash = t.snapshot();
  }
  for (const auto& [path, text] : at_crash) put(path, text);  // as if it never cleaned up
  // The mount goes; a new one registers bdi 0:45 (the old directory goes last, so the new one
  // cannot be given its inode) and its owner sets it up.
  const fs::path dev_dir = t.sys() / "devices" / "virtual" / "bdi";
  fs::rename(dev_dir / "0:45", dev_dir / "gone");
  fs::remove(t.sys() / "class" / "bdi" / "0:45");
  t.add_virtual_bdi("0:45");
  fs::remove_all(dev_dir / "gone");
  put(t.attr("0:45", "strict_limit"), "1\n");
  put(t.attr("0:45", "max_ratio_fine"), "5000\n");
  BdiLimits next(BdiSysfs(t.sys().string()), t.state().string());
  const std::vector<std::string> lines = next.restore_recorded();
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] ==
        "bdi 0:45: dirty limit not restored: the device it was set on is gone (0:45 now names "
        "another device); left as it is (left by a previous qcommitd)");
  CHECK(t.value("0:45", "strict_limit") == "1");
  CHECK(t.value("0:45", "max_ratio_fine") == "5000");
  CHECK_FALSE(fs::exists(t.state()));
}

// A job adopted in time never holds more than its window plus a burst: not escaped, no bdi
// attribute touched, no record.  When its target runs away later (QEMU copied 300 MiB at page
// cache speed between two ticks, as a job whose speed QEMU dropped would), the next tick finds
// the escape; its storage is limited once the target is written out to its window again.
TEST_CASE("plugin.governor.job_governed_in_time_escapes_only_when_it_runs_away") {
  TempTree t;
  t.add_virtual_bdi(kFakeBdi);
  const std::map<std::string, std::string> before = t.snapshot();
  World w;
  w.storage_bytes_per_s = 50e6;
  std::vector<std::string> notices;
  Governed gv(w, DaemonConfig{}, escape_options(t, notices, w));
  gv.run(200ms);
  w.start_job(JobType::ActiveCommit);
  gv.run(5s);
  GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(w.cur() > 20 * kMiB);  // it copied at a governed speed meanwhile
  CHECK_FALSE(st.jobs[0].escaped);
  CHECK(st.jobs[0].escaped_bytes == 0);
  CHECK_FALSE(st.jobs[0].escape_cost.has_value());
  CHECK(st.jobs[0].bdi_limit.empty());
  CHECK(count_with(notices, "escape") == 0);
  CHECK(t.snapshot() == before);

  constexpr std::uint64_t kBurst = 300 * kMiB;
  w.hv.jobs[{"vm1", "vda"}].cur += kBurst;
  w.base->dirty += kBurst;
  gv.run(150ms);
  st = gv.g.status(w.now);
  CHECK(st.jobs.at(0).escaped);
  CHECK(st.jobs.at(0).escape_held);
  CHECK(st.jobs.at(0).escaped_bytes >= kBurst - 10 * kMiB);
  CHECK(count_with(notices, "domain vm1 disk vda: escaped governance: ") == 1);
  CHECK(t.value(kFakeBdi, "strict_limit") == "0");
  CHECK(w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s == kMinJobSpeedBytesPerS);
  REQUIRE(run_until_back_within_window(gv, w));
  CHECK(t.value(kFakeBdi, "strict_limit") == "1");
}

// Where a device's bdi is: a filesystem without a block device by its own number, a whole disk
// through its `bdi` link, a partition through its disk's; a device with none is said.
TEST_CASE("plugin.bdi.found_in_sysfs_layouts") {
  TempTree t;
  t.add_virtual_bdi("0:45");
  t.add_virtual_bdi("8:0");
  t.add_virtual_bdi("254:0");
  const fs::path sda = t.sys() / "devices" / "pci0000:00" / "block" / "sda";
  const fs::path vda = t.sys() / "devices" / "pci0000:00" / "virtio1" / "block" / "vda";
  fs::create_directories(sda / "sda1");
  put(sda / "sda1" / "partition", "1\n");
  fs::create_directories(vda);
  fs::create_directory_symlink(fs::relative(t.sys() / "devices/virtual/bdi/8:0", sda), sda / "bdi");
  fs::create_directory_symlink(fs::relative(t.sys() / "devices/virtual/bdi/254:0", vda),
                               vda / "bdi");
  fs::create_directories(t.sys() / "dev" / "block");
  const fs::path blk = t.sys() / "dev" / "block";
  fs::create_directory_symlink(fs::relative(sda, blk), blk / "8:0");
  fs::create_directory_symlink(fs::relative(sda / "sda1", blk), blk / "8:1");
  fs::create_directory_symlink(fs::relative(vda, blk), blk / "254:0");
  const BdiSysfs sysfs(t.sys().string());
  std::string why;
  CHECK(sysfs.find(makedev(0, 45), why) == std::optional<std::string>("0:45"));
  CHECK(sysfs.find(makedev(8, 0), why) == std::optional<std::string>("8:0"));
  CHECK(sysfs.find(makedev(8, 1), why) == std::optional<std::string>("8:0"));
  CHECK(sysfs.find(makedev(254, 0), why) == std::optional<std::string>("254:0"));
  CHECK_FALSE(sysfs.find(makedev(0, 46), why).has_value());
  CHECK(why.find("0:46") != std::string::npos);
}

// A bdi already as tight is left alone (nothing to restore, no record); a kernel before 6.2 (no
// max_bytes) and a bdi that cannot be found give "off: why" and change nothing; a second job on
// the same bdi shares the limit, which the last release restores; a request below the minimum
// gets the minimum.
TEST_CASE("plugin.bdi.limits_shared_refused_and_minimum") {
  TempTree t;
  t.add_virtual_bdi("0:45");
  t.add_virtual_bdi("0:50");
  t.add_virtual_bdi("0:60");
  put(t.attr("0:50", "strict_limit"), "1\n");  // FUSE's defaults: strict, 1 %
  put(t.attr("0:50", "max_bytes"), "49733918\n");
  fs::remove(t.attr("0:60", "max_bytes"));  // Linux 6.1
  {
    BdiLimits limits(BdiSysfs(t.sys().string()), t.state().string());
    const auto before = t.snapshot();
    BdiLimits::Outcome o = limits.limit(1, makedev(0, 50), 64 * kMiB);
    CHECK(o.on);
    CHECK(o.text == "on: bdi 0:50 limited already: max_bytes 47.4 MiB, strict_limit 1");
    o = limits.limit(2, makedev(0, 60), 64 * kMiB);
    CHECK_FALSE(o.on);
    CHECK(o.text.rfind("off: bdi 0:60 has no per-bdi byte limit (Linux 6.2 and later)", 0) == 0);
    o = limits.limit(3, makedev(0, 99), 64 * kMiB);
    CHECK_FALSE(o.on);
    CHECK(o.text.find("0:99") != std::string::npos);
    CHECK(t.snapshot() == before);

    o = limits.limit(4, makedev(0, 45), 1 * kMiB);
    CHECK(o.on);
    CHECK(t.value("0:45", "max_bytes") == std::to_string(kMinBdiMaxBytes));
    CHECK(limits.limit(5, makedev(0, 45), 1 * kMiB).text == o.text);
    CHECK(limits.release(4).empty());
    CHECK(t.value("0:45", "strict_limit") == "1");
    CHECK(limits.release(5).size() == 1);
    CHECK(t.value("0:45", "strict_limit") == "0");
    CHECK_FALSE(fs::exists(t.state()));
    // Limited again, then the object goes: what it holds is restored.
    CHECK(limits.limit(6, makedev(0, 45), 64 * kMiB).on);
    CHECK(t.value("0:45", "strict_limit") == "1");
  }
  CHECK(t.value("0:45", "strict_limit") == "0");
  CHECK_FALSE(fs::exists(t.state()));
}

// The state file's round trip; lines that do not parse (a bdi name that is a path, an unknown
// attribute) are skipped.
TEST_CASE("plugin.bdi.state_file_round_trip") {
  const std::vector<BdiSaved> saved{{"0:45", 0, "max_ratio_fine", 1000000, 4711},
                                    {"8:0", std::nullopt, "max_ratio", 100, std::nullopt},
                                    {"254:0", 0, "max_ratio_fine", std::nullopt, 12}};
  const std::vector<BdiSaved> back = parse_bdi_state(format_bdi_state(saved));
  REQUIRE(back.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(back[i].bdi == saved[i].bdi);
    CHECK(back[i].strict_limit == saved[i].strict_limit);
    CHECK(back[i].ratio_attr == saved[i].ratio_attr);
    CHECK(back[i].ratio == saved[i].ratio);
    CHECK(back[i].instance == saved[i].instance);
  }
  // A record from before the instance was kept still restores.
  REQUIRE(parse_bdi_state("bdi=0:45 strict_limit=0 max_ratio=100\n").size() == 1);
  CHECK(parse_bdi_state("bdi=0:45 strict_limit=0 max_ratio=100 instance=x\n").empty());
  CHECK(parse_bdi_state("bdi=0:45 strict_limit=0 max_ratio=100 instance=1 more\n").empty());
  // A later version's key is skipped; the record still restores.
  const std::vector<BdiSaved> later =
      parse_bdi_state("bdi=0:45 strict_limit=0 max_ratio=100 device_id=9 instance=7\n");
  REQUIRE(later.size() == 1);
  CHECK(later[0].instance == std::optional<std::uint64_t>(7));
  CHECK(parse_bdi_state("bdi=../../x strict_limit=0 max_ratio=1\n").empty());
  CHECK(parse_bdi_state("bdi=0:45 strict_limit=0 min_ratio=1\n").empty());
  CHECK(parse_bdi_state("bdi=0:45 strict_limit=x max_ratio=1\n").empty());
}

}  // namespace qcommit::plugin::test
