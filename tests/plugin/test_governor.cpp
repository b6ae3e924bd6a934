// SPDX-License-Identifier: GPL-2.0-or-later
// Governor against the scripted FakeHypervisor, in virtual time.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>

#include "plugin/daemon/control.h"
#include "plugin/govern/governor.h"
#include "tests/plugin/fake_hypervisor.h"
#include "tests/plugin/fake_qemu_graph.h"
#include "tests/plugin/world.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

TEST_CASE("plugin.discovery.poll") {
  World w;
  Governed gv(w);
  gv.run(1s);
  CHECK(gv.g.job_count() == 0);
  gv.run(130ms);
  w.start_job();  // no event: only polling can find it
  const TimePoint created = w.now;
  TimePoint found{};
  while (w.now < created + 2s) {
    gv.run(10ms);
    if (gv.g.job_count() == 1) {
      found = w.now;
      break;
    }
  }
  REQUIRE(gv.g.job_count() == 1);
  CHECK(found - created <= 500ms + 10ms);
  CHECK(w.hv.speed("vm1", "vda") > 0);
}

TEST_CASE("plugin.discovery.event") {
  World w;
  Governed gv(w);
  gv.run(1s);
  // Just after a poll: the next poll is ~0.5 s away; the event must make it faster.
  w.start_job(JobType::Commit);
  w.hv.emit(JobEvent{JobEventKind::StatusChange, "vm1", "", JobType::Unknown, "created"});
  const TimePoint created = w.now;
  while (gv.g.job_count() == 0 && w.now < created + 1s) gv.run(10ms);
  CHECK(gv.g.job_count() == 1);
  CHECK(w.now - created <= 120ms);
}

TEST_CASE("plugin.discovery.adopts_running_jobs_at_start") {
  World w;
  w.start_job();
  w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s = 0;  // unlimited when we arrive
  Governor g(w.hv, w.files, DaemonConfig{});
  (void)g.step(w.now);
  CHECK(g.job_count() == 1);
  CHECK(w.hv.speed("vm1", "vda") > 0);
  const auto st = g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].target == kBase);
  CHECK(st.jobs[0].pool == "fast");
}

TEST_CASE("plugin.governor.stall_min_speed_then_recovery") {
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(4s);
  const double before = gv.progress(1s);
  CHECK(before > 20.0 * kMinJobSpeedBytesPerS);

  // Guest I/O stops completing (stuck behind a queue): no stats movement.
  w.guest_active = false;
  const TimePoint stall = w.now;
  // The stall response (not a transient backlog > window): the controller pauses.
  while (gv.g.status(w.now).jobs.at(0).phase != "paused" && w.now < stall + 1s) gv.run(10ms);
  CHECK(gv.g.status(w.now).jobs.at(0).phase == "paused");
  CHECK(w.hv.speed("vm1", "vda") == kMinJobSpeedBytesPerS);
  CHECK(w.now - stall <= 600ms);
  const size_t calls = w.hv.speed_calls.size();
  const double stalled = gv.progress(1s);
  CHECK(stalled <= 1.5 * kMinJobSpeedBytesPerS);  // held at the minimum, not 0 (unlimited)
  for (size_t i = calls; i < w.hv.speed_calls.size(); ++i)
    CHECK(w.hv.speed_calls[i].speed == kMinJobSpeedBytesPerS);

  // Completions with normal latency again: speed rises.
  w.guest_active = true;
  gv.run(1s);
  const double after = gv.progress(2s);
  CHECK(after > 20.0 * kMinJobSpeedBytesPerS);
  CHECK_FALSE(w.speed_ever_zero());
  CHECK(gv.g.status(w.now).jobs.at(0).latency_p99.has_value());
}

TEST_CASE("plugin.governor.idle_storage_runs_free") {
  // No guest on the job's storage does any I/O (its stats are read, nothing moves): nobody to
  // protect.  The job must not stay at its starting rate or, after the first slowdown, at the
  // floor until some guest happens to write (a `virsh blockcommit` of an idle VM took hours).
  World w;
  w.guest_active = false;
  w.other_active = false;
  w.start_job();
  Governed gv(w);
  gv.run(12s);  // past the first slowdown
  const double rate = gv.progress(10s);
  MESSAGE("idle storage: " << rate / 1048576.0 << " MiB/s");
  CHECK(rate > 20.0 * DaemonConfig{}.defaults.floor_bytes_per_s);
  CHECK_FALSE(w.speed_ever_zero());
}

TEST_CASE("plugin.governor.other_storage_does_not_throttle") {
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(3s);
  const double before = gv.progress(2s);
  w.other_active = false;  // vm2's disk is on another filesystem (st_dev 9)
  gv.run(500ms);
  const double during = gv.progress(1s);
  CHECK(during > 20.0 * kMinJobSpeedBytesPerS);
  CHECK(during > 0.3 * before);
}

TEST_CASE("plugin.governor.high_latency_slows_down") {
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(3s);
  const double fast = gv.progress(2s);
  w.guest_latency = 200ms;  // 10 x budget of queueing delay
  gv.run(300ms);
  const double slow = gv.progress(1s);
  CHECK(slow < 0.2 * fast);
  CHECK_FALSE(w.speed_ever_zero());
}

TEST_CASE("plugin.governor.mirror_that_does_not_converge_gets_a_floor") {
  // The guest dirties its disk at 4 MiB/s while its latency holds the copy at its floor: the
  // active commit's bytes left grow, it would never be ready.  Said at once (not converging, no
  // ETA); after kNotConvergingAfter it runs at >= 2 x the guest's rate and its work shrinks (less
  // a settle's hold of up to 2 s in 10 s, where the target is not clean: >= 1 MiB/s net).
  constexpr double kMiB = qcommit::throttle::kMiB;
  World w;
  w.storage_bytes_per_s = 50.0 * kMiB;
  w.start_job(JobType::ActiveCommit, 1ull << 30);
  Governed gv(w);
  gv.run(2s);
  w.guest_latency = 200ms;
  w.guest_dirty_bytes_per_s = 4.0 * kMiB;
  const auto left = [&w] {
    const JobInfo& j = w.hv.jobs.at({w.dom, "vda"});
    return j.end - j.cur;
  };
  // Said within the longest window: paused at the floor, the mirror's two bursts take longer.
  gv.run(kMaxConvergeWindow + 5s);
  GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].converging == false);
  CHECK_FALSE(st.jobs[0].eta_s.has_value());
  CHECK(st.jobs[0].converge_floor_bytes_per_s == 0);
  CHECK(st.jobs[0].added_bytes_per_s == doctest::Approx(4.0 * kMiB).epsilon(0.02));
  gv.run(kNotConvergingAfter);
  st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].converge_floor_bytes_per_s >= kConvergeFloorFactor * 4.0 * kMiB * 0.98);
  const std::uint64_t before = left();
  gv.run(10s);
  const std::uint64_t after = left();
  MESSAGE("bytes left " << static_cast<double>(before) / kMiB << " -> " << static_cast<double>(after) / kMiB << " MiB in 10 s");
  CHECK(after + 10 * std::uint64_t{1} * 1024 * 1024 < before);  // >= 1 MiB/s net
  st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].converging == true);
  REQUIRE(st.jobs[0].eta_s.has_value());
  CHECK(*st.jobs[0].eta_s > 0);
  CHECK(static_cast<double>(st.jobs[0].speed_bytes_per_s) >= kConvergeFloorFactor * 4.0 * kMiB * 0.98);
}

