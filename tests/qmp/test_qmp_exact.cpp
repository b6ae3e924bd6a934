// SPDX-License-Identifier: GPL-2.0-or-later
// What the QMP adapter reads from a monitor, through its public API only (QmpHypervisor against
// the scripted server of tests/qmp/fake_qmp.h): counters past 2^53 arrive exact, and a monitor
// that sends invalid UTF-8 is refused rather than passed on.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>

#include "plugin/hypervisor/qmp_hypervisor.h"
#include "tests/qmp/fake_qmp.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

// 2^53 + 1: the first integer a double cannot hold.
constexpr std::int64_t kPast53 = 9007199254740993;
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::uint64_t kUint64Max = std::numeric_limits<std::uint64_t>::max();

QmpOptions quick() {
  QmpOptions o;
  o.greeting_timeout = 300ms;
  o.command_timeout = 300ms;
  return o;
}

// One -drive disk "vda" on top.qcow2 <- base.qcow2.
const char* kOneDisk = R"([{"device": "vda", "qdev": "/machine/peripheral/disk0/virtio-backend",
  "inserted": {"node-name": "#block182", "drv": "qcow2", "file": "/s/top.qcow2",
   "image": {"filename": "/s/top.qcow2", "format": "qcow2",
    "backing-image": {"filename": "/s/base.qcow2", "format": "qcow2"}}}}])";

// Counters as a long-running guest's disk reaches them: QEMU's int64 near its maximum.
const std::string kBigStats =
    R"([{"device": "vda", "node-name": "#block182",)"
    R"( "qdev": "/machine/peripheral/disk0/virtio-backend", "stats": {"wr_operations": )" +
    std::to_string(kPast53 + 2) + R"(, "wr_total_time_ns": )" + std::to_string(kPast53) +
    R"(, "flush_operations": )" + std::to_string(kInt64Max - 1) + R"(, "flush_total_time_ns": )" +
    std::to_string(kInt64Max) + "}}]";

// A (non-active) commit job whose length and speed use all 64 bits.
const std::string kBigJob = R"([{"device": "vda", "type": "commit", "status": "running", "len": )" +
                            std::to_string(kUint64Max) + R"(, "offset": )" +
                            std::to_string(kUint64Max - 2) + R"(, "speed": )" +
                            std::to_string(kUint64Max - 1) + R"(, "ready": false}])";

}  // namespace

TEST_CASE("qmp.adapter.counters_past_2_53_exact") {
  FakeQmp srv([](const auto& cmd) -> std::string {
    const std::string& c = command_name(cmd);
    if (c == "query-name") return reply(cmd, R"({"name": "vm-big"})");
    if (c == "query-version")
      return reply(cmd, R"({"qemu": {"major": 7, "minor": 2, "micro": 11}, "package": ""})");
    if (c == "query-block") return reply(cmd, kOneDisk);
    if (c == "query-blockstats") return reply(cmd, kBigStats);
    if (c == "query-block-jobs") return reply(cmd, kBigJob);
    return error_reply(cmd, "CommandNotFound", c);
  });
  QmpHypervisor hv(srv.path(), "", quick());
  REQUIRE(hv.connect());
  REQUIRE(hv.resolve_disk("vda") == "vda");

  const auto stats = hv.block_stats("vm-big", "vda");
  REQUIRE(stats);
  CHECK(stats->wr_total_times_ns == kPast53);
  CHECK(stats->wr_reqs == kPast53 + 2);
  CHECK(stats->flush_reqs == kInt64Max - 1);
  CHECK(stats->flush_total_times_ns == kInt64Max);

  const auto job = hv.job_info("vm-big", "vda");
  REQUIRE(job);
  CHECK(job->type == JobType::Commit);
  CHECK(job->end == kUint64Max);
  CHECK(job->cur == kUint64Max - 2);
  CHECK(job->bandwidth_bytes_per_s == kUint64Max - 1);
}

TEST_CASE("qmp.adapter.invalid_utf8_refused") {
  // "\xff" and a lone continuation byte: no UTF-8 encoding of anything.
  FakeQmp srv([](const auto& cmd) -> std::string {
    if (command_name(cmd) == "query-name") return reply(cmd, "{\"name\": \"vm-\xff\x80\"}");
    return error_reply(cmd, "CommandNotFound", command_name(cmd));
  });
  QmpHypervisor hv(srv.path(), "", quick());
  const bool connected = hv.connect();
  // Refused: the connection is dropped with a reason naming the encoding, and no name made of
  // those bytes exists to reach a log line or a JSON document.
  CHECK_FALSE(connected);
  CHECK(hv.last_error().find("UTF-8") != std::string::npos);
  CHECK(hv.name().find('\xff') == std::string::npos);
}
