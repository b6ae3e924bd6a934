// SPDX-License-Identifier: GPL-2.0-or-later
#include <doctest/doctest.h>

#include "plugin/live/live.h"
#include "tests/plugin/fake_hypervisor.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

DiskInfo chain_disk() {
  DiskInfo d;
  d.target = "vda";
  d.source = "/s/top.qcow2";
  d.backing_chain = {"/s/mid.qcow2", "/s/base.raw"};
  return d;
}

// Block-job control over a FakeHypervisor: commits become jobs, a commit finishes when the test
// says so, the chain changes like libvirt's.
struct FakeControl final : BlockJobControl {
  FakeHypervisor& hv;
  DomainInfo dom;
  std::vector<std::string> log;
  bool active_job = false;
  std::string job_top, job_base;
  int pivot_refusals = 1;
  explicit FakeControl(FakeHypervisor& h) : hv(h) {
    dom.name = "vm1";
    dom.disks = {chain_disk()};
  }
  std::optional<DomainInfo> domain(const std::string&) override { return dom; }
  void start_commit(const std::string& d, const std::string& k, const std::string& base,
                    const std::string& top, std::uint64_t bw, bool active) override {
    log.push_back(std::string(active ? "active-commit " : "commit ") + top + " -> " + base);
    CHECK(bw > 0);  // never started unlimited
    hv.jobs[{d, k}] = JobInfo{active ? JobType::ActiveCommit : JobType::Commit, 0, 100, bw};
    active_job = active;
    job_top = top;
    job_base = base;
  }
  void create_overlay(const std::string&, const std::string&, const std::string& path) override {
    log.push_back("overlay " + path);
    DiskInfo& d = dom.disks[0];
    d.backing_chain.insert(d.backing_chain.begin(), d.source);
    d.source = path;
  }
  bool pivot(const std::string& d, const std::string& k) override {
    if (pivot_refusals-- > 0) return false;
    log.push_back("pivot");
    hv.jobs.erase({d, k});
    dom.disks[0].source = job_base;
    dom.disks[0].backing_chain.clear();
    return true;
  }
  void remove_file(const std::string& path) override { log.push_back("rm " + path); }
  // The running job copies everything; a non-active commit then leaves the chain.
  void job_progresses(const std::string& d, const std::string& k) {
    auto it = hv.jobs.find({d, k});
    if (it == hv.jobs.end()) return;
    it->second.cur = it->second.end;
    if (!active_job) {
      hv.jobs.erase(it);
      auto& chain = dom.disks[0].backing_chain;
      chain.erase(std::remove(chain.begin(), chain.end(), job_top), chain.end());
    }
  }
};

}  // namespace

TEST_CASE("plugin.live.plan") {
  LiveRequest r;
  r.domain = "vm1";
  r.disk = "vda";
  r.pivot = true;
  using K = LiveStep::Kind;
  SUBCASE("two-phase active commit") {
    auto s = plan_live(r, chain_disk(), "/s/new.qcow2");
    REQUIRE(s.size() == 5);
    CHECK(s[0].kind == K::CreateOverlay);
    CHECK(s[1].kind == K::Commit);
    CHECK(s[1].top == "/s/top.qcow2");
    CHECK(s[1].base == "/s/base.raw");
    CHECK(s[2].kind == K::ActiveCommit);
    CHECK(s[2].top == "/s/new.qcow2");
    CHECK(s[3].kind == K::Pivot);
    CHECK(s[4].kind == K::RemoveOverlay);
  }
  SUBCASE("direct") {
    r.strategy = LiveStrategy::Direct;
    auto s = plan_live(r, chain_disk(), "/s/new.qcow2");
    REQUIRE(s.size() == 2);
    CHECK(s[0].kind == K::ActiveCommit);
    CHECK(s[1].kind == K::Pivot);
  }
  SUBCASE("non-active commit is one job whatever the strategy") {
    r.top = "/s/mid.qcow2";
    auto s = plan_live(r, chain_disk(), "/s/new.qcow2");
    REQUIRE(s.size() == 1);
    CHECK(s[0].kind == K::Commit);
  }
  SUBCASE("refusals") {
    r.base = "/s/top.qcow2";
    CHECK_THROWS_AS((void)plan_live(r, chain_disk(), "/n"), BlockJobError);
    r.base = "/elsewhere.raw";
    CHECK_THROWS_AS((void)plan_live(r, chain_disk(), "/n"), BlockJobError);
    r.base.clear();
    DiskInfo flat = chain_disk();
    flat.backing_chain.clear();
    CHECK_THROWS_AS((void)plan_live(r, flat, "/n"), BlockJobError);
    DiskInfo busy = chain_disk();
    busy.mirror = "/s/base.raw";
    CHECK_THROWS_AS((void)plan_live(r, busy, "/n"), BlockJobError);
  }
  CHECK(fresh_overlay_path("/s/top.qcow2", "20260101") == "/s/top.qcommit-20260101.qcow2");
  CHECK(fresh_overlay_path("/s/top.qcow2", "20260101", "/local") ==
        "/local/top.qcommit-20260101.qcow2");
}