namespace {

// The copy's progress with the merged guest's writes at 20 ms, after 3 s at 2 ms: storage at
// 50 MiB/s, its writeback timed, and each of the guest's writes (one per 10 ms) carrying
// `write_bytes` in its stats.  Returns {before, during}.
std::pair<double, double> progress_with_slow_guest(std::uint64_t write_bytes) {
  World w;
  w.storage_bytes_per_s = 50.0 * qcommit::throttle::kMiB;
  w.time_writeback = true;
  w.guest_write_bytes = write_bytes;
  w.start_job();
  Governed gv(w);
  gv.run(3s);
  const double before = gv.progress(2s);
  w.guest_latency = 20ms;
  gv.run(2s);
  return {before, gv.progress(3s)};
}

}  // namespace

TEST_CASE("plugin.governor.busy_guest_does_not_starve_the_copy") {
  // The guest writes 8 MiB/s in 80 KiB requests: the 2 MiB it wrote in the last 250 ms take
  // 40 ms at the storage, so its 20 ms are its own queueing, and the copy's writeback (timed:
  // the storage's rate) explains none of it.  Charged every delay, the copy fell to its floor.
  const auto [before, busy] = progress_with_slow_guest(80 * 1024);
  MESSAGE("copy " << before / qcommit::throttle::kMiB << " MiB/s, beside the busy guest " << busy / qcommit::throttle::kMiB << " MiB/s");
  CHECK(busy > 0.5 * before);
}

TEST_CASE("plugin.governor.delay_the_guests_do_not_explain_slows_down") {
  // The same 20 ms, but the guest writes 4 KiB requests (400 KiB/s): its own requests explain
  // about 2 ms of it; the rest (another host's copy, say) is charged and the copy backs off.
  const auto [before, slowed] = progress_with_slow_guest(4 * 1024);
  MESSAGE("copy " << before / qcommit::throttle::kMiB << " MiB/s, beside the light guest " << slowed / qcommit::throttle::kMiB << " MiB/s");
  CHECK(slowed < 0.3 * before);
}

TEST_CASE("plugin.governor.reconnect_and_readopt") {
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(2s);
  REQUIRE(gv.g.job_count() == 1);
  const int connects = w.hv.connects;
  w.hv.libvirtd_stops();
  gv.run(3s);
  CHECK_FALSE(gv.g.status(w.now).connected);
  CHECK(w.hv.connects > connects + 1);  // kept retrying
  CHECK(gv.g.job_count() == 1);         // state kept: QEMU keeps running the job
  const size_t calls = w.hv.speed_calls.size();
  w.hv.daemon_up = true;
  gv.run(6s);  // reconnect backoff is at most 5 s
  CHECK(gv.g.status(w.now).connected);
  CHECK(gv.g.job_count() == 1);
  CHECK(w.hv.speed_calls.size() > calls);

  // A job that ended while libvirtd was away is released at the re-adoption poll.
  w.hv.libvirtd_stops();
  gv.run(1s);
  w.hv.jobs.clear();
  w.hv.daemon_up = true;
  gv.run(6s);
  CHECK(gv.g.job_count() == 0);
  const auto st = gv.g.status(w.now);
  REQUIRE_FALSE(st.released.empty());
  CHECK(st.released.front().reason == "ended while disconnected");
}

TEST_CASE("plugin.governor.restart_readopts") {
  World w;
  w.start_job();
  {
    Governed gv(w);
    gv.run(2s);
    gv.g.release_all();  // graceful stop: a finishing speed, never the minimum
    CHECK(w.hv.speed("vm1", "vda") >= 1024 * 1024);
  }
  Governed restarted(w);
  restarted.run(200ms);
  CHECK(restarted.g.job_count() == 1);
}

TEST_CASE("plugin.governor.commit_into_an_intermediate_image") {
  // `virsh blockcommit vm1 vda --top mid2 --base mid`: libvirt names no base; the host tells
  // which image QEMU holds read-write, and the pacer watches that one, not the bottom image.
  const std::string mid = "/pool/vm1-mid.qcow2";
  auto run = [&](std::optional<std::string> answer) {
    World w;
    auto mid_file = std::make_shared<FakeFileState>();
    w.files.files[mid] = mid_file;
    w.files.commit_base_answer = std::move(answer);
    w.hv.domains[0].disks[0].backing_chain = {"/pool/vm1-mid2.qcow2", mid, kBase};
    w.start_job(JobType::Commit);
    Governed gv(w);
    gv.run(2s);
    const auto st = gv.g.status(w.now);
    REQUIRE(st.jobs.size() == 1);
    return std::make_tuple(st.jobs[0].target, mid_file->whole_readings, w.base->whole_readings);
  };
  const auto [target, mid_readings, base_readings] = run(mid);
  CHECK(target == mid);
  CHECK(mid_readings > 0);
  CHECK(base_readings == 0);
  // The host cannot tell: the bottom image, as before.
  const auto [guess, mid_readings2, base_readings2] = run(std::nullopt);
  CHECK(guess == kBase);
  CHECK(mid_readings2 == 0);
  CHECK(base_readings2 > 0);
}

TEST_CASE("plugin.governor.no_cachestat_other_writers") {
  // A kernel without cachestat(2): the page-cache reading is host-wide, and other writers keep
  // 500 MiB dirty.  Read as the job's backlog, that held the job at the floor for good.  The
  // job's own pages are bounded by what it copied since the last completed fdatasync of its
  // target, and the fdatasyncs (back to back) write them out: the job runs, and what it has
  // queued at storage stays bounded.  (With cachestat the same world gives 0.73 of the storage
  // rate and a p99 of 0.6 MiB under writeback: without it the queue is coarser.)
  for (JobType type : {JobType::Commit, JobType::ActiveCommit}) {
    World w;
    w.storage_bytes_per_s = 50.0 * 1024 * 1024;
    w.base->host_wide = true;
    w.base->other_dirty = 500ull << 20;
    w.start_job(type);
    Governed gv(w);
    gv.run(5s);  // past slow start
    std::vector<std::uint64_t> queued;
    const std::uint64_t c0 = w.cur();
    gv.run(20s, [&] { queued.push_back(w.base->writeback); });
    const double rate = static_cast<double>(w.cur() - c0) / 20.0;
    std::sort(queued.begin(), queued.end());
    const std::uint64_t p50 = queued[queued.size() / 2], p99 = queued[queued.size() * 99 / 100];
    MESSAGE(std::string(to_string(type))
            << ": " << rate / w.storage_bytes_per_s << " of storage rate, queued p50 "
            << (p50 >> 10) << " KiB, p99 " << (p99 >> 10) << " KiB, max " << (queued.back() >> 10)
            << " KiB, " << w.base->settled_with_dirty.size() << " fdatasyncs");
    CHECK(rate > 0.5 * w.storage_bytes_per_s);
    CHECK(p50 <= 2ull << 20);
    CHECK(p99 <= 16ull << 20);
    CHECK(w.base->settled_with_dirty.size() > 100);       // while the job copies
    CHECK(w.base->settled_with_dirty.size() <= 25 * 50);  // at most one per kFallbackSyncGap
    // The job stops copying: the syncs stop too (one more catches up with its last progress).
    w.job_max_bytes_per_s = 1e-9;
    gv.run(1s);
    const std::size_t syncs = w.base->settled_with_dirty.size();
    gv.run(3s);
    CHECK(w.base->settled_with_dirty.size() <= syncs + 1);
  }
  // cache=none: the job's writes bypass the page cache; nothing of the reading is the job's,
  // and no fdatasync is needed.
  World w("vm1");
  w.hv.domains[0].disks[0].cache = "none";
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.base->host_wide = true;
  w.base->other_dirty = 500ull << 20;
  w.start_job(JobType::ActiveCommit);
  Governed gv(w);
  gv.run(5s);
  const std::uint64_t c0 = w.cur();
  gv.run(10s);
  CHECK(static_cast<double>(w.cur() - c0) / 10.0 > 0.5 * w.storage_bytes_per_s);
  CHECK(w.base->settled_with_dirty.empty());
}

