// SPDX-License-Identifier: GPL-2.0-or-later
// A job's first speed: set before the adoption's slow steps, read back from QEMU, and the time
// from the job's discovery to it (time to govern).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "plugin/daemon/daemon_log.h"
#include "plugin/govern/governor.h"
#include "tests/plugin/world.h"

namespace qcommit::plugin::test {
namespace {

using namespace std::chrono_literals;

// The first speed call for a domain's disk, or nullptr.
const SpeedCall* first_call(const FakeHypervisor& hv, const std::string& dom,
                            const std::string& disk) {
  const auto it =
      std::find_if(hv.speed_calls.begin(), hv.speed_calls.end(),
                   [&](const SpeedCall& c) { return c.domain == dom && c.disk == disk; });
  return it == hv.speed_calls.end() ? nullptr : &*it;
}

// QEMU's JOB_STATUS_CHANGE saying a job started on `dom` at `at` (`detail`: its status).
JobEvent job_started(const std::string& dom, TimePoint at, std::string detail = "running") {
  JobEvent e;
  e.kind = JobEventKind::StatusChange;
  e.domain = dom;
  e.detail = std::move(detail);
  e.started = true;
  e.at = at;
  return e;
}

const JobStatus* job_of(const GovernorStatus& st, const std::string& dom) {
  for (const JobStatus& j : st.jobs)
    if (j.domain == dom) return &j;
  return nullptr;
}

// Governor options on the test's clock (w.now), the fake hypervisor's calls stamped with it.
GovernorOptions on_the_test_clock(World& w) {
  w.hv.clock = [&w] { return w.now; };
  GovernorOptions opt;
  opt.clock = [&w] { return w.now; };
  return opt;
}

}  // namespace

// Two jobs start at once; every target open, extent read and probe opening takes 400 ms (storage
// busy with the jobs' own writeback).  Each job still has its first speed within 100 ms of
// QEMU's event, and the status says so.
TEST_CASE("plugin.governor.first_speed_before_slow_adoption") {
  World w;
  auto other = std::make_shared<FakeFileState>();
  w.files.files["/other/vm3-base.qcow2"] = other;
  DomainInfo vm3{"vm3", "33333333-3333-3333-3333-333333333333", {}, std::nullopt};
  vm3.disks.push_back(
      DiskInfo{"vdc", "/other/vm3-top.qcow2", {"/other/vm3-base.qcow2"}, std::nullopt, 11, "", ""});
  w.hv.domains.push_back(vm3);
  w.hv.stats[{"vm3", "vdc"}] = {};
  constexpr Duration kSlowIo = 400ms;
  constexpr Duration kFirstSpeedWithin = 100ms;
  GovernorOptions opt = on_the_test_clock(w);
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(200ms);  // connected, nothing to govern
  REQUIRE(w.hv.speed_calls.empty());
  w.files.on_io = [&w, kSlowIo](const char*) { w.now += kSlowIo; };
  w.start_job(JobType::ActiveCommit);
  w.hv.jobs[{"vm3", "vdc"}] = JobInfo{JobType::ActiveCommit, 0, 8ull << 30, 0};
  const TimePoint started = w.now - 3ms;  // QEMU's timestamp: the events arrive 3 ms later
  for (const char* dom : {"vm1", "vm3"}) {
    w.hv.emit(job_started(dom, started));
  }
  gv.run(3s);
  for (const auto& dd : {std::pair{"vm1", "vda"}, std::pair{"vm3", "vdc"}}) {
    // Plain variables, not a structured binding: clang 14 cannot capture one (CAPTURE).
    const char* const dom = dd.first;
    const char* const disk = dd.second;
    CAPTURE(dom);
    const SpeedCall* c = first_call(w.hv, dom, disk);
    REQUIRE(c != nullptr);
    CHECK(c->speed > 0);
    CHECK(c->at - started <= kFirstSpeedWithin);
  }
  const GovernorStatus st = gv.g.status(w.now);
  for (const char* dom : {"vm1", "vm3"}) {
    CAPTURE(dom);
    const JobStatus* j = job_of(st, dom);
    REQUIRE(j != nullptr);
    REQUIRE(j->time_to_govern.has_value());
    CHECK(*j->time_to_govern <= kFirstSpeedWithin);
    CHECK(j->found_by == FoundBy::kEvent);
    CHECK_FALSE(j->late_adoption);
  }
}

// A host running many domains, each described by libvirt in 5 ms (its XML, its metadata): the
// scan a job event causes looks up the event's domain alone, so the job's first speed does not
// wait for the other 60 domains' descriptions (300 ms).
TEST_CASE("plugin.governor.first_speed_among_many_domains") {
  World w;
  for (int i = 0; i < 60; ++i) {
    const std::string name = "busy" + std::to_string(i);
    DomainInfo d{name, "00000000-0000-0000-0000-0000000000" + std::to_string(10 + i), {}, std::nullopt};
    d.disks.push_back(DiskInfo{"vda", "/other/" + name + ".qcow2", {}, std::nullopt,
                               static_cast<std::uint64_t>(100 + i), "", ""});
    w.hv.domains.push_back(d);
    w.hv.stats[{name, "vda"}] = {};
  }
  constexpr Duration kDescribe = 5ms;
  constexpr Duration kFirstSpeedWithin = 100ms;
  GovernorOptions opt = on_the_test_clock(w);
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(200ms);  // connected, the first poll done
  w.hv.on_describe = [&w, kDescribe] { w.now += kDescribe; };
  w.start_job(JobType::ActiveCommit);
  const TimePoint started = w.now;
  w.hv.emit(job_started(w.dom, started));
  gv.run(150ms);
  const SpeedCall* c = first_call(w.hv, w.dom, "vda");
  REQUIRE(c != nullptr);
  CHECK(c->speed > 0);
  CHECK(c->at - started <= kFirstSpeedWithin);
  const JobStatus* j = job_of(gv.g.status(w.now), w.dom);
  REQUIRE(j != nullptr);
  REQUIRE(j->time_to_govern.has_value());
  CHECK(*j->time_to_govern <= kFirstSpeedWithin);
  CHECK(j->found_by == FoundBy::kEvent);
}

// The time to govern in its steps: QEMU's event reaches the daemon 3 ms after its timestamp, and
// libvirt takes 7 ms to describe the domain.  The status and the daemon's record give each step
// from the job's discovery, in order, so a slow one can be told from the others.
TEST_CASE("plugin.governor.time_to_govern_in_steps") {
  World w;
  constexpr Duration kEventWay = 3ms;
  constexpr Duration kDescribe = 7ms;
  constexpr Duration kSpeedCall = 4ms;
  GovernorOptions opt = on_the_test_clock(w);
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(200ms);  // connected, the first poll done
  w.hv.on_describe = [&w, kDescribe] { w.now += kDescribe; };
  w.hv.on_set_speed = [&w, kSpeedCall] { w.now += kSpeedCall; };
  w.start_job(JobType::ActiveCommit);
  w.hv.emit(job_started(w.dom, w.now - kEventWay));
  gv.run(150ms);
  const GovernorStatus st = gv.g.status(w.now);
  const JobStatus* j = job_of(st, w.dom);
  REQUIRE(j != nullptr);
  REQUIRE(j->scan_began_after.has_value());
  REQUIRE(j->job_listed_after.has_value());
  REQUIRE(j->speed_taken_after.has_value());
  REQUIRE(j->time_to_govern.has_value());
  CHECK(*j->scan_began_after >= kEventWay);
  CHECK(*j->job_listed_after - *j->scan_began_after >= kDescribe);
  CHECK(*j->speed_taken_after - *j->job_listed_after >= kSpeedCall);
  CHECK(*j->time_to_govern >= *j->speed_taken_after);
  std::vector<std::string> records;
  DaemonLog log([&records](std::string_view r) { records.emplace_back(r); });
  log.observe(st, "qemu:///system", "");
  const auto stepped = std::count_if(records.begin(), records.end(), [](const std::string& r) {
    return r.find("domain vm1 disk vda: first speed read back from QEMU ") == 0 &&
           r.find("after the job was found (event); scan began +") != std::string::npos &&
           r.find(" ms, job listed +") != std::string::npos &&
           r.find(" ms, speed taken +") != std::string::npos;
  });
  CHECK(stepped == 1);
}

// A job found by the poll with 1 GiB copied already is governed, and reported as adopted late.
TEST_CASE("plugin.governor.late_adoption_reported") {
  constexpr Duration kSpeedCall = 7ms;
  World w;
  GovernorOptions opt;
  opt.clock = [&w] { return w.now; };
  w.hv.on_set_speed = [&w, kSpeedCall] { w.now += kSpeedCall; };
  w.start_job(JobType::ActiveCommit);
  w.hv.jobs[{"vm1", "vda"}].cur = 1ull << 30;
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(50ms);
  const GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].found_by == FoundBy::kPoll);
  REQUIRE(st.jobs[0].time_to_govern.has_value());
  CHECK(st.jobs[0].late_adoption);
  CHECK(st.jobs[0].copied_before_governed_bytes >= (1ull << 30));
  // Its steps count from the poll's listing of it: neither the scan's beginning before it nor
  // the listing itself is a step; the speed call is.
  CHECK_FALSE(st.jobs[0].scan_began_after.has_value());
  CHECK_FALSE(st.jobs[0].job_listed_after.has_value());
  REQUIRE(st.jobs[0].speed_taken_after.has_value());
  CHECK(*st.jobs[0].speed_taken_after == kSpeedCall);
  // The daemon's record says so, once.
  std::vector<std::string> records;
  DaemonLog log([&records](std::string_view r) { records.emplace_back(r); });
  log.observe(st, "qemu:///system", "");
  log.observe(gv.g.status(w.now), "qemu:///system", "");
  const auto late = std::count_if(records.begin(), records.end(), [](const std::string& r) {
    return r.find("domain vm1 disk vda: first speed read back from QEMU ") == 0 &&
           r.find("after the job was found (poll); speed taken +7.0 ms") !=
               std::string::npos &&
           r.find("; late adoption: 1024.0 MiB copied unpaced") != std::string::npos;
  });
  CHECK(late == 1);
}

