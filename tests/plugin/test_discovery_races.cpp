// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd's job discovery against other actors' timing (issue 23): a job that appears,
// disappears and reappears within a poll, end events that reach the daemon after a poll or tick
// already saw what followed them, and libvirtd restarting while a job runs.  FakeHypervisor in
// virtual time.
//
// libvirt's client dispatches an event only from the event loop, after the calls in flight have
// returned: a job query answered after the job ended (or after the next job started) can reach
// the governor before the event of that end.  The tests emit the event after the governor has
// seen the new state to play that order.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "plugin/daemon/control.h"
#include "plugin/govern/governor.h"
#include "tests/plugin/fake_hypervisor.h"
#include "tests/plugin/world.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

// Ids of the jobs governed at any step of `dt` (each id is one adoption).
std::set<std::uint64_t> governed_ids(Governed& gv, Duration dt) {
  std::set<std::uint64_t> ids;
  gv.run(dt, [&] {
    for (const auto& j : gv.g.status(gv.w.now).jobs) ids.insert(j.id);
  });
  return ids;
}

void emit_end(World& w, JobEventKind kind, JobType type) {
  w.hv.emit(JobEvent{kind, "vm1", "vda", type, ""});
}

}  // namespace

TEST_CASE("plugin.discovery.unanswered_query_keeps_the_job") {
  // The job's query fails for longer than a poll (libvirt's domain lock held by another call,
  // the domain in transition) and then answers again: the same job, adopted once, never
  // released meanwhile, and governed again at once.
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(2s);
  REQUIRE(gv.g.job_count() == 1);
  const std::uint64_t id = gv.g.status(w.now).jobs.at(0).id;
  w.hv.unknown_jobs.insert({"vm1", "vda"});
  const int queries = w.hv.job_queries;
  const std::set<std::uint64_t> during = governed_ids(gv, 1200ms);  // two polls, twelve ticks
  CHECK(w.hv.job_queries > queries + 10);                           // it was asked, and failed
  CHECK(during == std::set<std::uint64_t>{id});
  w.hv.unknown_jobs.clear();
  const std::size_t calls = w.hv.speed_calls.size();
  const std::set<std::uint64_t> after = governed_ids(gv, 1s);
  CHECK(after == std::set<std::uint64_t>{id});
  CHECK(gv.g.status(w.now).released.empty());
  CHECK(w.hv.speed_calls.size() > calls);  // governed again
}

TEST_CASE("plugin.discovery.end_event_after_the_next_job_is_adopted") {
  // `virsh blockcommit --active --pivot` ends, and a `virsh blockcommit` (non-active) starts on
  // the same disk at once; the poll sees the new job before the first one's "completed" event is
  // dispatched.  The event must not release the new job (it would be adopted a second time at
  // the next poll, its controller started over); it tells how the first one ended.
  SUBCASE("another type") {
    World w;
    w.start_job(JobType::ActiveCommit);
    Governed gv(w);
    gv.run(2s);
    REQUIRE(gv.g.status(w.now).jobs.at(0).id == 1);
    w.start_job(JobType::Commit);  // the next job, from 0
    gv.run(600ms);
    auto st = gv.g.status(w.now);
    REQUIRE(st.jobs.size() == 1);
    CHECK(st.jobs[0].id == 2);
    CHECK(st.jobs[0].type == JobType::Commit);
    emit_end(w, JobEventKind::Completed, JobType::ActiveCommit);
    const std::set<std::uint64_t> ids = governed_ids(gv, 1500ms);
    CHECK(ids == std::set<std::uint64_t>{2});
    st = gv.g.status(w.now);
    REQUIRE(st.released.size() == 1);
    CHECK(st.released[0].id == 1);
    CHECK(st.released[0].reason == kEndCompleted);
    CHECK(std::string(end_state(st.released[0])) == "pivoted");
  }
  SUBCASE("the same type, progress from 0") {
    World w;
    w.start_job(JobType::Commit);
    Governed gv(w);
    gv.run(2s);
    REQUIRE(w.cur() > (1u << 20));
    w.start_job(JobType::Commit);
    gv.run(600ms);
    REQUIRE(gv.g.status(w.now).jobs.at(0).id == 2);
    emit_end(w, JobEventKind::Canceled, JobType::Commit);
    CHECK(governed_ids(gv, 1500ms) == std::set<std::uint64_t>{2});
    const auto st = gv.g.status(w.now);
    REQUIRE(st.released.size() == 1);
    CHECK(st.released[0].id == 1);
    CHECK(std::string(end_state(st.released[0])) == "canceled");
  }
}

TEST_CASE("plugin.discovery.end_event_before_the_next_job_is_seen") {
  // The same restart, the event first: "completed" for the first job reaches the governor before
  // any query saw the change (the next job's JOB_STATUS_CHANGE, a QEMU monitor event, may come
  // later).  One step releases the first job as completed and adopts the next: never a moment
  // without it, never twice.
  World w;
  w.start_job(JobType::Commit);
  Governed gv(w);
  gv.run(2s);
  gv.run(20ms);  // just after a poll
  w.start_job(JobType::Commit);
  emit_end(w, JobEventKind::Completed, JobType::Commit);
  (void)gv.g.step(w.now);
  auto st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].id == 2);
  REQUIRE(st.released.size() == 1);
  CHECK(st.released[0].id == 1);
  CHECK(std::string(end_state(st.released[0])) == "completed");
  CHECK(governed_ids(gv, 1500ms) == std::set<std::uint64_t>{2});
  CHECK(gv.g.status(w.now).released.size() == 1);

  // A job that appears and ends between two polls, seen only through its events: not adopted,
  // nothing released, its speed never touched.
  w.hv.jobs.clear();
  emit_end(w, JobEventKind::Completed, JobType::Commit);
  gv.run(1s);
  REQUIRE(gv.g.job_count() == 0);
  gv.run(20ms);
  const std::size_t released = gv.g.status(w.now).released.size();
  const std::size_t calls = w.hv.speed_calls.size();
  w.hv.emit(JobEvent{JobEventKind::StatusChange, "vm1", "", JobType::Unknown, "created"});
  w.hv.emit(JobEvent{JobEventKind::StatusChange, "vm1", "", JobType::Unknown, "concluded"});
  emit_end(w, JobEventKind::Completed, JobType::Commit);
  gv.run(1s);
  CHECK(gv.g.job_count() == 0);
  CHECK(gv.g.status(w.now).released.size() == released);
  CHECK(w.hv.speed_calls.size() == calls);
}