TEST_CASE("plugin.governor.release_all_reconnects_once") {
  // libvirtd restarted just before the daemon stops: the finishing speeds still reach the jobs
  // (a gated job would otherwise crawl on at its closed-gate speed).
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(2s);
  w.hv.jobs[{"vm1", "vda"}].bandwidth_bytes_per_s = 1;  // as if gated shut
  w.hv.connection_drops();
  const int connects = w.hv.connects;
  gv.g.release_all();
  CHECK(w.hv.connects == connects + 1);
  CHECK(w.hv.speed("vm1", "vda") >= 1024 * 1024);
  CHECK(gv.g.job_count() == 0);

  // libvirtd really is down: one attempt, no loop.
  World down;
  down.start_job();
  Governed gd(down);
  gd.run(2s);
  down.hv.libvirtd_stops();
  const int before = down.hv.connects;
  gd.g.release_all();
  CHECK(down.hv.connects == before + 1);
  CHECK(gd.g.job_count() == 0);
}

TEST_CASE("plugin.governor.job_failed_released") {
  World w;
  w.start_job(JobType::Commit);
  Governed gv(w);
  gv.run(1s);
  REQUIRE(gv.g.job_count() == 1);
  w.hv.jobs.clear();
  w.hv.emit(JobEvent{JobEventKind::Failed, "vm1", "vda", JobType::Commit, ""});
  gv.run(20ms);
  CHECK(gv.g.job_count() == 0);
  const auto st = gv.g.status(w.now);
  REQUIRE(st.released.size() == 1);
  CHECK(st.released[0].reason == "failed");
  const size_t calls = w.hv.speed_calls.size();
  gv.run(1s);
  CHECK(w.hv.speed_calls.size() == calls);  // no more actuation on a released job
}

TEST_CASE("plugin.governor.pivot_failed_released_and_reported") {
  World w;
  w.start_job(JobType::ActiveCommit, 1 << 20);
  Governed gv(w);
  gv.run(1s);
  REQUIRE(gv.g.job_count() == 1);
  w.hv.emit(JobEvent{JobEventKind::Ready, "vm1", "vda", JobType::ActiveCommit, ""});
  gv.run(200ms);
  CHECK(gv.g.status(w.now).jobs.at(0).ready);
  w.hv.jobs.clear();
  w.hv.emit(JobEvent{JobEventKind::Failed, "vm1", "vda", JobType::ActiveCommit, ""});
  gv.run(20ms);
  CHECK(gv.g.job_count() == 0);
  const std::string json = status_json(gv.g.status(w.now), w.now);
  CHECK(json.find("pivot failed") != std::string::npos);
}

TEST_CASE("plugin.governor.job_vanished_without_event_released") {
  World w;
  w.start_job();
  Governed gv(w);
  gv.run(1s);
  w.hv.jobs.clear();
  gv.run(600ms);
  CHECK(gv.g.job_count() == 0);
}

TEST_CASE("plugin.governor.policy_pool_and_domain_override") {
  World w;
  w.start_job();
  DaemonConfig cfg;
  Policy fast;
  fast.budget = 50ms;
  cfg.pools["fast"] = fast;
  {
    Governor g(w.hv, w.files, cfg);
    (void)g.step(w.now);
    CHECK(g.status(w.now).jobs.at(0).budget == 50ms);
  }
  w.hv.domains[0].policy_xml =
      "<qcommit:policy xmlns:qcommit=\"https://qcommit.dev/xmlns/1\" budget=\"10ms\"/>";
  {
    Governor g(w.hv, w.files, cfg);
    (void)g.step(w.now);
    CHECK(g.status(w.now).jobs.at(0).budget == 10ms);
  }
  w.hv.domains[0].policy_xml = "<qcommit:policy budget=\"soon\"/>";
  {
    Governor g(w.hv, w.files, cfg);
    (void)g.step(w.now);
    const auto js = g.status(w.now).jobs.at(0);
    CHECK(js.budget == 50ms);  // bad metadata: pool policy applies, error reported
    CHECK(js.policy_error.find("bad duration") != std::string::npos);
  }
  // Unknown storage → default.
  w.hv.pool_list.clear();
  w.hv.domains[0].policy_xml.reset();
  {
    Governor g(w.hv, w.files, cfg);
    (void)g.step(w.now);
    CHECK(g.status(w.now).jobs.at(0).budget == 20ms);
    CHECK(g.status(w.now).jobs.at(0).storage == "dev:7");
  }
}

TEST_CASE("plugin.governor.writeback_backlog_bounded") {
  World w;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job();
  Governed gv(w);
  std::uint64_t max_dirty = 0, max_writeback = 0;
  for (int i = 0; i < 1000; ++i) {
    gv.run(10ms);
    if (i > 100) {
      max_dirty = std::max(max_dirty, w.base->dirty + w.base->writeback);
      max_writeback = std::max(max_writeback, w.base->writeback);
    }
  }
  CHECK(w.base->writeback_started > 0);
  // The job cannot get far ahead of the storage: one dirty allowance (a QEMU burst) plus ~ a
  // few ticks of production; what is queued at storage (writeback) stays near the window.
  CHECK(max_dirty < kDirtyAllowanceBytes + 8u * 1024 * 1024);
  CHECK(max_writeback < 4u * 1024 * 1024);
  CHECK(w.hv.jobs.at({"vm1", "vda"}).cur > 20u * 1024 * 1024);
}

TEST_CASE("plugin.governor.mirror_pacer_keeps_part_of_the_window") {
  // A mirror's writeback is kept to kMirrorPacerWindowFraction of the controller's window; a
  // non-active commit's may fill the window.  Writeback is sampled right after each governor
  // step (the pacer has just topped it up), against the window the status reports then.
  auto run = [](JobType t) {
    World w;
    w.storage_bytes_per_s = 50.0 * 1024 * 1024;
    w.start_job(t);
    GovernorOptions opt;
    opt.settle_every = Duration::zero();
    Governed gv(w, DaemonConfig{}, opt);
    double max_share = 0;
    gv.run(3s);
    gv.run(5s, [&] {
      const auto st = gv.g.status(w.now);
      if (st.jobs.empty() || st.jobs[0].window_bytes == 0) return;
      max_share = std::max(max_share, static_cast<double>(w.base->writeback) /
                                          static_cast<double>(st.jobs[0].window_bytes));
    });
    return max_share;
  };
  const double mirror = run(JobType::ActiveCommit), commit = run(JobType::Commit);
  MESSAGE("writeback / window at most: mirror " << mirror << ", commit " << commit);
  CHECK(mirror <= kMirrorPacerWindowFraction + 0.15);  // + one 64 KiB piece of a ~0.5 MB window
  CHECK(commit > kMirrorPacerWindowFraction + 0.1);
  CHECK(commit <= 1.15);
}