// QEMU keeps speed 0 although the calls succeed: the governor reads it back, says so once (one
// line naming the domain, the disk, the speed asked for and the speed QEMU has), claims no speed
// QEMU does not have, and sets it again at the next tick.
TEST_CASE("plugin.governor.speed_not_taken_is_read_back_and_retried") {
  World w;
  std::vector<std::string> notices;
  GovernorOptions opt;
  opt.clock = [&w] { return w.now; };
  opt.notice = [&notices](const std::string& m) { notices.push_back(m); };
  Governor g(w.hv, w.files, DaemonConfig{}, opt);
  (void)g.step(w.now);  // connect; nothing runs yet
  w.start_job(JobType::ActiveCommit);
  w.hv.emit(job_started(w.dom, w.now, ""));
  w.hv.speed_calls_ignored = 5;  // every call of the adopting step
  const std::size_t calls_before = w.hv.speed_calls.size();
  TimePoint next = g.step(w.now);  // finds, holds and adopts the job
  REQUIRE(w.hv.speed_calls.size() > calls_before);
  CHECK(w.hv.speed(w.dom, "vda") == 0);
  GovernorStatus st = g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].speed_bytes_per_s == w.hv.speed(w.dom, "vda"));  // no claim QEMU contradicts
  CHECK(st.jobs[0].speed_wanted_bytes_per_s > 0);
  CHECK_FALSE(st.jobs[0].time_to_govern.has_value());
  const auto mismatches = std::count_if(notices.begin(), notices.end(), [](const std::string& m) {
    return m.find("read back as 0 B/s") != std::string::npos;
  });
  CHECK(mismatches == 1);  // once, not at every call
  REQUIRE_FALSE(notices.empty());
  const std::string wanted = std::to_string(st.jobs[0].speed_wanted_bytes_per_s) + " B/s";
  CHECK(notices.front().find("domain vm1 disk vda: job speed set to " + wanted) == 0);
  // The next tick sets it again, and QEMU takes it.
  w.hv.speed_calls_ignored = 0;
  w.run(g, 150ms, &next);
  CHECK(w.hv.speed(w.dom, "vda") > 0);
  st = g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].speed_bytes_per_s == w.hv.speed(w.dom, "vda"));
  REQUIRE(st.jobs[0].time_to_govern.has_value());
  CHECK(*st.jobs[0].time_to_govern >= 50ms);  // governed at the next tick, not at adoption
  CHECK(notices.back().find("as set") != std::string::npos);
}

}  // namespace qcommit::plugin::test
