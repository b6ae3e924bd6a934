// SPDX-License-Identifier: GPL-2.0-or-later
// merge.kill_points: engine::merge stopped at every write it makes, then the same merge run again.
//
// Each scenario is a chain made with qemu-img/qemu-io. For k = 1, 2, ... a fresh copy of it is
// merged in a child process whose MergeOptions::on_write_point hook _exit()s right before the
// k-th write (data, grow, window commit, each qcow2 persistence point, checkpoint, rebase,
// delete), until a run finishes without reaching point k. After every stop, judged with qemu-img:
//   - TOP's guest view and every child's are what they were before the merge (while they exist);
//   - `qemu-img check` finds no corruption in BASE (leaks allowed);
// then the same merge runs again (in this process) and must report that it resumed whenever the
// stopped run left a checkpoint, and end with BASE showing TOP's original view, `qemu-img check`
// clean, children on BASE with their views unchanged, merged layers deleted with --delete.
// A process stop keeps the page cache: power loss between flushes is covered by merge.crash_*.
// With QCOMMIT_DATA_POINT_STRIDE=N (ctest: 4) the matrix stops at every point but the data writes
// inside a window, of which it takes the first, the last and every Nth (points_to_visit).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/merge.h"
#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/image.h"

namespace qcommit::test {
namespace {

namespace fs = std::filesystem;
constexpr int kStoppedExit = 77;

// Runs a shell command; returns its exit status.
int sh(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

void must(const std::string& cmd) {
  REQUIRE_MESSAGE(sh(cmd) == 0, cmd);
}

struct Scenario {
  std::string name;
  std::string setup;  // shell, run in the scenario's directory
  std::string top = "top.qcow2";
  std::optional<std::string> base;    // --base
  std::string base_file;              // the file BASE is
  std::vector<std::string> children;  // --rebase
  std::vector<std::string> merged;    // TOP and intermediates (deleted with --delete)
  bool delete_merged = false;
  // BASE has leaked clusters before the merge (a stale bitmaps extension's): the merge need not
  // repair them (a resumed run does), but never leaves more.
  uint64_t leaks_before = 0;
  // Run on BASE's file after each stop, before the re-run.
  std::function<void(const std::string& base_path)> after_stop = nullptr;
};

engine::MergeOptions options_for(const Scenario& s, const std::string& dir) {
  engine::MergeOptions o;
  o.top = dir + "/" + s.top;
  if (s.base) o.base = dir + "/" + *s.base;
  for (const auto& c : s.children) o.rebase.push_back(dir + "/" + c);
  o.delete_merged = s.delete_merged;
  o.window_bytes = engine::kChunkBytes;  // many windows, so many commits and checkpoints
  o.io_threads = 2;
  return o;
}

// How a merge run in a child process ended: the name of the write point `k` it reached ("" if it
// finished first) and its exit status.
struct ChildRun {
  std::string point;
  int status = 0;
};

// Runs the merge in a child process. Its on_write_point hook tells the parent the name of the
// k-th write point, then calls at_point (which may end the process); the merge's own outcome is
// mapped to an exit status by on_error (an exception) or is 0 (finished).
template <class AtPoint, class OnError>
ChildRun run_in_child(const Scenario& s, const std::string& dir, int k, AtPoint at_point,
                      OnError on_error) {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    engine::MergeOptions o = options_for(s, dir);
    int seen = 0;
    o.on_write_point = [&](std::string_view name) {
      if (++seen != k) return;
      (void)!::write(pipefd[1], name.data(), name.size());
      at_point();
    };
    try {
      (void)engine::merge(o);
    } catch (const std::exception& e) {
      ::_exit(on_error(std::string(e.what())));
    }
    ::_exit(0);
  }
  ::close(pipefd[1]);
  char buf[64] = {};
  const ssize_t n = ::read(pipefd[0], buf, sizeof buf - 1);
  ::close(pipefd[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return {std::string(buf, size_t(std::max<ssize_t>(n, 0))), WEXITSTATUS(status)};
}

// Stops the merge right before write point `k` in a child process. Returns the name of the point
// it stopped at, or "" if the merge finished first.
std::string run_stopped_at(const Scenario& s, const std::string& dir, int k) {
  const ChildRun r = run_in_child(
      s, dir, k, [] { ::_exit(kStoppedExit); },
      [](const std::string& msg) {
        std::fprintf(stderr, "merge failed: %s\n", msg.c_str());
        return 2;
      });
  if (r.status == 0) return "";
  REQUIRE_MESSAGE(r.status == kStoppedExit, "the stopped merge failed on its own");
  return r.point;
}

// The write points, in order, of an uninterrupted merge of a copy of the scenario's chain `orig`
// made in `dir`.
std::vector<std::string> write_points_of(const Scenario& s, const std::string& orig,
                                         const std::string& dir) {
  must("cp -a --sparse=always " + orig + " " + dir);
  engine::MergeOptions o = options_for(s, dir);
  std::vector<std::string> names;
  o.on_write_point = [&names](std::string_view name) { names.emplace_back(name); };
  (void)engine::merge(o);
  return names;
}

// QCOMMIT_DATA_POINT_STRIDE (ctest: 4; unset: 1).
int data_point_stride() {
  const char* v = std::getenv("QCOMMIT_DATA_POINT_STRIDE");
  const int n = v ? std::atoi(v) : 1;
  return n > 1 ? n : 1;
}

// Which write points k (1-based) a matrix stops at, given the points of an uninterrupted run:
// every point that is not "data"; of each run of consecutive "data" points (the copy of one
// window) the first, the last and every `stride`th between them; then one past the last point,
// where the merge must finish. Stride 1: every point. The data points of one window differ only in
// which of the window's pieces are on the storage when the merge stops; the re-run copies the
// whole window again from its checkpoint either way.
std::vector<int> points_to_visit(const std::vector<std::string>& names, int stride) {
  std::vector<int> ks;
  size_t run_start = 0;  // where the run of data points that i is in began
  for (size_t i = 0; i < names.size(); ++i) {
    const bool data = names[i] == "data";
    if (!data || i == 0 || names[i - 1] != "data") run_start = i;
    const bool last = data && (i + 1 == names.size() || names[i + 1] != "data");
    if (!data || last || (i - run_start) % size_t(stride) == 0) ks.push_back(int(i) + 1);
  }
  ks.push_back(int(names.size()) + 1);
  return ks;
}

// The points chosen are those of the uninterrupted run: a stopped run must reach the same one.
void check_same_point(const std::vector<std::string>& names, int k, const std::string& where,
                      const std::string& scenario) {
  if (k <= static_cast<int>(names.size()))
    CHECK_MESSAGE(where == names[static_cast<size_t>(k - 1)],
                  scenario << ": write point #" << k << " is " << where
                           << ", the uninterrupted run's was " << names[static_cast<size_t>(k - 1)]);
}

// The k of a matrix's i-th run: the visited points, and past them (a run that did not finish
// where the uninterrupted one did) every point in turn.
int kth_point(const std::vector<int>& ks, size_t i) {
  return i < ks.size() ? ks[i] : ks.back() + int(i - ks.size()) + 1;
}

// Saves the guest views (raw) of TOP and the children before any merge.
void save_views(const Scenario& s, const std::string& dir) {
  must("cd " + dir + " && qemu-img convert -U -O raw " + s.top + " view-top.raw");
  for (const auto& c : s.children)
    must("cd " + dir + " && qemu-img convert -U -O raw " + c + " view-" + c + ".raw");
}

bool same_view(const std::string& dir, const std::string& image, const std::string& raw) {
  return sh("cd " + dir + " && qemu-img compare -U -q " + raw + " " + image + " >/dev/null 2>&1") ==
         0;
}

void check_unchanged_views(const Scenario& s, const std::string& dir, const std::string& where) {
  if (fs::exists(dir + "/" + s.top))
    CHECK_MESSAGE(same_view(dir, s.top, "view-top.raw"),
                  s.name << ": TOP's view changed after a stop at " << where);
  for (const auto& c : s.children)
    CHECK_MESSAGE(same_view(dir, c, "view-" + c + ".raw"),
                  s.name << ": child " << c << "'s view changed after a stop at " << where);
}

// qemu-img check: 0 clean, 3 leaks only.
int check_base(const std::string& dir, const Scenario& s) {
  if (s.base_file.ends_with(".raw")) return 0;  // raw has no metadata to check
  return sh("cd " + dir + " && qemu-img check -q " + s.base_file + " >/dev/null 2>&1");
}

// Leaked clusters `qemu-img check` counts in BASE.
uint64_t base_leaks(const std::string& dir, const Scenario& s) {
  const std::string cmd = "cd " + dir + " && qemu-img check --output=json " + s.base_file +
                          " 2>/dev/null | sed -n 's/.*\"leaks\": *\\([0-9]*\\).*/\\1/p'";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  unsigned long long n = 0;
  if (std::fscanf(p, "%llu", &n) != 1) n = 0;
  ::pclose(p);
  return n;
}

// BASE shows TOP's original view over TOP's size; a BASE larger than TOP keeps its own beyond.
bool base_shows_top(const std::string& dir, const Scenario& s) {
  return sh("cd " + dir + " && qemu-img convert -U -O raw " + s.base_file +
            " base-now.raw && truncate -s $(stat -c %s view-top.raw) base-now.raw && cmp -s "
            "view-top.raw base-now.raw && rm base-now.raw") == 0;
}

void check_final(const Scenario& s, const std::string& dir, const std::string& where) {
  CHECK_MESSAGE(base_shows_top(dir, s),
                s.name << ": BASE does not show TOP's original view (stop at " << where << ")");
  const int rc = check_base(dir, s);
  if (s.leaks_before > 0 && rc == 3)
    CHECK_MESSAGE(
        base_leaks(dir, s) <= s.leaks_before,
        s.name << ": BASE has more leaks than before the merge (stop at " << where << ")");
  else
    CHECK_MESSAGE(rc == 0, s.name << ": BASE not clean after the re-run (stop at " << where << ")");
  for (const auto& c : s.children) {
    CHECK_MESSAGE(same_view(dir, c, "view-" + c + ".raw"),
                  s.name << ": child " << c << " changed (stop at " << where << ")");
    CHECK_MESSAGE(sh("cd " + dir + " && qemu-img info -U --output=json " + c +
                     " | grep -q '\"backing-filename\": \".*" + s.base_file + "\"'") == 0,
                  s.name << ": child " << c << " not on BASE (stop at " << where << ")");
  }
  if (s.delete_merged)
    for (const auto& m : s.merged)
      CHECK_MESSAGE(!fs::exists(dir + "/" + m),
                    s.name << ": " << m << " not deleted (stop at " << where << ")");
}

struct Counts {
  int stops = 0, resumed = 0, reruns = 0;
  int reruns_leaving_zeros = 0;  // re-runs that wrote only the pieces of some new clusters
  std::map<std::string, int> by_point;
};

Counts run_matrix(const Scenario& s) {
  const std::string root =
      fs::temp_directory_path() / ("qcommit-kp-" + std::to_string(::getpid()) + "-" + s.name);
  fs::remove_all(root);
  const std::string orig = root + "/orig", dir = root + "/run";
  fs::create_directories(orig);
  must("cd " + orig + " && set -e; " + s.setup);
  save_views(s, orig);
  if (s.leaks_before > 0) {  // the scenario says how many: qemu-img must agree before we rely on it
    REQUIRE(base_leaks(orig, s) == s.leaks_before);
  }
  Counts n;
  const std::vector<std::string> names = write_points_of(s, orig, dir);
  const std::vector<int> ks = points_to_visit(names, data_point_stride());
  for (size_t i = 0;; ++i) {
    const int k = kth_point(ks, i);
    REQUIRE(k < 2000);
    fs::remove_all(dir);
    must("cp -a --sparse=always " + orig + " " + dir);
    const std::string where = run_stopped_at(s, dir, k);
    if (where.empty()) {  // finished without reaching point k: the matrix is complete
      check_final(s, dir, "none (uninterrupted)");
      break;
    }
    ++n.stops;
    ++n.by_point[where];
    check_same_point(names, k, where, s.name);
    const std::string at = where + " #" + std::to_string(k);
    check_unchanged_views(s, dir, at);
    const int rc = check_base(dir, s);
    CHECK_MESSAGE((rc == 0 || rc == 3), s.name << ": BASE corrupt after a stop at " << at);
    if (s.after_stop) s.after_stop(dir + "/" + s.base_file);
    // The same command again.
    if (!fs::exists(dir + "/" + s.top) && !s.base) {
      // Stopped after TOP was deleted (merged into its own backing file, no --base: the re-run
      // has no way to name BASE): data, switch and TOP's deletion are done.
      check_final(s, dir, at);
      continue;
    }
    const bool had_checkpoint = fs::exists(engine::checkpoint_path(dir + "/" + s.base_file));
    engine::MergeResult r;
    try {
      r = engine::merge(options_for(s, dir));
    } catch (const std::exception& e) {
      FAIL_CHECK(s.name << ": re-run after a stop at " << at
                        << " failed: " << std::string(e.what()));
      continue;
    }
    ++n.reruns;
    if (r.zeros_left_unwritten > 0) ++n.reruns_leaving_zeros;
    CHECK_MESSAGE(r.resumed == had_checkpoint, s.name << ": re-run after a stop at " << at
                                                      << " resumed=" << r.resumed
                                                      << " with checkpoint=" << had_checkpoint);
    if (r.resumed) ++n.resumed;
    CHECK_MESSAGE(!fs::exists(engine::checkpoint_path(dir + "/" + s.base_file)),
                  s.name << ": checkpoint left");
    check_final(s, dir, at);
  }
  MESSAGE(s.name << ": " << n.stops << " stops, " << n.reruns << " re-runs, " << n.resumed
                 << " resumed");
  std::string points;
  for (auto& [p, c] : n.by_point) points += " " + p + "=" + std::to_string(c);
  MESSAGE(s.name << ": points" << points);
  fs::remove_all(root);
  return n;
}

// Scattered 64 KiB writes with a pattern each, as qemu-io commands.
std::string scattered_writes(const std::string& image, int count, uint64_t span_clusters,
                             int seed) {
  std::string cmd = "qemu-io -f qcow2";
  for (int i = 0; i < count; ++i) {
    const uint64_t c = (uint64_t(i) * 2654435761u + uint64_t(seed) * 97) % span_clusters;
    cmd += " -c 'write -P " + std::to_string((i + seed) % 250 + 1) + " " +
           std::to_string(c * 65536) + " 64k'";
  }
  return cmd + " " + image + " >/dev/null";
}

void expect_points(const Counts& n, std::initializer_list<const char*> names) {
  for (const char* p : names)
    CHECK_MESSAGE(n.by_point.count(p) > 0, "no stop at write point " << p);
  CHECK(n.stops > 10);
  CHECK(n.resumed > 0);
}

// BELOW (8M, all data) <- BASE (4M) <- TOP (8M) <- CHILD: BASE is grown while BASE's own backing
// file covers the grown range, which must keep reading as zeros; TOP also has zero clusters.
Scenario grown_scenario() {
  return Scenario{
      .name = "grown",
      .setup =
          "qemu-img create -q -f qcow2 below.qcow2 8M; qemu-io -f qcow2 -c 'write -P 0xbb 0 8M' "
          "below.qcow2 "
          ">/dev/null; qemu-img create -q -f qcow2 -b below.qcow2 -F qcow2 base.qcow2 4M; "
          "qemu-io -f qcow2 -c 'write -P 0x11 0 1M' base.qcow2 >/dev/null; "
          "qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 8M; " +
          scattered_writes("top.qcow2", 40, 128, 1) +
          "; qemu-io -f qcow2 -c 'write -z 512k 256k' -c 'write -P 0x22 6M 512k' top.qcow2 "
          ">/dev/null; "
          "qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2 8M; "
          "qemu-io -f qcow2 -c 'write -P 0x33 64k 64k' child.qcow2 >/dev/null",
      .base = std::nullopt,
      .base_file = "base.qcow2",
      .children = {"child.qcow2"},
      .merged = {"top.qcow2"},
      .delete_merged = false};
}

// The same with --delete, qcow2 v2 BASE (no zero flags: the grown range gets zero data) and an
// intermediate layer (TOP <- MID <- BASE, merged into BASE with --base).
Scenario v2_delete_scenario() {
  return Scenario{.name = "v2-delete",
                  .setup =
                      "qemu-img create -q -f qcow2 below.qcow2 6M; qemu-io -f qcow2 -c 'write -P "
                      "0xbb 0 6M' below.qcow2 "
                      ">/dev/null; qemu-img create -q -f qcow2 -o compat=0.10 -b below.qcow2 -F "
                      "qcow2 base.qcow2 3M; "
                      "qemu-io -f qcow2 -c 'write -P 0x11 1M 1M' base.qcow2 >/dev/null; "
                      "qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2 5M; " +
                      scattered_writes("mid.qcow2", 20, 80, 2) +
                      "; qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2 8M; " +
                      scattered_writes("top.qcow2", 30, 128, 3) +
                      "; qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2 8M",
                  .base = "base.qcow2",
                  .base_file = "base.qcow2",
                  .children = {"child.qcow2"},
                  .merged = {"top.qcow2", "mid.qcow2"},
                  .delete_merged = true};
}

// BELOW (16M, all data) <- BASE (12M, qcow2 v2) <- TOP (4M) <- CHILD (16M, v3) and CHILD2 (12M,
// v2): past TOP's end the children read zeros, once on BASE they would read BASE's and BELOW's
// data; each is given zeros there (flags, zero data in v2) where it allocates nothing, durable
// before its header names BASE. The children's own data on both sides of TOP's end stays.
Scenario short_top_scenario() {
  return Scenario{
      .name = "short-top",
      .setup =
          "qemu-img create -q -f qcow2 below.qcow2 16M; qemu-io -f qcow2 -c 'write -P 0xbb 0 16M' "
          "below.qcow2 >/dev/null; qemu-img create -q -f qcow2 -o compat=0.10 -b below.qcow2 -F "
          "qcow2 base.qcow2 12M; qemu-io -f qcow2 -c 'write -P 0x11 3M 6M' -c 'write -z 10M 64k' "
          "base.qcow2 >/dev/null; qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M; " +
          scattered_writes("top.qcow2", 24, 64, 6) +
          "; qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2 16M; "
          "qemu-io -f qcow2 -c 'write -P 0x33 3M 2M' -c 'write -P 0x34 8M 64k' -c 'write -z 9M 64k' "
          "child.qcow2 >/dev/null; "
          "qemu-img create -q -f qcow2 -o compat=0.10 -b top.qcow2 -F qcow2 child2.qcow2 12M; "
          "qemu-io -f qcow2 -c 'write -P 0x35 6M 100k' child2.qcow2 >/dev/null",
      .base = std::nullopt,
      .base_file = "base.qcow2",
      .children = {"child.qcow2", "child2.qcow2"},
      .merged = {"top.qcow2"},
      .delete_merged = false};
}

// BASE with persistent bitmaps (removed by the merge), same size as TOP.
Scenario bitmaps_scenario() {
  return Scenario{
      .name = "bitmaps",
      .setup =
          "qemu-img create -q -f qcow2 base.qcow2 8M; qemu-io -f qcow2 -c 'write -P 0x11 0 2M' "
          "base.qcow2 "
          ">/dev/null; qemu-img bitmap --add base.qcow2 b0; qemu-img bitmap --add base.qcow2 b1; "
          "qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 8M; " +
          scattered_writes("top.qcow2", 48, 128, 4),
      .base = std::nullopt,
      .base_file = "base.qcow2",
      .children = {},
      .merged = {"top.qcow2"},
      .delete_merged = true};
}

// BASE (16M, its first 2M written) <- TOP with extended L2 (2 KiB subclusters), whose guest wrote
// 4 KiB-granular pieces into every other cluster of the first 12M: at 4-44 KiB, 48-60 KiB and
// 8 KiB across the cluster's end into the next one. 5.6 MiB in 2 MiB windows (options_for): each
// window fills at the end of a piece inside a cluster whose next piece follows, and must take
// that cluster's other pieces before it ends (merge.partial_clusters counts the bytes written).
// The first 16 clusters are overwritten in place, the rest are new to BASE, assembled.
Scenario partial_clusters_scenario() {
  std::string writes = "qemu-io -f qcow2";
  for (uint64_t c = 0; c < 192; c += 2) {
    const std::string p = std::to_string(c % 250 + 1);
    writes += " -c 'write -P " + p + " " + std::to_string(c * 65536 + 4096) + " 40k'";
    writes += " -c 'write -P " + p + " " + std::to_string(c * 65536 + 49152) + " 12k'";
    writes += " -c 'write -P " + p + " " + std::to_string(c * 65536 + 61440) + " 8k'";
  }
  return Scenario{
      .name = "partial",
      .setup = "qemu-img create -q -f qcow2 base.qcow2 16M; qemu-io -f qcow2 -c 'write -P 0x11 0 2M' base.qcow2 "
               ">/dev/null; qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k -b base.qcow2 "
               "-F qcow2 top.qcow2 16M; " +
               writes + " top.qcow2 >/dev/null",
      .base = std::nullopt,
      .base_file = "base.qcow2",
      .children = {},
      .merged = {"top.qcow2"},
      .delete_merged = false};
}

// What an interrupted run, or anything before it, may leave in BASE's file that its tables do not
// use: every cluster of the file with refcount 0 is filled with garbage, and garbage clusters are
// appended past its end (a run stopped after it wrote data past the last cluster in use extends
// the file). A re-run must take none of it for zeros. BASE's view does not change.
void plant_garbage(const std::string& path) {
  constexpr uint8_t kGarbage = 0xa5;
  constexpr uint64_t kAppendedClusters = 8;
  std::vector<uint64_t> free_clusters;
  uint64_t cs = 0, end = 0;
  {
    auto img = qcow2::Image::open(qcow2::FileDevice::open(path));
    cs = img->cluster_size();
    end = (fs::file_size(path) + cs - 1) / cs;
    for (uint64_t c = 1; c < end; ++c)
      if (img->refcount(c) == 0) free_clusters.push_back(c);
  }
  for (uint64_t i = 0; i < kAppendedClusters; ++i) free_clusters.push_back(end + i);
  const std::vector<uint8_t> garbage(cs, kGarbage);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  for (const uint64_t c : free_clusters)
    REQUIRE(::pwrite(fd, garbage.data(), cs, off_t(c * cs)) == ssize_t(cs));
  ::close(fd);
}

}  // namespace

TEST_CASE("merge.kill_points.selection") {
  const std::vector<std::string> names = {"grow", "data", "data", "data", "data", "data",
                                          "data-flush", "data", "l2-tables", "checkpoint"};
  CHECK(points_to_visit(names, 1) == std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  // the window of five data points: its first (2), every second (4) and its last (6); the
  // window of one (8); every other point; one past the end (11)
  CHECK(points_to_visit(names, 2) == std::vector<int>{1, 2, 4, 6, 7, 8, 9, 10, 11});
  CHECK(points_to_visit(names, 4) == std::vector<int>{1, 2, 6, 7, 8, 9, 10, 11});
  CHECK(points_to_visit({}, 4) == std::vector<int>{1});
  const std::vector<int> ks = {1, 2, 6};
  CHECK(kth_point(ks, 2) == 6);
  CHECK(kth_point(ks, 3) == 7);  // the run at 6 stopped after all: every point from there on
  CHECK(kth_point(ks, 4) == 8);
}

TEST_CASE("merge.kill_points.grown_base_over_backing") {
  const Scenario s = grown_scenario();
  const Counts n = run_matrix(s);
  expect_points(n, {"grow", "data", "data-flush", "l2-tables", "header", "checkpoint", "rebase"});
}

TEST_CASE("merge.kill_points.children_past_short_top") {
  const Scenario s = short_top_scenario();
  const Counts n = run_matrix(s);
  expect_points(n, {"data", "checkpoint", "child-zero", "rebase", "l2-tables", "l1-table", "header"});
  const auto zero_points = n.by_point.find("child-zero");
  CHECK((zero_points != n.by_point.end() && zero_points->second == 2));  // each child once
}

TEST_CASE("merge.kill_points.v2_base_intermediate_delete") {
  const Scenario s = v2_delete_scenario();
  const Counts n = run_matrix(s);
  expect_points(n, {"grow", "data", "l2-tables", "checkpoint", "rebase", "delete"});
}

// BASE whose bitmaps extension is stale (the autoclear bit cleared, as a program that does not
// know bitmaps leaves it): the extension is invalid, its clusters are leaks to repair.
TEST_CASE("merge.kill_points.base_with_stale_bitmaps") {
  Scenario s = bitmaps_scenario();
  s.name = "stale-bitmaps";
  // autoclear_features is the big-endian u64 at header offset 88: its last byte holds bit 0.
  s.setup += "; printf '\\000' | dd of=base.qcow2 bs=1 seek=95 conv=notrunc status=none";
  s.leaks_before = 3;  // the extension's directory and the two bitmaps' tables
  const Counts n = run_matrix(s);
  expect_points(n, {"data", "header", "checkpoint", "delete"});
}

// Windows that end inside a cluster's pieces end at the cluster's end instead (every checkpoint of
// an uninterrupted run on BASE's cluster grid, more than one window), and a stop at any write
// point of them leaves BASE consistent and the re-run finishing.
TEST_CASE("merge.kill_points.partial_clusters_over_windows") {
  const Scenario s = partial_clusters_scenario();
  {
    const std::string dir = fs::temp_directory_path() / ("qcommit-kp-" + std::to_string(::getpid()) + "-cuts");
    fs::remove_all(dir);
    fs::create_directories(dir);
    must("cd " + dir + " && set -e; " + s.setup);
    engine::MergeOptions o = options_for(s, dir);
    std::vector<uint64_t> cuts;
    o.on_checkpoint = [&](uint64_t upto) { cuts.push_back(upto); };
    (void)engine::merge(o);
    fs::remove_all(dir);
    CHECK(cuts.size() >= 3);
    for (const uint64_t upto : cuts) CHECK_MESSAGE(upto % 65536 == 0, "a window ended at " << upto);
  }
  const Counts n = run_matrix(s);
  expect_points(n, {"data", "data-flush", "refcount-blocks", "l2-tables", "l1-table", "checkpoint"});
}

// The clusters new to BASE get only TOP's pieces where the space they are given reads as zeros
// (past the end of BASE's file as the merge found it). After each stop every byte of BASE's file
// that its tables do not use is garbage (plant_garbage): the re-run must write whole every new
// cluster it places there, and still write only the pieces past the file's new end.
TEST_CASE("merge.kill_points.partial_clusters_over_garbage") {
  Scenario s = partial_clusters_scenario();
  s.name = "partial-garbage";
  s.after_stop = plant_garbage;
  {
    const std::string dir =
        fs::temp_directory_path() / ("qcommit-kp-" + std::to_string(::getpid()) + "-zeros");
    fs::remove_all(dir);
    fs::create_directories(dir);
    must("cd " + dir + " && set -e; " + s.setup);
    const engine::MergeResult r = engine::merge(options_for(s, dir));
    fs::remove_all(dir);
    CHECK_MESSAGE(r.zeros_left_unwritten > 0, "every new cluster was written whole");
  }
  const Counts n = run_matrix(s);
  expect_points(n,
                {"data", "data-flush", "refcount-blocks", "l2-tables", "l1-table", "checkpoint"});
  CHECK_MESSAGE(n.reruns_leaving_zeros > 0, "no re-run wrote only the pieces of a new cluster");
}

TEST_CASE("merge.kill_points.base_with_bitmaps") {
  const Scenario s = bitmaps_scenario();
  const Counts n = run_matrix(s);
  expect_points(n, {"data", "header", "refcount-decrements", "checkpoint", "delete"});
}

// BASE rolled back between the stopped run and its re-run: to the internal snapshot taken before
// the merge (`qemu-img snapshot -a`), as an operator undoing a half-done merge might. The
// checkpoint then names windows BASE no longer holds; the re-run must copy them again (the
// checkpoint is bound to the BASE its commits left, engine/base_fingerprint.h), and --delete may
// remove TOP only once BASE shows its view. (The rollback is skipped once TOP is deleted: its data
// is in BASE only then, by the user's own hand.)
TEST_CASE("merge.kill_points.base_rolled_back") {
  Scenario s{.name = "rolled-back",
             .setup =
                 "qemu-img create -q -f qcow2 base.qcow2 8M; qemu-io -f qcow2 -c 'write -P 0x11 0 "
                 "2M' base.qcow2 >/dev/null; qemu-img snapshot -c pre base.qcow2; "
                 "qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 8M; " +
                 scattered_writes("top.qcow2", 48, 128, 6),
             .base = std::nullopt,
             .base_file = "base.qcow2",
             .children = {},
             .merged = {"top.qcow2"},
             .delete_merged = true};
  s.after_stop = [](const std::string& base_path) {
    const std::string dir = fs::path(base_path).parent_path().string();
    if (fs::exists(dir + "/top.qcow2")) must("qemu-img snapshot -a pre " + base_path);
  };
  const Counts n = run_matrix(s);
  expect_points(n, {"data", "checkpoint", "delete"});
}

// A raw BASE (grown by truncate) under a qcow2 TOP with a child.
TEST_CASE("merge.kill_points.raw_base") {
  Scenario s{.name = "raw",
             .setup =
                 "qemu-img create -q -f raw base.raw 4M; qemu-io -f raw -c 'write -P 0x11 0 4M' "
                 "base.raw >/dev/null; "
                 "qemu-img create -q -f qcow2 -b base.raw -F raw top.qcow2 8M; " +
                 scattered_writes("top.qcow2", 40, 128, 5) +
                 "; qemu-io -f qcow2 -c 'write -z 0 128k' top.qcow2 >/dev/null; "
                 "qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2 8M",
             .base = std::nullopt,
             .base_file = "base.raw",
             .children = {"child.qcow2"},
             .merged = {"top.qcow2"},
             .delete_merged = false};
  const Counts n = run_matrix(s);
  expect_points(n, {"grow", "data", "checkpoint", "rebase"});
}

// qcommit-slowfs mounted over a backing directory, whose writes can be made to fail (every WRITE,
// FSYNC, FALLOCATE and size change, with EIO or ENOSPC) at once by a signal. Needs root and FUSE
// (QCOMMIT_SLOWFS names the qcommit-slowfs binary).
class SlowFs {
 public:
  // Returns nullopt (and says why) where the test cannot mount FUSE.
  static std::optional<std::string> binary() {
    const char* slowfs = std::getenv("QCOMMIT_SLOWFS");
    if (!slowfs || ::geteuid() != 0 || !fs::exists("/dev/fuse")) {
      MESSAGE("skipped: needs root, /dev/fuse and QCOMMIT_SLOWFS");
      return std::nullopt;
    }
    return slowfs;
  }

  SlowFs(std::string binary, std::string root, std::string fail_errno)
      : binary_(std::move(binary)), root_(std::move(root)), errno_name_(std::move(fail_errno)) {
    fs::create_directories(backing());
    fs::create_directories(mnt());
    mount();
  }
  ~SlowFs() {
    if (mounted_) unmount();
    fs::remove_all(root_);
  }
  SlowFs(const SlowFs&) = delete;
  SlowFs& operator=(const SlowFs&) = delete;

  std::string backing() const { return root_ + "/backing"; }
  std::string mnt() const { return root_ + "/mnt"; }

  // Every write fails from now on / works again. The signal is handled within microseconds by
  // the idle FUSE process; the pause covers a loaded machine.
  void fail(bool on) const {
    ::kill(pid_, on ? SIGUSR1 : SIGUSR2);
    ::usleep(kSignalSettleUs);
  }

  // A fresh mount: the client's page cache is gone, reads show what the storage holds.
  void remount() {
    unmount();
    mount();
  }

 private:
  static constexpr useconds_t kSignalSettleUs = 20 * 1000;
  // Mounting and unmounting are waited for by polling: every 2 ms, for up to 5 s. A fault matrix
  // remounts a few hundred times, so a coarser poll is most of its run time.
  static constexpr useconds_t kPollUs = 2 * 1000;
  static constexpr int kPolls = 2500;

  // The process started in the background belongs to init once its shell is gone, and init may
  // reap it seconds after it exits (1-2 s on the CI's VMs, every remount): a zombie has exited.
  static bool running(pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return false;
    const auto paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return false;
    const char state = line[paren + 2];
    return state != 'Z' && state != 'X';
  }

  // The mount point is on another device than its parent once the FUSE mount is in place.
  bool mounted() const {
    struct stat m{}, parent{};
    return ::stat(mnt().c_str(), &m) == 0 && ::stat(root_.c_str(), &parent) == 0 &&
           m.st_dev != parent.st_dev;
  }

  void mount() {
    const std::string pidfile = root_ + "/pid";
    must(binary_ + " --backing " + backing() + " --mount " + mnt() +
         " --bandwidth 4G --fail-errno " + errno_name_ + " --pidfile " + pidfile + " >>" + root_ +
         "/slowfs.log 2>&1 &");
    for (int i = 0; i < kPolls && !mounted(); ++i) ::usleep(kPollUs);
    REQUIRE(mounted());
    for (int i = 0; i < kPolls && pid_ <= 0; ++i) {
      if (FILE* f = std::fopen(pidfile.c_str(), "r")) {
        if (std::fscanf(f, "%d", &pid_) != 1) pid_ = 0;
        std::fclose(f);
      }
      if (pid_ <= 0) ::usleep(kPollUs);
    }
    REQUIRE(pid_ > 0);
    mounted_ = true;
  }
  void unmount() {
    must("fusermount3 -u " + mnt() + " || umount -l " + mnt());
    // The process unmounts its mount point again as it exits: wait for it to be gone.
    for (int i = 0; i < 2 * kPolls && running(pid_); ++i) ::usleep(kPollUs);
    fs::remove(root_ + "/pid");
    pid_ = 0;
    mounted_ = false;
  }

  std::string binary_, root_, errno_name_;
  pid_t pid_ = 0;
  bool mounted_ = false;
};

// A write-back that fails (EIO) in the middle of a window, on storage whose client page cache
// then holds pages the storage never got. The merge must stop with an I/O error naming BASE; once
// the storage works again the same merge must finish from what is on the storage, not from the
// cached pages: checked after a fresh mount (no page cache), with qemu-img.
TEST_CASE("merge.eio_rerun_reads_storage") {
  const auto slowfs = SlowFs::binary();
  if (!slowfs) return;
  const std::string root =
      fs::temp_directory_path() / ("qcommit-eio-" + std::to_string(::getpid()));
  fs::remove_all(root);
  SlowFs storage(*slowfs, root, "EIO");
  const std::string mnt = storage.mnt();
  Scenario s{.name = "eio",
             .setup = "",
             .top = "top.qcow2",
             .base = std::nullopt,
             .base_file = "base.qcow2",
             .children = {},
             .merged = {"top.qcow2"},
             .delete_merged = false};
  must("cd " + mnt +
       " && qemu-img create -q -f qcow2 base.qcow2 16M && qemu-io -f qcow2 -c 'write -P 0x11 0 3M' "
       "base.qcow2 >/dev/null && qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 16M "
       "&& " +
       scattered_writes("top.qcow2", 160, 256, 7));
  save_views(s, mnt);

  // Stop writing at the third window's L2 tables: they reach the page cache, their write-back
  // fails.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    engine::MergeOptions o = options_for(s, mnt);
    int l2_points = 0;
    o.on_write_point = [&](std::string_view name) {
      if (name == "l2-tables" && ++l2_points == 3) storage.fail(true);
    };
    try {
      (void)engine::merge(o);
    } catch (const qcow2::IoError& e) {
      std::fprintf(stderr, "merge stopped: %s\n", e.what());
      ::_exit(std::string(e.what()).find("base.qcow2") != std::string::npos ? 3 : 4);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "merge failed otherwise: %s\n", e.what());
      ::_exit(5);
    }
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK_MESSAGE(WEXITSTATUS(status) == 3,
                "expected an I/O error naming BASE, exit " << WEXITSTATUS(status));
  storage.fail(false);

  engine::MergeResult r;
  CHECK_NOTHROW(r = engine::merge(options_for(s, mnt)));
  CHECK(r.resumed);
  storage.remount();  // nothing cached: what the storage holds
  CHECK_MESSAGE(same_view(mnt, "base.qcow2", "view-top.raw"),
                "BASE does not show TOP's view after the re-run");
  CHECK_MESSAGE(check_base(mnt, s) == 0, "BASE not clean after the re-run");
}

namespace {

// How a merge whose storage failed at write point k ended (exit status of the child).
enum FaultExit : int { kFinished = 0, kFailedCleanly = 3, kBadMessage = 4, kOtherError = 5 };

// Runs the merge in a child process and makes every write of the storage fail from write point k
// on. Returns the point's name ("" if the merge finished first) and how the merge ended; a merge
// that fails must do so with one line naming a file of the chain and the storage's error.
std::pair<std::string, int> run_faulted_at(const Scenario& s, const std::string& dir,
                                           const SlowFs& storage, int k,
                                           const std::string& error_text) {
  const ChildRun r = run_in_child(
      s, dir, k, [&storage] { storage.fail(true); },
      [&](const std::string& msg) {
        std::fprintf(stderr, "merge stopped: %s\n", msg.c_str());
        const bool one_line = msg.find('\n') == std::string::npos;
        const bool names_file = msg.find(dir + "/") != std::string::npos;
        const bool says_why = msg.find(error_text) != std::string::npos;
        return one_line && names_file && says_why ? int(kFailedCleanly) : int(kBadMessage);
      });
  return {r.point, r.status};
}

struct FaultCounts {
  int points = 0, failed = 0, finished_anyway = 0;
  std::map<std::string, int> by_point;
};

// The storage fails at every write point of the merge in turn. After each: the merge failed with
// a clear one-line error (or finished with everything on the storage), TOP's and the children's
// views are unchanged, BASE has no corruption; then, with the storage working again, the same
// merge runs again without a remount (the client cache still holds pages the storage never got)
// and must finish; after a fresh mount BASE shows TOP's original view, `qemu-img check` is clean.
FaultCounts run_fault_matrix(const Scenario& s, const std::string& slowfs,
                             const std::string& errno_name, const std::string& error_text) {
  const std::string root =
      fs::temp_directory_path() / ("qcommit-fault-" + std::to_string(::getpid()) + "-" + s.name);
  fs::remove_all(root);
  const std::string orig = root + "/orig";
  fs::create_directories(orig);
  must("cd " + orig + " && set -e; " + s.setup);
  save_views(s, orig);
  SlowFs storage(slowfs, root + "/fs", errno_name);
  const std::string dir = storage.mnt() + "/run";
  FaultCounts n;
  const std::vector<std::string> names = write_points_of(s, orig, dir);
  const std::vector<int> ks = points_to_visit(names, data_point_stride());
  for (size_t i = 0;; ++i) {
    const int k = kth_point(ks, i);
    REQUIRE(k < 2000);
    fs::remove_all(dir);
    must("cp -a --sparse=always " + orig + " " + dir);
    // Plain variables, not a structured binding: clang 14 cannot capture one (CHECK_MESSAGE).
    const auto faulted = run_faulted_at(s, dir, storage, k, error_text);
    const auto where = faulted.first;
    const auto how = faulted.second;
    storage.fail(false);
    if (where.empty()) {  // finished without reaching point k: the matrix is complete
      storage.remount();
      check_final(s, dir, "none (no fault)");
      break;
    }
    ++n.points;
    ++n.by_point[where];
    check_same_point(names, k, where, s.name);
    const std::string at = errno_name + " at " + where + " #" + std::to_string(k);
    CHECK_MESSAGE((how == kFailedCleanly || how == kFinished),
                  s.name << ": " << at << ": exit " << how
                         << " (4: the error is not one line naming a file "
                            "and the storage's error; see stderr)");
    if (how == kFinished) {
      ++n.finished_anyway;  // the fault hit nothing that matters: all must be on the storage
      storage.remount();
      check_final(s, dir, at + " (reported success)");
      continue;
    }
    ++n.failed;
    check_unchanged_views(s, dir, at);
    const int rc = check_base(dir, s);
    CHECK_MESSAGE((rc == 0 || rc == 3), s.name << ": BASE corrupt after " << at);
    if (!fs::exists(dir + "/" + s.top) && !s.base) {
      storage.remount();
      check_final(s, dir, at);
      continue;
    }
    try {
      (void)engine::merge(options_for(s, dir));
    } catch (const std::exception& e) {
      FAIL_CHECK(s.name << ": re-run after " << at << " failed: " << std::string(e.what()));
      continue;
    }
    CHECK_MESSAGE(!fs::exists(engine::checkpoint_path(dir + "/" + s.base_file)),
                  s.name << ": checkpoint left");
    storage.remount();
    check_final(s, dir, at);
  }
  MESSAGE(s.name << " " << errno_name << ": " << n.points << " faulted points, " << n.failed
                 << " failed cleanly, " << n.finished_anyway << " finished anyway");
  std::string points;
  for (auto& [p, c] : n.by_point) points += " " + p + "=" + std::to_string(c);
  MESSAGE(s.name << " " << errno_name << ": points" << points);
  fs::remove_all(orig);
  return n;
}

void expect_faults(const FaultCounts& n, std::initializer_list<const char*> names) {
  for (const char* p : names)
    CHECK_MESSAGE(n.by_point.count(p) > 0, "no fault at write point " << p);
  CHECK(n.points > 10);
  CHECK(n.failed > n.points / 2);  // most faults must stop the merge: a write that fails is seen
}

}  // namespace

TEST_CASE("merge.fault_points.eio_grown_base_over_backing") {
  const auto slowfs = SlowFs::binary();
  if (!slowfs) return;
  const FaultCounts n = run_fault_matrix(grown_scenario(), *slowfs, "EIO", "Input/output error");
  expect_faults(n, {"grow", "data", "l2-tables", "header", "checkpoint", "rebase"});
}

TEST_CASE("merge.fault_points.eio_v2_base_intermediate_delete") {
  const auto slowfs = SlowFs::binary();
  if (!slowfs) return;
  const FaultCounts n =
      run_fault_matrix(v2_delete_scenario(), *slowfs, "EIO", "Input/output error");
  expect_faults(n, {"grow", "data", "l2-tables", "checkpoint", "rebase", "delete"});
}

TEST_CASE("merge.fault_points.enospc_base_with_bitmaps") {
  const auto slowfs = SlowFs::binary();
  if (!slowfs) return;
  const FaultCounts n =
      run_fault_matrix(bitmaps_scenario(), *slowfs, "ENOSPC", "No space left on device");
  expect_faults(n, {"data", "header", "refcount-decrements", "checkpoint", "delete"});
}

}  // namespace qcommit::test