TEST_CASE("plugin.governor.pacer_reads_issued_ranges") {
  // 50 MB/s storage, no guest latency: the job should run near the storage's rate.  The pacer
  // reads the whole file only every page_cache_refresh (100 ms, with the tick) and in between
  // only the ranges it issued.  Counting issued bytes as under writeback until the next
  // whole-file reading instead (ranges unreadable) idles the storage most of the time.
  auto run = [](bool ranges_readable, std::uint64_t* whole, std::uint64_t* ranges) {
    World w;
    w.storage_bytes_per_s = 50.0 * 1024 * 1024;
    w.base->ranges_readable = ranges_readable;
    w.start_job();
    GovernorOptions opt;
    opt.settle_every = Duration::zero();  // measured alone
    Governed gv(w, DaemonConfig{}, opt);
    gv.run(5s);
    const std::uint64_t w0 = w.base->whole_readings;
    const double rate = gv.progress(10s);
    *whole = w.base->whole_readings - w0;
    *ranges = w.base->range_readings;
    return rate / w.storage_bytes_per_s;
  };
  std::uint64_t whole = 0, ranges = 0;
  const double tracked = run(true, &whole, &ranges);
  MESSAGE("issued ranges read: " << tracked << " of storage rate, " << whole
                                 << " whole-file readings in 10 s, " << ranges
                                 << " range readings");
  CHECK(tracked > 0.7);
  CHECK(whole <= 10 * 11);  // ~ one per tick
  CHECK(ranges > 0);
  const double untracked = run(false, &whole, &ranges);
  MESSAGE("ranges unreadable: " << untracked << " of storage rate");
  CHECK(untracked < tracked);
}

TEST_CASE("plugin.governor.pacer_stops_sweeping_a_clean_file") {
  // The kernel's flusher writes the job's dirty pages back before the pacer gets to them: the
  // whole-file reading says "dirty", a sweep finds nothing.  One lap per whole-file reading, not
  // one per pace interval (each lap is a cachestat over every cached page of the target).
  World w;
  w.base->dirty_at_front = true;  // like a job writing its target in order
  w.start_job();
  Governed gv(w);
  gv.run(3s);
  const std::uint64_t p0 = w.base->dirty_probes;
  w.base->flusher_after_reading = true;
  gv.run(5s);
  const double per_s = static_cast<double>(w.base->dirty_probes - p0) / 5.0;
  const double lap =
      static_cast<double>(w.base->size / (kWritebackPieceBytes * kWritebackSkipPieces));
  MESSAGE("probes per second: " << per_s << " (one lap: " << lap << " probes)");
  CHECK(per_s <= 11.0 * lap);  // about one lap per tick
}

TEST_CASE("plugin.governor.written_ranges_leave_the_page_cache") {
  // A job that copies 64 MiB in order: once storage has what the pacer pushed, those ranges are
  // dropped from the page cache (and nothing that was still dirty or under writeback).
  World w;
  w.base->dirty_at_front = true;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job(JobType::ActiveCommit, 64ull << 20);
  Governed gv(w);
  gv.run(10s);
  CHECK(w.cur() == 64ull << 20);
  CHECK(w.base->dirty == 0);
  CHECK(w.base->writeback == 0);
  CHECK_FALSE(w.base->dropped.empty());
}

TEST_CASE("plugin.governor.settles_the_target_before_the_kernel_expires_it") {
  CHECK(settle_interval_for(std::chrono::milliseconds(30000)) == 10s);
  CHECK(settle_interval_for(std::chrono::milliseconds(6000)) == 2s);
  CHECK(settle_interval_for(std::chrono::milliseconds(500)) == 1s);
  CHECK(settle_interval_for(std::chrono::milliseconds(0)) == 10s);
  CHECK(settle_interval_for(std::nullopt) == 10s);

  // A job that keeps its target dirty: every ~10 s it is held until the target is clean, then
  // the target is fdatasynced, at a small cost in throughput.
  auto run = [](Duration every, std::vector<std::uint64_t>* settled, std::uint32_t* settles) {
    World w;
    w.base->dirty_at_front = true;
    w.storage_bytes_per_s = 50.0 * 1024 * 1024;
    w.start_job();
    GovernorOptions opt;
    opt.settle_every = every;
    Governed gv(w, DaemonConfig{}, opt);
    gv.run(5s);
    const std::uint64_t c0 = w.cur();
    bool was = false;
    TimePoint since = w.now;
    gv.run(40s, [&] {
      const auto js = gv.g.status(w.now).jobs.at(0);
      if (js.settling && !was) since = w.now;
      if (!js.settling && was)
        MESSAGE(
            "held " << std::chrono::duration_cast<std::chrono::milliseconds>(w.now - since).count()
                    << " ms, dirty " << w.base->dirty << " wb " << w.base->writeback << " window "
                    << js.window_bytes);
      was = js.settling;
    });
    const double rate = static_cast<double>(w.cur() - c0) / 40.0;
    *settled = w.base->settled_with_dirty;
    *settles = gv.g.status(w.now).jobs.at(0).settles;
    return rate;
  };
  std::vector<std::uint64_t> settled;
  std::uint32_t settles = 0;
  const double with = run(10s, &settled, &settles);
  MESSAGE("settling every 10 s: " << with / (50.0 * 1024 * 1024) << " of storage rate, " << settles
                                  << " settles");
  CHECK(settles >= 3);  // 40 s: one per ~10 s (a hold that cannot clean in time is retried)
  CHECK(settles <= 5);
  for (std::uint64_t d : settled) CHECK(d == 0);  // only ever synced with nothing dirty
  const double without = run(Duration::zero(), &settled, &settles);
  MESSAGE("never settling: " << without / (50.0 * 1024 * 1024) << " of storage rate");
  CHECK(settles == 0);
  CHECK(settled.empty());
  CHECK(with > 0.85 * without);
}

TEST_CASE("plugin.governor.settles_a_target_whose_dirty_count_is_a_bound") {
  // A kernel without cachestat: the target's dirty count is its memory cgroup's, which the
  // guests' own cached writes keep above zero.  The settle still comes every ~10 s, once a sweep
  // of the whole target finds nothing to write back, and only ever with nothing dirty.
  World w;
  w.base->dirty_at_front = true;
  w.base->memcg_bound = true;
  w.base->cgroup_other_dirty = 64ull << 20;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job();
  GovernorOptions opt;
  opt.settle_every = 10s;
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(45s);
  const std::uint32_t settles = gv.g.status(w.now).jobs.at(0).settles;
  MESSAGE(settles << " settles in 45 s");
  CHECK(settles >= 3);
  CHECK(settles <= 5);
  REQUIRE(!w.base->settled_with_dirty.empty());
  for (std::uint64_t d : w.base->settled_with_dirty) CHECK(d == 0);
}

TEST_CASE("plugin.governor.settles_the_target_before_the_pivot") {
  // QEMU flushes the target at the pivot while the guest's requests wait: the job is held and the
  // target settled first, with nothing dirty left, and the job stays held until it ends.
  World w;
  w.base->dirty_at_front = true;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job();
  GovernorOptions opt;
  opt.settle_every = 60s;  // no periodic settle in this test
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(5s);
  REQUIRE(w.base->dirty > 0);
  REQUIRE(w.base->settled_with_dirty.empty());
  std::optional<TimePoint> ready_at;
  const TimePoint asked = w.now;
  gv.run(3s, [&] {
    if (!ready_at && gv.g.settled_for_pivot(w.dom, "vda", w.now)) ready_at = w.now;
  });
  REQUIRE(ready_at.has_value());
  MESSAGE("ready to pivot after "
          << std::chrono::duration_cast<std::chrono::milliseconds>(*ready_at - asked).count()
          << " ms");
  REQUIRE(w.base->settled_with_dirty.size() == 1);
  CHECK(w.base->settled_with_dirty[0] == 0);
  CHECK(*ready_at - asked <= opt.settle_max_hold);
  // Held at the floor from then on: the target stays clean for the switch.
  const std::uint64_t c0 = w.cur();
  gv.run(1s);
  CHECK(w.cur() - c0 <= 2 * kMinJobSpeedBytesPerS);
  CHECK(gv.g.settled_for_pivot(w.dom, "vda", w.now));
  // A disk without a governed job pivots at once.
  CHECK(gv.g.settled_for_pivot(w.dom, "vdz", w.now));
}

