// SPDX-License-Identifier: GPL-2.0-or-later
// The JSON qcommitd's status gives (plugin/daemon/control.cpp) and the progress records `qcommit
// live --output=json` prints from it (plugin/live/progress.cpp): every member name in snake_case,
// and a field both carry under one name.
#include <doctest/doctest.h>

#include <chrono>
#include <regex>
#include <set>
#include <string>

#include "plugin/daemon/control.h"
#include "plugin/host/json.h"
#include "plugin/live/progress.h"

using namespace qcommit::plugin;
namespace json = qcommit::json;

namespace {

// Every member name of `v` and of the objects inside it, recursively.
void collect_keys(const json::Value& v, std::set<std::string>& keys) {
  if (v.is_object()) {
    for (const auto& [k, m] : v.items()) {
      keys.insert(k);
      collect_keys(m, keys);
    }
  } else if (v.is_array()) {
    for (const auto& m : v) collect_keys(m, keys);
  }
}

std::set<std::string> keys_of(const json::Value& v) {
  std::set<std::string> keys;
  collect_keys(v, keys);
  return keys;
}

void check_snake_case(const std::set<std::string>& keys, const std::string& what) {
  static const std::regex kSnake("^[a-z][a-z0-9_]*$");
  for (const auto& k : keys) {
    INFO(what << ": member \"" << k << "\"");
    CHECK(std::regex_match(k, kSnake));
  }
}

// A governed job with every optional field known, and one that has ended.
GovernorStatus sample_status() {
  GovernorStatus st;
  st.connected = true;
  JobStatus j;
  j.domain = "vm1";
  j.disk = "vda";
  j.id = 7;
  j.type = JobType::ActiveCommit;
  j.budget = std::chrono::milliseconds(20);
  j.speed_bytes_per_s = 8 << 20;
  j.window_bytes = 4 << 20;
  j.backlog_bytes = 1 << 20;
  j.latency_p99 = std::chrono::milliseconds(3);
  j.bytes_left = 512 << 20;
  j.eta_s = 64.0;
  j.phase = "steady";
  j.probe = ProbeState::kOff;
  j.probe_off_reason = "probe=auto: /p/base.qcow2 is on ext4, which other hosts do not share";
  j.time_to_govern = std::chrono::milliseconds(12);
  j.escape_cost = std::chrono::milliseconds(250);
  st.jobs.push_back(j);
  ReleasedJob r;
  r.id = 6;
  r.domain = "vm1";
  r.disk = "vdb";
  r.type = JobType::Commit;
  r.reason = "completed";
  st.released.push_back(r);
  return st;
}

}  // namespace

TEST_CASE("plugin.json.status_and_live_progress_keys") {
  const GovernorStatus st = sample_status();
  const TimePoint now = TimePoint{} + std::chrono::seconds(5);
  const std::optional<json::Value> status =
      json::parse(status_json(st, now), json::kControlResponseLimits, nullptr);
  REQUIRE(status);
  check_snake_case(keys_of(*status), "qcommitd status");
  const json::Value& job = status->at("jobs").at(0);

  // The two ways live reads a job: the governor in-process, and qcommitd's answer.
  const json::Value in_process =
      json::Value::parse(json::dump(progress_json(progress_of(st.jobs[0]), 42.5)));
  const json::Value from_daemon =
      json::Value::parse(json::dump(progress_json(progress_of_status(job), 42.5)));
  CHECK(in_process == from_daemon);
  const std::set<std::string> progress_keys = keys_of(from_daemon);
  check_snake_case(progress_keys, "qcommit live progress");

  // Every field of the progress record but its own (event, percent) is the status job's field
  // under the same name, with the same value.
  for (const auto& k : progress_keys) {
    if (k == "event" || k == "percent") continue;
    INFO("progress member \"" << k << "\"");
    REQUIRE(json::member(job, k) != nullptr);
    CHECK(from_daemon.at(k) == job.at(k));
  }
  CHECK(json::to_uint64(from_daemon.at("bytes_left")) == 512u << 20);
  CHECK(from_daemon.at("eta_s").get<double>() == 64.0);
  CHECK(from_daemon.at("percent").get<double>() == 42.5);

  // The socket's other answers: ok, and an error.
  const StatusSource unused = [] { return std::string("{}"); };
  for (const std::string& line :
       {answer_request(R"({"cmd":"ping"})", unused), answer_request(R"({"cmd":"nope"})", unused)}) {
    const std::optional<json::Value> v = json::parse(line, json::kControlResponseLimits, nullptr);
    REQUIRE(v);
    check_snake_case(keys_of(*v), "qcommitd answer");
  }
}