TEST_CASE("plugin.discovery.tick_sees_the_end_before_the_event") {
  // A tick's query finds the job gone before its "completed" (or "failed") event is dispatched:
  // released once, and the late event gives the release its reason (what `qcommit status` shows),
  // instead of "no longer listed".
  for (const auto& ks :
       {std::pair{JobEventKind::Completed, "pivoted"}, std::pair{JobEventKind::Failed, "failed"}}) {
    // Plain variables, not a structured binding: clang 14 cannot capture one (CAPTURE).
    const JobEventKind kind = ks.first;
    const char* const state = ks.second;
    CAPTURE(state);
    World w;
    w.start_job(JobType::ActiveCommit);
    Governed gv(w);
    gv.run(2s);
    w.hv.jobs.clear();
    gv.run(150ms);  // a tick
    REQUIRE(gv.g.job_count() == 0);
    emit_end(w, kind, JobType::ActiveCommit);
    gv.run(20ms);
    const auto st = gv.g.status(w.now);
    REQUIRE(st.released.size() == 1);
    CHECK(std::string(end_state(st.released[0])) == state);
    CHECK(st.released[0].reason == (kind == JobEventKind::Completed ? kEndCompleted : kEndFailed));
    const std::string json = status_json(st, w.now);
    CHECK(json.find(std::string("\"state\":\"") + state + "\"") != std::string::npos);
  }
  // Too late to be about it (another job may have come and gone since): left as it was.
  World w;
  w.start_job(JobType::Commit);
  Governed gv(w);
  gv.run(2s);
  w.hv.jobs.clear();
  gv.run(150ms);
  gv.run(kLateEndEvent + 1s);
  emit_end(w, JobEventKind::Completed, JobType::Commit);
  gv.run(20ms);
  CHECK(std::string(end_state(gv.g.status(w.now).released.at(0))) == "ended");
}

TEST_CASE("plugin.discovery.job_replaced_while_disconnected") {
  // libvirtd restarts; meanwhile the commit on vda ends and an active commit starts on the same
  // disk.  Back, the governor must not take the new job for the old one (its type, target and
  // chunk handling differ): the old one ended while disconnected, the new one is adopted.
  World w;
  w.start_job(JobType::Commit, 1ull << 30);
  Governed gv(w);
  gv.run(2s);
  REQUIRE(gv.g.status(w.now).jobs.at(0).type == JobType::Commit);
  w.hv.libvirtd_stops();
  gv.run(1s);
  w.start_job(JobType::ActiveCommit);
  w.hv.daemon_up = true;
  gv.run(6s);
  const auto st = gv.g.status(w.now);
  REQUIRE(st.connected);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].type == JobType::ActiveCommit);
  CHECK(st.jobs[0].id == 2);
  REQUIRE(st.released.size() == 1);
  CHECK(st.released[0].id == 1);
  CHECK(st.released[0].reason == kEndWhileDisconnected);
}

TEST_CASE("plugin.discovery.libvirtd_restart_is_waited_out") {
  // libvirtd is down for 20 s while the job runs: the governor retries with a back-off (500 ms
  // doubling to 5 s: a restart is found within 5 s, a daemon that stays down is not hammered),
  // keeps the job (QEMU runs it on), and governs the same job again once libvirtd is back.
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(2s);
  const std::uint64_t id = gv.g.status(w.now).jobs.at(0).id;
  w.hv.libvirtd_stops();
  const int connects = w.hv.connects;
  std::vector<TimePoint> attempts;
  int seen = connects;
  gv.run(20s, [&] {
    if (w.hv.connects != seen) {
      seen = w.hv.connects;
      attempts.push_back(w.now);
    }
  });
  // At about 0, 0.5, 1.5, 3.5, 7.5, 12.5 and 17.5 s.
  CHECK(attempts.size() >= 6);
  CHECK(attempts.size() <= 8);
  for (std::size_t i = 1; i < attempts.size(); ++i) {
    CHECK(attempts[i] - attempts[i - 1] >= 450ms);
    CHECK(attempts[i] - attempts[i - 1] <= 5s + 10ms);
    if (i >= 2) CHECK(attempts[i] - attempts[i - 1] >= attempts[i - 1] - attempts[i - 2]);
  }
  CHECK(gv.g.job_count() == 1);
  w.hv.daemon_up = true;
  const TimePoint up = w.now;
  while (!gv.g.status(w.now).connected && w.now < up + 10s) gv.run(10ms);
  CHECK(gv.g.status(w.now).connected);
  CHECK(w.now - up <= 5s + 20ms);
  // Governed again: a speed somebody else set (`virsh blockjob --bandwidth`) is replaced.
  w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s = 1;
  CHECK(governed_ids(gv, 1s) == std::set<std::uint64_t>{id});
  CHECK(w.hv.speed("vm1", "vda") >= kMinJobSpeedBytesPerS);
  CHECK(gv.g.status(w.now).released.empty());
}