TEST_CASE("plugin.governor.settle_gives_up_and_retries") {
  // The fdatasync cannot start (a previous one still running): the hold ends after
  // settle_max_hold and is retried later; the job is never stuck at the floor.
  World w;
  w.base->dirty_at_front = true;
  w.base->settle_busy = true;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job();
  GovernorOptions opt;
  opt.settle_every = 2s;
  Governed gv(w, DaemonConfig{}, opt);
  int settling = 0, samples = 0;
  gv.run(20s, [&] {
    ++samples;
    if (gv.g.status(w.now).jobs.at(0).settling) ++settling;
  });
  CHECK(gv.g.status(w.now).jobs.at(0).settles == 0);
  CHECK(settling > 0);
  CHECK(settling < samples / 2);
  CHECK(w.cur() > 100ull << 20);
}

namespace {
// 8 MiB left of a job of type `t` and 12 MiB of BASE dirty: QEMU flushes BASE right after the
// job's last burst (a mirror before ready; a non-active commit as it completes, with the guest's
// requests drained), so the job stays at the floor until the pacer has written the dirty pages
// out, and then goes on.
void job_end_waits_for_clean_base(JobType t) {
  World w;
  w.base->dirty_at_front = true;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job(t, 64ull << 20);
  Governed gv(w);
  gv.run(3s);  // adopted, past slow start
  auto& job = w.hv.jobs[{"vm1", "vda"}];
  job.cur = job.end - (8ull << 20);
  w.base->dirty = 12ull << 20;
  bool held_while_dirty = true, released = false, drained = false;
  const TimePoint t0 = w.now;
  gv.run(3s, [&] {
    const std::uint64_t speed = w.hv.speed("vm1", "vda");
    const std::uint64_t dirty = w.base->dirty + w.base->writeback;
    if (dirty == 0) drained = true;
    // Until the dirty pages from before are out (one tick to notice them), the floor.
    if (!drained && w.now - t0 > GovernorOptions{}.tick + 50ms && speed > kMinJobSpeedBytesPerS)
      held_while_dirty = false;
    if (drained && speed > kMinJobSpeedBytesPerS) released = true;
  });
  CHECK(held_while_dirty);
  CHECK(released);
}
}  // namespace

TEST_CASE("plugin.governor.mirror_end_waits_for_clean_base") {
  job_end_waits_for_clean_base(JobType::ActiveCommit);
}

TEST_CASE("plugin.governor.commit_end_waits_for_clean_base") {
  job_end_waits_for_clean_base(JobType::Commit);
}

TEST_CASE("plugin.governor.commit_data_left_waits_for_clean_base") {
  // A non-active commit's progress counts the unallocated parts of the image (QEMU skips them
  // without writing): 8 MiB of its layers' data left (between 504 MiB and 512 MiB, and 4 KiB at
  // 2.5 GiB, say a guest's probe area), with 12 MiB of BASE dirty, the job is held at the floor
  // until the pacer has written them out, and then runs no faster than one window per tick (or
  // kFinishingSpeedBytesPerS), so that little is dirty when QEMU completes and flushes BASE.
  World w;
  w.base->dirty_at_front = true;
  w.storage_bytes_per_s = 50.0 * 1024 * 1024;
  w.files.commit_extents_answer =
      std::vector<ByteRange>{{0, 512ull << 20}, {(5ull << 30) / 2, 4096}};
  w.start_job(JobType::Commit, 8ull << 30);
  Governed gv(w);
  gv.run(3s);  // adopted, past slow start
  auto& job = w.hv.jobs[{"vm1", "vda"}];
  job.cur = (512ull - 8) << 20;
  w.base->dirty = 12ull << 20;
  bool held_while_dirty = true, released = false, drained = false, within_a_window = true;
  const TimePoint t0 = w.now;
  gv.run(3s, [&] {
    const std::uint64_t speed = w.hv.speed("vm1", "vda");
    if (w.base->dirty + w.base->writeback == 0) drained = true;
    if (!drained && w.now - t0 > GovernorOptions{}.tick + 50ms && speed > kMinJobSpeedBytesPerS)
      held_while_dirty = false;
    if (drained && speed > kMinJobSpeedBytesPerS) released = true;
    // Per 100 ms tick at most a window or 0.8 MiB (kFinishingSpeedBytesPerS), whichever is more.
    const std::uint64_t window = gv.g.status(w.now).jobs.at(0).window_bytes;
    const std::uint64_t cap = std::max(kFinishingSpeedBytesPerS, window * 10 + window / 10);
    if (drained && speed > cap) within_a_window = false;
  });
  CHECK(held_while_dirty);
  CHECK(released);
  CHECK(within_a_window);
}

TEST_CASE("plugin.governor.commit_finishing_speed_has_a_floor") {
  // A window near the controller's minimum (a 1 ms budget: 64-175 KiB) would give one window per
  // tick, 0.6-1.7 MB/s, for the last 16 MiB of a non-active commit's data: 25 s (lab, QEMU 10).
  // Once BASE is clean the job finishes at kFinishingSpeedBytesPerS instead, never above the
  // controller's rate.  Held every other tick while the pacer writes out what it let through,
  // the job's last 8 MiB take about 2.5 s (one window per tick: about 10 s).
  World w;
  w.base->dirty_at_front = true;
  w.storage_bytes_per_s = 200.0 * 1024 * 1024;
  w.files.commit_extents_answer = std::vector<ByteRange>{{0, 512ull << 20}};
  w.start_job(JobType::Commit, 8ull << 30);
  DaemonConfig cfg;
  cfg.defaults.budget = 1ms;
  Governed gv(w, cfg);
  gv.run(3s);  // adopted, past slow start
  auto& job = w.hv.jobs[{"vm1", "vda"}];
  job.cur = (512ull - 8) << 20;
  std::uint64_t max_window = 0;
  std::optional<TimePoint> done;
  const TimePoint t0 = w.now;
  gv.run(8s, [&] {
    max_window = std::max(max_window, gv.g.status(w.now).jobs.at(0).window_bytes);
    if (!done && job.cur >= 512ull << 20) done = w.now;
  });
  MESSAGE("window at most " << max_window << " bytes");
  REQUIRE(max_window * 10 < kFinishingSpeedBytesPerS / 4);  // the window alone: 5 s or more
  REQUIRE(done.has_value());
  MESSAGE(
      "last 8 MiB in " << std::chrono::duration_cast<std::chrono::milliseconds>(*done - t0).count()
                       << " ms");
  CHECK(*done - t0 <= 4s);
}

namespace {
// A non-active commit on a cache=none disk (its chunks reach the storage as they are), on
// storage that takes 50 MB/s.
void start_direct_commit(World& w) {
  w.hv.domains[0].disks[0].cache = "none";
  w.job_max_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job(JobType::Commit, 1ull << 40);
}
}  // namespace