TEST_CASE("plugin.live.two_phase_runs_in_order") {
  FakeHypervisor hv;
  REQUIRE(hv.connect());
  FakeControl ctl(hv);
  LiveRequest r;
  r.domain = "vm1";
  r.disk = "vda";
  r.pivot = true;
  auto steps = plan_live(r, chain_disk(), "/s/new.qcow2");
  LiveMerge m(ctl, hv, steps, r);
  TimePoint now{};
  int guard = 0;
  while (m.step(now) && ++guard < 100) {
    now += 10ms;
    ctl.job_progresses("vm1", "vda");
  }
  REQUIRE_FALSE(m.error().has_value());
  CHECK(m.done());
  const std::vector<std::string> want{"overlay /s/new.qcow2", "commit /s/top.qcow2 -> /s/base.raw",
                                      "active-commit /s/new.qcow2 -> /s/base.raw", "pivot",
                                      "rm /s/new.qcow2"};
  CHECK(ctl.log == want);
  CHECK(ctl.dom.disks[0].source == "/s/base.raw");
}

TEST_CASE("plugin.live.pivot_waits_for_its_gate") {
  FakeHypervisor hv;
  REQUIRE(hv.connect());
  FakeControl ctl(hv);
  ctl.pivot_refusals = 0;
  LiveRequest r;
  r.domain = "vm1";
  r.disk = "vda";
  r.pivot = true;
  r.strategy = LiveStrategy::Direct;
  LiveMerge m(ctl, hv, plan_live(r, chain_disk(), "/s/new.qcow2"), r);
  TimePoint now{};
  int asked = 0;
  std::optional<TimePoint> open_at;
  m.set_pivot_gate([&](TimePoint t) {
    ++asked;
    if (asked == 5) open_at = t;
    return asked >= 5;
  });
  int guard = 0;
  while (m.step(now) && ++guard < 100) {
    now += 10ms;
    ctl.job_progresses("vm1", "vda");
    if (!open_at) CHECK(std::find(ctl.log.begin(), ctl.log.end(), "pivot") == ctl.log.end());
  }
  REQUIRE_FALSE(m.error().has_value());
  CHECK(m.done());
  CHECK(asked == 5);
  CHECK(ctl.log.back() == "pivot");
}

TEST_CASE("plugin.live.commit_that_vanishes_without_merging_is_an_error") {
  FakeHypervisor hv;
  REQUIRE(hv.connect());
  FakeControl ctl(hv);
  LiveRequest r;
  r.domain = "vm1";
  r.disk = "vda";
  r.top = "/s/mid.qcow2";
  LiveMerge m(ctl, hv, plan_live(r, chain_disk(), "/n"), r);
  TimePoint now{};
  CHECK(m.step(now));             // starts the commit
  hv.jobs.erase({"vm1", "vda"});  // cancelled behind our back: mid.qcow2 still in the chain
  CHECK_FALSE(m.step(now + 10ms));
  REQUIRE(m.error().has_value());
  CHECK(m.error()->find("still in the chain") != std::string::npos);
}

TEST_CASE("plugin.live.foreign_job_is_waited_out") {
  FakeHypervisor hv;
  REQUIRE(hv.connect());
  const TimePoint t0{};
  ForeignJobWait w(hv, "vm1", "vda", 10s);
  SUBCASE("a free disk is clear at once") {
    CHECK(w.poll(t0) == ForeignJobWait::State::kClear);
    CHECK_FALSE(w.job());
  }
  SUBCASE("a job that ends within the limit is waited for") {
    hv.jobs[{"vm1", "vda"}] = JobInfo{JobType::Commit, 42, 100, 0};
    CHECK(w.poll(t0) == ForeignJobWait::State::kWaiting);
    CHECK(w.poll(t0 + 9900ms) == ForeignJobWait::State::kWaiting);
    CHECK(w.describe_job() == "the commit block job on vm1 vda (42% done)");
    hv.jobs.clear();
    CHECK(w.poll(t0 + 9950ms) == ForeignJobWait::State::kClear);
  }
  SUBCASE("the limit counts from the first sighting, not from construction") {
    CHECK(w.poll(t0) == ForeignJobWait::State::kClear);
    hv.jobs[{"vm1", "vda"}] = JobInfo{JobType::ActiveCommit, 0, 0, 0};
    CHECK(w.poll(t0 + 60s) == ForeignJobWait::State::kWaiting);
    CHECK(w.poll(t0 + 69s) == ForeignJobWait::State::kWaiting);
    CHECK(w.poll(t0 + 70s) == ForeignJobWait::State::kTimedOut);
    CHECK(w.describe_job() == "the active-commit block job on vm1 vda");
  }
  SUBCASE("a zero limit refuses at once") {
    ForeignJobWait now_or_never(hv, "vm1", "vda", 0s);
    hv.jobs[{"vm1", "vda"}] = JobInfo{JobType::Copy, 1, 4, 0};
    CHECK(now_or_never.poll(t0) == ForeignJobWait::State::kTimedOut);
    CHECK(now_or_never.describe_job() == "the copy block job on vm1 vda (25% done)");
  }
}
