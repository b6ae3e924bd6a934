// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd's log (plugin/daemon_log.*) with the governor against the fake hypervisor: hostile
// names stay data on one line, and a long job logs per decision change, not per tick.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "plugin/daemon/daemon_log.h"
#include "plugin/govern/governor.h"
#include "tests/plugin/fake_hypervisor.h"
#include "tests/plugin/world.h"

using namespace qcommit;
using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

bool has_control_char(const std::string& s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u < 0x20 || u == 0x7f;
  });
}

std::vector<std::string> matching(const std::vector<std::string>& records,
                                  const std::string& part) {
  std::vector<std::string> out;
  for (const auto& r : records)
    if (r.find(part) != std::string::npos) out.push_back(r);
  return out;
}

}  // namespace

TEST_CASE("plugin.log.fields") {
  CHECK(log_field("vm1") == "vm1");
  CHECK(log_field("/var/lib/libvirt/images/vm-1_a.qcow2") ==
        "/var/lib/libvirt/images/vm-1_a.qcow2");
  CHECK(log_field("pool:aaaa-01") == "pool:aaaa-01");
  CHECK(log_field("") == "\"\"");
  CHECK(log_field("vm one") == "\"vm one\"");
  CHECK(log_field("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(log_field("x\ny\r\tz\x01\x7f") == "\"x\\ny\\r\\tz\\x01\\x7f\"");
  CHECK(log_field("$(id)`id`;") == "\"$(id)`id`;\"");
  CHECK(log_field("v\xc3\xa9m") == "\"v\xc3\xa9m\"");  // UTF-8 stays, quoted
  CHECK(log_escape_controls("a \"b\"\nc") == "a \"b\"\\nc");
  CHECK(csv_field("vm1") == "vm1");
  CHECK(csv_field("a,b") == "\"a,b\"");
  CHECK(csv_field("say \"hi\"\n") == "\"say \"\"hi\"\"\\n\"");
}

TEST_CASE("plugin.log.hostile_names") {
  const std::string dir =
      std::filesystem::temp_directory_path().string() + "/qcommit-log-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string m1 = dir + "/pwned1", m2 = dir + "/pwned2", m3 = dir + "/pwned3";
  // Spaces, quotes, $(...), backticks, ';', a forged second record after a newline, CR, tab, ^A.
  const std::string dom = "vm one 'sq' \"dq\" $(touch " + m1 + ") `touch " + m2 + "`; touch " + m3 +
                          "\nqcommitd: governing forged job\r\t\x01"
                          "end";
  const std::string dom_logged = "\"vm one 'sq' \\\"dq\\\" $(touch " + m1 + ") `touch " + m2 +
                                 "`; touch " + m3 +
                                 "\\nqcommitd: governing forged job\\r\\t\\x01end\"";
  const std::string target = "/pool/base $(touch " + m1 + ").qcow2\n";
  const std::string target_logged = "\"/pool/base $(touch " + m1 + ").qcow2\\n\"";
  const std::string pool = "pool \"p\"; `touch " + m2 + "`\n";
  const std::string pool_logged = "\"pool \\\"p\\\"; `touch " + m2 + "`\\n\"";

  World w(dom, target);
  w.hv.pool_list = {PoolInfo{pool, "", "/pool"}};  // no UUID: the storage key is the name
  std::vector<std::string> records;
  DaemonLog log([&](std::string_view r) { records.emplace_back(r); });

  // libvirtd down first: the error (which may quote a name) is one line too.
  w.hv.daemon_up = false;
  {
    Governor g(w.hv, w.files, DaemonConfig{});
    (void)g.step(w.now);
    log.observe(g.status(w.now), "qemu:///system", "no domain '" + dom + "'");
  }
  w.hv.daemon_up = true;
  w.start_job();
  Governed gv(w);
  auto observe = [&] { log.observe(gv.g.status(w.now), "qemu:///system", ""); };
  gv.run(3s, observe);
  REQUIRE(gv.g.job_count() == 1);
  w.hv.jobs.clear();
  w.hv.emit(JobEvent{JobEventKind::Completed, dom, "vda", JobType::ActiveCommit, ""});
  gv.run(50ms, observe);
  CHECK(gv.g.job_count() == 0);

  REQUIRE_FALSE(records.empty());
  for (const auto& r : records) {
    INFO("record: " << r);
    CHECK_FALSE(has_control_char(r));
    // The forged record only ever appears inside the quoted name.
    const bool forged_inside_name = r.find("forged") == std::string::npos ||
                                    r.find(dom_logged) != std::string::npos ||
                                    r.find("no domain") != std::string::npos;
    CHECK(forged_inside_name);
  }
  CHECK(records.front() == "not connected to qemu:///system: no domain '" +
                               std::string("vm one 'sq' \"dq\" $(touch ") + m1 + ") `touch " + m2 +
                               "`; touch " + m3 +
                               "\\nqcommitd: governing forged job\\r\\t\\x01end'");
  const auto adopted = matching(records, "governing active-commit job on");
  REQUIRE(adopted.size() == 1);
  CHECK(adopted[0].rfind("governing active-commit job on domain " + dom_logged +
                             " disk vda (target " + target_logged + ", storage \"pool:" +
                             pool_logged.substr(1) + ", pool " + pool_logged + ", budget 20 ms): ",
                         0) == 0);
  CHECK(records.back() == "domain " + dom_logged + " disk vda: completed");
  CHECK(matching(records, "connected to qemu:///system").size() == 2);
  // Names are never run.
  CHECK_FALSE(std::filesystem::exists(m1));
  CHECK_FALSE(std::filesystem::exists(m2));
  CHECK_FALSE(std::filesystem::exists(m3));
  std::filesystem::remove_all(dir);
}

TEST_CASE("plugin.log.one_line_per_decision_change") {
  World w;
  w.start_job();
  Governed gv(w);
  std::vector<std::string> records;
  DaemonLog log([&](std::string_view r) { records.emplace_back(r); });
  // The decisions as the status shows them after every step (periodic slowdowns are scheduled,
  // not decided: they keep the previous decision).
  std::vector<std::string> decisions;
  std::size_t slowdowns = 0;
  bool in_slowdown = false;
  auto observe = [&] {
    const GovernorStatus st = gv.g.status(w.now);
    log.observe(st, "qemu:///system", "");
    if (st.jobs.empty()) return;
    const std::string& p = st.jobs[0].phase;
    if (p == "slowdown") {
      if (!in_slowdown) ++slowdowns;
      in_slowdown = true;
      if (decisions.empty()) decisions.push_back("adopted");
      return;
    }
    in_slowdown = false;
    if (decisions.empty() || decisions.back() != p) decisions.push_back(p);
  };
  const TimePoint start = w.now;
  gv.run(30s, observe);  // steady signal: 2 ms guest writes
  const std::size_t steady_records = records.size();
  const std::vector<std::string> steady_decisions = decisions;
  w.guest_latency = 200ms;  // 10 x the budget
  gv.run(3s, observe);
  w.guest_latency = 2ms;
  gv.run(12s, observe);
  const auto ticks = (w.now - start) / GovernorOptions{}.tick;

  INFO("decisions: " << [&] {
    std::string s;
    for (const auto& d : decisions) s += d + " ";
    return s;
  }());
  // 450 ticks; the records: connected, adopted (with its first decision), its first speed seen
  // in QEMU (time to govern), one per change.
  CHECK(ticks >= 400);
  CHECK(slowdowns >= 3);  // the periodic slowdowns happened and were not logged
  REQUIRE(decisions.size() >= 3);
  const std::size_t changes = decisions.size() - 1;
  const auto changed = matching(records, " (was ");
  CHECK(changed.size() == changes);
  CHECK(records.size() == 3 + changes);
  CHECK(matching(records, " after the job was found (poll)").size() == 1);
  CHECK(records.size() <= 12);
  CHECK(matching(records, "slowdown").empty());
  // Steady signal: after slow start, nothing to report for ~29 s of ticks.
  CHECK(steady_decisions.size() <= 2);
  CHECK(steady_records == 2 + steady_decisions.size());
  // The change of signal is reported: paused, then resumed.
  CHECK(matching(records, ": paused (was ").size() == 1);
  CHECK(matching(records, " (was paused)").size() == 1);
  CHECK(decisions.back() != "paused");
}

TEST_CASE("plugin.log.probe_off_once_per_job") {
  // A job whose policy asks for the probe but that runs without it: one record naming the file
  // and the reason, when adopted, not once per status; a probe given up later: one more.
  DaemonConfig with_probe;
  with_probe.defaults.probe = ProbeMode::kOn;
  with_probe.defaults.probe_period = qcommit::throttle::kDefaultProbePeriod;
  World w;
  w.files.probe.reset();
  w.files.probe_refusal =
      "cannot create the probe file /pool/.qcommit-probe-1-0: Read-only file system";
  w.start_job();
  Governed gv(w, with_probe);
  std::vector<std::string> records;
  DaemonLog log([&](std::string_view r) { records.emplace_back(r); });
  gv.run(5s, [&] { log.observe(gv.g.status(w.now), "qemu:///system", ""); });
  const auto off = matching(records, "probe");
  REQUIRE(off.size() == 1);
  CHECK(off[0] ==
        "domain vm1 disk vda: shared-queue probe off: cannot create the probe file "
        "/pool/.qcommit-probe-1-0: Read-only file system");

  World g;
  g.files.probe = std::make_shared<FakeProbeState>();
  g.files.probe->latency.reset();  // every probe fails: given up after kMaxProbeFailures
  g.start_job();
  Governed gv_g(g, with_probe);
  records.clear();
  DaemonLog log_g([&](std::string_view r) { records.emplace_back(r); });
  gv_g.run(5s, [&] { log_g.observe(gv_g.g.status(g.now), "qemu:///system", ""); });
  const auto given_up = matching(records, "probe");
  REQUIRE(given_up.size() == 1);
  CHECK(given_up[0].rfind("domain vm1 disk vda: shared-queue probe off: given up after 3", 0) == 0);

  // Disabled by the policy (the default): nothing said.
  World quiet;
  quiet.start_job();
  Governed gv_q(quiet);
  records.clear();
  DaemonLog log_q([&](std::string_view r) { records.emplace_back(r); });
  gv_q.run(2s, [&] { log_q.observe(gv_q.g.status(quiet.now), "qemu:///system", ""); });
  CHECK(matching(records, "probe").empty());
}

TEST_CASE("plugin.log.next_job_on_the_same_disk") {
  // A job ends and the next one on the same disk is adopted between two looks at the status
  // (libvirt's end event and the next poll in one step): the log says the first ended and names
  // the second, with its type, instead of carrying the first one's record over to it.
  World w;
  w.start_job(JobType::ActiveCommit);
  Governed gv(w);
  std::vector<std::string> records;
  DaemonLog log([&](std::string_view r) { records.emplace_back(r); });
  gv.run(3s, [&] { log.observe(gv.g.status(w.now), "qemu:///system", ""); });
  REQUIRE(gv.g.job_count() == 1);
  const std::uint64_t first = gv.g.status(w.now).jobs.at(0).id;
  w.hv.jobs.clear();
  w.hv.emit(JobEvent{JobEventKind::Canceled, w.dom, "vda", JobType::ActiveCommit, ""});
  w.start_job(JobType::Commit, 1ull << 30);
  gv.run(3s);  // the log does not look in between
  const GovernorStatus st = gv.g.status(w.now);
  REQUIRE(st.jobs.size() == 1);
  REQUIRE(st.jobs[0].type == JobType::Commit);
  REQUIRE(st.jobs[0].id != first);
  log.observe(st, "qemu:///system", "");
  INFO("records: " << [&] {
    std::string s;
    for (const auto& r : records) s += r + " | ";
    return s;
  }());
  CHECK(matching(records, "governing active-commit job on domain vm1 disk vda").size() == 1);
  CHECK(matching(records, "governing commit job on domain vm1 disk vda").size() == 1);
  CHECK(matching(records, "domain vm1 disk vda: canceled").size() == 1);
  // The end comes before the next job's adoption.
  const auto at = [&](const std::string& part) {
    return std::find_if(records.begin(), records.end(),
                        [&](const std::string& r) { return r.find(part) != std::string::npos; });
  };
  CHECK(at(": canceled") < at("governing commit job"));
}

TEST_CASE("plugin.log.mirror_convergence_said_once_per_change") {
  // A mirror the guest's writes outrun: one record when it stops converging (the guest's rate,
  // the copy's), one when its converge floor goes on; none per status.
  World w;
  w.storage_bytes_per_s = 50.0 * qcommit::throttle::kMiB;
  w.start_job(JobType::ActiveCommit, 1ull << 30);
  Governed gv(w);
  std::vector<std::string> records;
  DaemonLog log([&](std::string_view r) { records.emplace_back(r); });
  int steps = 0;
  const auto observe = [&] {
    if (++steps % 50 == 0) log.observe(gv.g.status(w.now), "qemu:///system", "");
  };
  gv.run(2s, observe);
  w.guest_latency = 200ms;
  w.guest_dirty_bytes_per_s = 4.0 * qcommit::throttle::kMiB;
  gv.run(kMaxConvergeWindow + kNotConvergingAfter + 25s, observe);
  const auto stalled = matching(records, "not converging");
  REQUIRE(stalled.size() == 1);
  CHECK(stalled[0].rfind("domain vm1 disk vda: not converging: the guests add ", 0) == 0);
  CHECK(stalled[0].find(" MiB/s to what is left to copy, the budget lets the copy run at ") !=
        std::string::npos);
  const auto floor = matching(records, "converge floor on");
  REQUIRE(floor.size() == 1);
  CHECK(floor[0].rfind("domain vm1 disk vda: converge floor on: at least ", 0) == 0);
  CHECK(floor[0].find(" MiB/s until ready (2.0x what the guests add") != std::string::npos);
  CHECK(matching(records, "converging again").empty());
}