TEST_CASE("plugin.governor.chunk_gate_spaces_direct_commit_chunks") {
  // cache=none: QEMU 7.2's non-active commit writes its 512 KiB chunks straight to storage.  The
  // governor opens the job for one chunk per chunk/rate (open speed, then the closed speed at the
  // next pace) instead of leaving it a steady speed that QEMU spends in 100 ms bursts.
  World w;
  start_direct_commit(w);
  Governed gv(w);
  gv.run(3s);
  const std::size_t first = w.hv.speed_calls.size();
  std::vector<TimePoint> opens;
  std::size_t seen = first;
  gv.run(2s, [&] {
    for (; seen < w.hv.speed_calls.size(); ++seen)
      if (w.hv.speed_calls[seen].speed == kChunkGateOpenSpeedBytesPerS) opens.push_back(w.now);
  });
  const std::uint64_t rate = gv.g.status(w.now).jobs.at(0).speed_bytes_per_s;
  REQUIRE(rate > kMinJobSpeedBytesPerS);
  // Every opening is followed by a closing (a speed below the paced rate, never 0).
  for (std::size_t i = first; i + 1 < w.hv.speed_calls.size(); ++i) {
    const std::uint64_t s = w.hv.speed_calls[i].speed;
    CHECK(s > 0);
    if (s == kChunkGateOpenSpeedBytesPerS) CHECK(w.hv.speed_calls[i + 1].speed < rate);
  }
  // One opening per chunk at the paced rate (the rate moves a little over the 2 s).
  const double expected = 2.0 * static_cast<double>(rate) / static_cast<double>(kQemuChunkBytes);
  CHECK(static_cast<double>(opens.size()) > 0.6 * expected);
  CHECK(static_cast<double>(opens.size()) < 1.4 * expected);
  for (std::size_t i = 1; i < opens.size(); ++i) CHECK(opens[i] - opens[i - 1] >= 2ms);
}

TEST_CASE("plugin.governor.chunk_gate_lost_close_is_redone") {
  // A close that did not reach QEMU (a refused call, libvirtd gone for a moment) leaves the job at
  // the open speed, unthrottled.  While the job is held (the guests stall) the gate does not open
  // and close again by itself: the next tick sees the job's speed and closes it again.
  World w;
  start_direct_commit(w);
  Governed gv(w);
  gv.run(3s);
  w.guest_latency = 500ms;  // the guests stall: the job is held at the floor
  gv.run(1s);
  auto& job = w.hv.jobs[{w.dom, "vda"}];
  REQUIRE(job.bandwidth_bytes_per_s < kChunkGateOpenSpeedBytesPerS);
  job.bandwidth_bytes_per_s = kChunkGateOpenSpeedBytesPerS;  // a close that was lost
  gv.run(300ms);
  CHECK(job.bandwidth_bytes_per_s <= kMinJobSpeedBytesPerS);
}

TEST_CASE("plugin.governor.chunk_gate_only_where_it_works") {
  // Through the page cache (writeback) the pacer meters the writeback instead; a mirror's
  // 16 MiB bursts are not one chunk at a time; QEMU >= 8.1 sleeps before every 512 KiB step
  // while the gate is closed, unallocated ones too; an unknown version is not assumed.
  struct Case {
    std::string cache;
    JobType type;
    std::optional<std::uint64_t> version;
  };
  for (const Case& c :
       {Case{"", JobType::Commit, 7002000}, Case{"none", JobType::ActiveCommit, 7002000},
        Case{"none", JobType::Commit, 8001000}, Case{"none", JobType::Commit, std::nullopt}}) {
    World w;
    w.hv.domains[0].disks[0].cache = c.cache;
    w.hv.version = c.version;
    w.start_job(c.type);
    Governed gv(w);
    gv.run(2s);
    for (const SpeedCall& call : w.hv.speed_calls)
      CHECK(call.speed != kChunkGateOpenSpeedBytesPerS);
  }
}

TEST_CASE("plugin.governor.chunk_gate_stall_holds_at_the_floor") {
  // Guest I/O stops completing while the chunks are spaced: the job is held at the floor speed,
  // as an ungated one would be, and no opening happens until the guests recover.
  World w;
  start_direct_commit(w);
  Governed gv(w);
  gv.run(3s);
  w.guest_active = false;
  const TimePoint stall = w.now;
  while (gv.g.status(w.now).jobs.at(0).phase != "paused" && w.now < stall + 1s) gv.run(10ms);
  REQUIRE(gv.g.status(w.now).jobs.at(0).phase == "paused");
  gv.run(20ms);  // an open gate closes at the next pace
  CHECK(w.hv.speed("vm1", "vda") == kMinJobSpeedBytesPerS);
  const std::size_t calls = w.hv.speed_calls.size();
  gv.run(300ms);
  for (std::size_t i = calls; i < w.hv.speed_calls.size(); ++i)
    CHECK(w.hv.speed_calls[i].speed != kChunkGateOpenSpeedBytesPerS);
  w.guest_active = true;
  gv.run(3s);
  CHECK(std::any_of(w.hv.speed_calls.begin() + static_cast<std::ptrdiff_t>(calls),
                    w.hv.speed_calls.end(),
                    [](const SpeedCall& c) { return c.speed == kChunkGateOpenSpeedBytesPerS; }));
}

TEST_CASE("plugin.governor.probe_holds_back_for_hidden_guests") {
  // The guests on the job's host are idle (the merged VM idles), so nothing local says the
  // storage is busy; guests on other hosts share it.  The probe beside the target shows their
  // queue: 2 ms while it is empty, then 200 ms.
  World w;
  w.guest_active = false;
  w.other_active = false;
  w.files.probe = std::make_shared<FakeProbeState>();
  w.start_job();
  DaemonConfig with_probe;
  with_probe.defaults.probe = ProbeMode::kOn;
  with_probe.defaults.probe_period = qcommit::throttle::kDefaultProbePeriod;
  Governed gv(w, with_probe);
  gv.run(12s);  // past the first slowdown
  const double free = gv.progress(2s);
  const auto js = gv.g.status(w.now).jobs.at(0);
  CHECK(js.probe_period == 50ms);
  REQUIRE(js.probe_p99.has_value());
  CHECK(*js.probe_p99 == 2ms);
  CHECK(w.files.probe->started >= 200);  // ~20 per second
  w.files.probe->latency = 200ms;
  gv.run(300ms);
  const double held = gv.progress(1s);
  MESSAGE("probe 2 ms: " << free / 1048576.0 << " MiB/s, probe 200 ms: " << held / 1048576.0);
  CHECK(free > 20.0 * DaemonConfig{}.defaults.floor_bytes_per_s);
  CHECK(held < 0.2 * free);
  CHECK_FALSE(w.speed_ever_zero());

  // probe=off in the pool's policy: no probe file, and the job runs free whatever it would say.
  World off;
  off.guest_active = false;
  off.other_active = false;
  off.files.probe = std::make_shared<FakeProbeState>();
  off.files.probe->latency = 200ms;
  off.start_job();
  DaemonConfig cfg;
  Policy no_probe;
  no_probe.probe = ProbeMode::kOff;
  cfg.pools["fast"] = no_probe;
  Governed gv_off(off, cfg);
  gv_off.run(12s);
  CHECK(off.files.probe->opened == 0);
  CHECK_FALSE(gv_off.g.status(off.now).jobs.at(0).probe_period.has_value());
  CHECK(gv_off.progress(1s) > 20.0 * DaemonConfig{}.defaults.floor_bytes_per_s);

  // A probe that keeps failing is given up (it must not hold the job on a probe age).
  World failing;
  failing.guest_active = false;
  failing.other_active = false;
  failing.files.probe = std::make_shared<FakeProbeState>();
  failing.files.probe->latency.reset();
  failing.start_job();
  Governed gv_fail(failing, with_probe);
  gv_fail.run(12s);
  CHECK(failing.files.probe->started == static_cast<int>(kMaxProbeFailures));
  CHECK_FALSE(gv_fail.g.status(failing.now).jobs.at(0).probe_period.has_value());
  CHECK(gv_fail.progress(1s) > 20.0 * DaemonConfig{}.defaults.floor_bytes_per_s);
}

