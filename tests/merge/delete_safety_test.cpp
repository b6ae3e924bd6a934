// SPDX-License-Identifier: GPL-2.0-or-later
// merge.delete_safety.*: `merge --delete` deletes a merged layer only once BASE is shown to hold
// its view, whatever a checkpoint says. Chains made with qemu-img/qemu-io, the merge stopped
// through MergeOptions::on_write_point in a child process (as merge.kill_points does), BASE or a
// layer changed between the runs, judged with qemu-img compare:
//   - base_changed_between_runs: stopped right before the first unlink, BASE put back to its state
//     before the merge; the re-run must not lose TOP's data (TOP kept, or BASE showing its view);
//   - base_differs_at_delete: BASE's data overwritten behind the merge's back while it holds its
//     locks (while_locked): the deletion is refused naming BASE and the guest offset, TOP and the
//     checkpoint kept; the same command again (the copy redone once BASE is no longer trusted, or
//     refused again) never deletes TOP while BASE differs;
//   - layer_changed_after_top_deleted: stopped after TOP's unlink, the intermediate written since:
//     the re-run (TOP gone, nothing to compare with) refuses to delete it and keeps the checkpoint.
// About 2 s each.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "engine/merge.h"
#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/image.h"

namespace qcommit::test {
namespace {

namespace fs = std::filesystem;
constexpr int kStoppedExit = 77;

int sh(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

void must(const std::string& cmd) { REQUIRE_MESSAGE(sh(cmd) == 0, cmd); }

// base.qcow2 (4M: 0x11 over the first 2M) <- mid.qcow2 (0x22 at 1M) <- top.qcow2 (0x33 at 2M,
// zeros over BASE's data at 0), TOP's view in view-top.raw, BASE's copy in base-before.qcow2.
std::string make_chain(const std::string& name) {
  const std::string dir = fs::temp_directory_path() / ("qcommit-ds-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  must("cd " + dir +
       " && set -e; qemu-img create -q -f qcow2 base.qcow2 4M;"
       " qemu-io -f qcow2 -c 'write -P 0x11 0 2M' base.qcow2 >/dev/null;"
       " qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2;"
       " qemu-io -f qcow2 -c 'write -P 0x22 1M 512k' mid.qcow2 >/dev/null;"
       " qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2;"
       " qemu-io -f qcow2 -c 'write -P 0x33 2M 1M' -c 'write -z 0 64k' top.qcow2 >/dev/null;"
       " qemu-img convert -O raw top.qcow2 view-top.raw; cp base.qcow2 base-before.qcow2");
  return dir;
}

engine::MergeOptions delete_options(const std::string& dir) {
  engine::MergeOptions o;
  o.top = dir + "/top.qcow2";
  o.base = dir + "/base.qcow2";
  o.delete_merged = true;
  o.io_threads = 2;
  return o;
}

// Runs the merge in a child process stopped right before the `nth` write point called `name`;
// true when it stopped there.
bool stopped_at(const std::string& dir, const std::string& name, int nth) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    engine::MergeOptions o = delete_options(dir);
    int seen = 0;
    o.on_write_point = [&](std::string_view point) {
      if (point == name && ++seen == nth) ::_exit(kStoppedExit);
    };
    try {
      (void)engine::merge(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "merge failed: %s\n", e.what());
      ::_exit(2);
    }
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) && WEXITSTATUS(status) == kStoppedExit;
}

bool base_shows_top(const std::string& dir) {
  return sh("cd " + dir + " && qemu-img compare -U -q view-top.raw base.qcow2 >/dev/null 2>&1") == 0;
}

bool has_checkpoint(const std::string& dir) {
  return fs::exists(engine::checkpoint_path(dir + "/base.qcow2"));
}

// The merge run (again): "" when it finished, else its error.
std::string rerun(const engine::MergeOptions& o) {
  try {
    (void)engine::merge(o);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Where BASE's file holds guest offset 2M (TOP's 0x33 data), read from its L2 table with a
// read-only opening of our own (qemu-img cannot open BASE while the merge holds its lock).
uint64_t base_host_offset_of_2m(const std::string& dir) {
  constexpr uint64_t kGuest = 2ull << 20;
  auto img = qcow2::Image::open(qcow2::FileDevice::open(dir + "/base.qcow2"));
  const qcow2::Run r = img->lookup(kGuest, 1);
  REQUIRE_MESSAGE(r.type == qcow2::SubclusterType::kNormal, "guest offset 2M is not data in BASE");
  return r.host_offset;
}

}  // namespace

TEST_CASE("merge.delete_safety.base_changed_between_runs") {
  const std::string dir = make_chain("changed");
  REQUIRE(stopped_at(dir, "delete", 1));
  REQUIRE(fs::exists(dir + "/top.qcow2"));
  REQUIRE(has_checkpoint(dir));
  // BASE put back to its state before the merge (an older copy restored in place).
  must("cd " + dir + " && cp base-before.qcow2 base.qcow2");
  const std::string err = rerun(delete_options(dir));
  CHECK_MESSAGE((fs::exists(dir + "/top.qcow2") || base_shows_top(dir)),
                "TOP deleted while BASE does not show its view (re-run: '" << err << "')");
  if (!err.empty()) {
    CHECK(err.find("base.qcow2") != std::string::npos);
    CHECK(err.find("guest offset") != std::string::npos);
    CHECK(fs::exists(dir + "/mid.qcow2"));
    CHECK(has_checkpoint(dir));
  }
  fs::remove_all(dir);
}

TEST_CASE("merge.delete_safety.base_differs_at_delete") {
  const std::string dir = make_chain("differs");
  engine::MergeOptions o = delete_options(dir);
  // After the copy, under the merge's own locks: BASE's cluster at guest offset 2M overwritten.
  o.while_locked = [&dir](engine::MergeResult&) {
    const uint64_t host = base_host_offset_of_2m(dir);
    must("dd if=/dev/zero of=" + dir + "/base.qcow2 bs=4096 count=1 conv=notrunc status=none seek=" +
         std::to_string(host / 4096 + 1));
  };
  const std::string err = rerun(o);
  CHECK_MESSAGE(!err.empty(), "the merge deleted the layers although BASE differs from TOP");
  CHECK(err.find("base.qcow2") != std::string::npos);
  CHECK_MESSAGE(err.find("guest offset 2101248") != std::string::npos, err);
  CHECK(fs::exists(dir + "/top.qcow2"));
  CHECK(fs::exists(dir + "/mid.qcow2"));
  CHECK(has_checkpoint(dir));
  CHECK(sh("cd " + dir + " && qemu-img compare -U -q view-top.raw top.qcow2") == 0);
  fs::remove_all(dir);
}

TEST_CASE("merge.delete_safety.layer_changed_after_top_deleted") {
  const std::string dir = make_chain("layer");
  REQUIRE(stopped_at(dir, "delete", 2));  // TOP unlinked, mid.qcow2 not yet
  REQUIRE(!fs::exists(dir + "/top.qcow2"));
  REQUIRE(fs::exists(dir + "/mid.qcow2"));
  must("cd " + dir + " && sleep 0.01 && qemu-io -f qcow2 -c 'write -P 0x44 3M 64k' mid.qcow2 >/dev/null");
  const std::string err = rerun(delete_options(dir));
  CHECK_MESSAGE(!err.empty(), "the re-run deleted an intermediate written since the merge began");
  CHECK(err.find("mid.qcow2") != std::string::npos);
  CHECK(fs::exists(dir + "/mid.qcow2"));
  CHECK(has_checkpoint(dir));
  CHECK(base_shows_top(dir));
  fs::remove_all(dir);
}

}  // namespace qcommit::test