TEST_CASE("plugin.governor.probe_state_says_why") {
  // What status shows of the probe: disabled by the policy, on (with its last latency), off with
  // the reason the probe file could not be had, off after it was given up (with the last error).
  DaemonConfig with_probe;
  with_probe.defaults.probe = ProbeMode::kOn;
  with_probe.defaults.probe_period = qcommit::throttle::kDefaultProbePeriod;

  World disabled;
  disabled.files.probe = std::make_shared<FakeProbeState>();
  disabled.files.kind = StorageKind{"nfs", true};
  disabled.start_job();
  DaemonConfig probe_off;
  probe_off.defaults.probe = ProbeMode::kOff;
  Governed gv_disabled(disabled, probe_off);
  gv_disabled.run(1s);
  const JobStatus d = gv_disabled.g.status(disabled.now).jobs.at(0);
  CHECK(d.probe == ProbeState::kDisabled);
  CHECK(d.probe_off_reason.empty());
  CHECK_FALSE(d.probe_last.has_value());
  CHECK(disabled.files.probe->opened == 0);
  CHECK(std::string(to_string(d.probe)) == "disabled");

  // probe=auto, the default: on where other hosts can share the target's filesystem (every
  // 100 ms), not wanted on a local one or one that cannot be told.
  World shared;
  shared.files.probe = std::make_shared<FakeProbeState>();
  shared.files.probe->latency = 4ms;
  shared.files.kind = StorageKind{"nfs", true};
  shared.start_job();
  Governed gv_shared(shared);
  gv_shared.run(1s);
  const JobStatus sh = gv_shared.g.status(shared.now).jobs.at(0);
  CHECK(sh.probe == ProbeState::kOn);
  CHECK(sh.probe_period == 100ms);
  REQUIRE(sh.probe_last.has_value());
  CHECK(*sh.probe_last == 4ms);
  CHECK(shared.files.probe->opened == 1);

  World local;
  local.files.probe = std::make_shared<FakeProbeState>();  // ext4: the fake's default
  local.start_job();
  Governed gv_local(local);
  gv_local.run(1s);
  const JobStatus lo = gv_local.g.status(local.now).jobs.at(0);
  CHECK(lo.probe == ProbeState::kLocal);
  CHECK(lo.probe_off_reason ==
        "probe=auto: " + lo.target + " is on ext4, which other hosts do not share");
  CHECK_FALSE(lo.probe_period.has_value());
  CHECK(local.files.probe->opened == 0);
  CHECK(std::string(to_string(lo.probe)) == "local");

  World unknown;
  unknown.files.probe = std::make_shared<FakeProbeState>();
  unknown.files.kind.reset();
  unknown.start_job();
  Governed gv_unknown(unknown);
  gv_unknown.run(1s);
  const JobStatus un = gv_unknown.g.status(unknown.now).jobs.at(0);
  CHECK(un.probe == ProbeState::kLocal);
  CHECK(un.probe_off_reason == "probe=auto: the filesystem of " + un.target + " is not known");
  CHECK(unknown.files.probe->opened == 0);

  World on;
  on.files.probe = std::make_shared<FakeProbeState>();
  on.files.probe->latency = 3ms;
  on.start_job();
  Governed gv_on(on, with_probe);
  gv_on.run(1s);
  const JobStatus o = gv_on.g.status(on.now).jobs.at(0);
  CHECK(o.probe == ProbeState::kOn);
  CHECK(o.probe_off_reason.empty());
  REQUIRE(o.probe_last.has_value());
  CHECK(*o.probe_last == 3ms);

  World refused;
  refused.files.probe.reset();  // no probe file can be created
  refused.files.probe_refusal =
      "cannot create the probe file /pool/.qcommit-probe-1-0: Read-only file system";
  refused.start_job();
  Governed gv_refused(refused, with_probe);
  gv_refused.run(1s);
  const JobStatus r = gv_refused.g.status(refused.now).jobs.at(0);
  CHECK(r.probe == ProbeState::kOff);
  CHECK(r.probe_off_reason == refused.files.probe_refusal);
  CHECK_FALSE(r.probe_period.has_value());
  CHECK(std::string(to_string(r.probe)) == "off");

  World failing;
  failing.files.probe = std::make_shared<FakeProbeState>();
  failing.files.probe->latency.reset();
  failing.start_job();
  Governed gv_failing(failing, with_probe);
  gv_failing.run(3s);
  const JobStatus f = gv_failing.g.status(failing.now).jobs.at(0);
  CHECK(f.probe == ProbeState::kOff);
  CHECK(f.probe_off_reason ==
        "given up after 3 failed probes in a row, the last: fdatasync of "
        "the probe file: Input/output error");
}

TEST_CASE("plugin.governor.slowdowns_on_the_wall_clock") {
  // The host's synchronised wall clock is 3.7 s ahead of the governor's monotonic one: the
  // periodic slowdowns start at multiples of the interval on the wall clock (where every other
  // host's start too), not on the monotonic one.
  World w;
  w.start_job();
  GovernorOptions opt;
  const Duration wall_ahead = 3700ms;
  opt.wall_clock = [&w, wall_ahead]() -> std::optional<Duration> {
    return w.now.time_since_epoch() + wall_ahead;
  };
  Governed gv(w, DaemonConfig{}, opt);
  const TimePoint start = w.now;
  std::vector<Duration> starts;  // wall time of each slowdown's first step
  std::string phase;
  gv.run(35s, [&] {
    const auto jobs = gv.g.status(w.now).jobs;
    if (jobs.empty()) return;
    if (jobs[0].phase == "slowdown" && phase != "slowdown" && w.now - start > 2s)
      starts.push_back(w.now.time_since_epoch() + wall_ahead);
    phase = jobs[0].phase;
  });
  const Duration interval = qcommit::throttle::ControllerConfig{}.slowdown_interval;
  REQUIRE(starts.size() >= 3);
  for (Duration s : starts) CHECK(s % interval < GovernorOptions{}.tick + 10ms);
}

TEST_CASE("plugin.governor.max_rate_caps_every_speed") {
  // `qcommit live --max-rate 2M`: on idle storage (nobody to protect, the job runs free) and
  // with a domain policy whose ceiling is far higher, no speed the governor sets exceeds the cap,
  // nor the finishing speed it leaves the job at.
  constexpr double kCap = 2.0 * 1024 * 1024;
  World w;
  w.guest_active = false;
  w.other_active = false;
  w.hv.domains[0].policy_xml =
      "<qcommit:policy xmlns:qcommit=\"https://qcommit.dev/xmlns/1\" ceiling=\"1G\"/>";
  w.start_job();
  GovernorOptions opt;
  opt.max_rate_bytes_per_s = kCap;
  REQUIRE_FALSE(opt.validate());
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(12s);
  const double rate = gv.progress(5s);
  MESSAGE("capped at 2 MiB/s: " << rate / 1048576.0 << " MiB/s");
  CHECK(rate > 0.5 * kCap);
  CHECK(rate <= 1.05 * kCap);
  REQUIRE_FALSE(w.hv.speed_calls.empty());
  for (const SpeedCall& c : w.hv.speed_calls) CHECK(static_cast<double>(c.speed) <= kCap);
  gv.g.release_all();
  CHECK(static_cast<double>(w.hv.speed("vm1", "vda")) <= kCap);
  // Below the governor's minimum job speed the cap could not hold: refused.
  opt.max_rate_bytes_per_s = 16.0 * 1024;
  CHECK(opt.validate().has_value());
}

namespace {
// An active commit into a cache=none base whose node options libvirt's XML fully gives, on a
// QEMU 10 that takes QMP commands (fake_qemu_graph.h).
void start_direct_active_commit(World& w, FakeQemu& q) {
  w.hv.domains[0].disks[0].cache = "none";
  w.hv.domains[0].disks[0].format_options_known = true;
  w.hv.qmp = q.qmp();
  w.hv.version = 10000013;  // QEMU 10.0.13, Debian 13's
  w.job_max_bytes_per_s = 50.0 * 1024 * 1024;
  w.start_job(JobType::ActiveCommit, 4ull << 30);
}
bool filter_in(FakeQemu& q) {
  return q.nodes["libvirt-1-format"].children["file"].rfind("qcommit-tf-", 0) == 0;
}
}  // namespace

TEST_CASE("plugin.governor.throttle_filter_under_a_direct_active_commit") {
  // QEMU's mirror copies 16 MiB bursts whatever its speed: a throttle filter under BASE lets each
  // burst out at 1.5x the job's speed.  It goes in once the job, held at the floor, has nothing
  // in flight (a tick without progress), follows the speed only on large changes (every change
  // empties QEMU's buckets), and comes out when the job is ready.
  World w;
  FakeQemu q(kBase, kTop);
  start_direct_active_commit(w, q);
  Governed gv(w);
  gv.run(50ms);  // adopted
  REQUIRE(!w.hv.speed_calls.empty());
  CHECK(w.hv.speed_calls.front().speed == kMinJobSpeedBytesPerS);
  CHECK_FALSE(filter_in(q));
  gv.run(500ms);
  REQUIRE(filter_in(q));
  const std::string group = "qcommit-tg-" + std::to_string(::getpid()) + "-1";
  REQUIRE(q.groups.count(group) == 1);
  CHECK(gv.g.status(w.now).jobs.at(0).target_throttle == "on");
  // After every step the filter's rate is within the hysteresis of 1.5x the job's speed.
  std::uint64_t max_speed = 0;
  double lo = 1e9, hi = 0;
  gv.run(10s, [&] {
    const std::uint64_t speed = w.hv.speed("vm1", "vda");
    max_speed = std::max(max_speed, speed);
    const double ratio = static_cast<double>(q.groups[group]) /
                         static_cast<double>(std::max(speed, kMinThrottleRateBytesPerS));
    lo = std::min(lo, ratio);
    hi = std::max(hi, ratio);
  });
  MESSAGE("speed up to " << max_speed << " B/s; filter/speed " << lo << ".." << hi);
  CHECK(max_speed > 16ull << 20);
  CHECK(hi <= kThrottleRateFactor * kThrottleRateHysteresis + 0.01);
  CHECK(lo * kThrottleRateHysteresis >= kThrottleRateFactor - 0.01);
  std::size_t sets = 0;
  for (const auto& [c, a] : w.hv.qmp_log) sets += c == "qom-set";
  // Not one per tick (100 in 10 s): 10 with the fake's page cache dirty everywhere, 11 since its
  // writeback leaves the ranges it took clean while a plan is issued range by range.
  CHECK(sets <= 12);
  w.hv.jobs[{"vm1", "vda"}].cur = w.hv.jobs[{"vm1", "vda"}].end;
  w.hv.emit(JobEvent{JobEventKind::Ready, "vm1", "vda", JobType::ActiveCommit, ""});
  gv.run(300ms);
  CHECK_FALSE(filter_in(q));
  CHECK(q.nodes.count("qcommit-tf-" + std::to_string(::getpid()) + "-1") == 0);
  CHECK(q.groups.empty());
}

TEST_CASE("plugin.governor.throttle_filter_left_by_a_killed_daemon") {
  // A qcommitd killed (pid 4000001, gone) left its filter under the base: a new one removes it
  // when it connects, says so, and puts its own in for the job it adopts.
  World w;
  FakeQemu q(kBase, kTop);
  start_direct_active_commit(w, q);
  q.add_filter("qcommit-tf-4000001-1", "qcommit-tg-4000001-1", "libvirt-1-format", 1u << 20);
  std::vector<std::string> said;
  GovernorOptions opt;
  opt.notice = [&said](const std::string& m) { said.push_back(m); };
  Governed gv(w, DaemonConfig{}, opt);
  gv.run(600ms);
  REQUIRE(said.size() == 1);
  CHECK(said[0] ==
        "domain vm1: throttle filter removed qcommit-tf-4000001-1 (left by process "
        "4000001) from under libvirt-1-format");
  CHECK(q.nodes.count("qcommit-tf-4000001-1") == 0);
  CHECK(q.groups.count("qcommit-tg-4000001-1") == 0);
  CHECK(filter_in(q));
  CHECK(gv.g.status(w.now).jobs.at(0).target_throttle == "on");
}

TEST_CASE("plugin.governor.throttle_filter_only_where_it_applies") {
  // Writeback (the page cache takes the bursts), QEMU before 8.1, options the XML does not give,
  // QMP refused, or the daemon told not to: no filter; the job is governed by its speed as before.
  struct Case {
    const char* name;
    std::string cache;
    std::uint64_t qemu;
    bool known;
    bool qmp;
    bool option;
    const char* why;  // status: "" or the start of "off: ..."
  };
  for (const Case& c :
       {Case{"writeback", "", 10000013, true, true, true, ""},
        Case{"QEMU 7.2", "none", 7002022, true, true, true, "off: not used with QEMU before 8.1"},
        Case{"unknown options", "none", 10000013, false, true, true, "off: the disk's"},
        Case{"no QMP", "none", 10000013, true, false, true, "off: query-named-block-nodes"},
        Case{"off", "none", 10000013, true, true, false, ""}}) {
    const std::string name = c.name;
    CAPTURE(name);
    World w;
    FakeQemu q(kBase, kTop);
    start_direct_active_commit(w, q);
    w.hv.domains[0].disks[0].cache = c.cache;
    w.hv.domains[0].disks[0].format_options_known = c.known;
    w.hv.version = c.qemu;
    if (!c.qmp) w.hv.qmp = nullptr;
    GovernorOptions opt;
    opt.target_throttle = c.option;
    Governed gv(w, DaemonConfig{}, opt);
    gv.run(3s);
    CHECK_FALSE(filter_in(q));
    CHECK(q.groups.empty());
    const std::string state = gv.g.status(w.now).jobs.at(0).target_throttle;
    CAPTURE(state);
    CHECK(state.rfind(c.why, 0) == 0);
    CHECK(w.hv.speed("vm1", "vda") > kMinJobSpeedBytesPerS);
  }
}
