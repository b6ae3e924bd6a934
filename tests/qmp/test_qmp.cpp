// SPDX-License-Identifier: GPL-2.0-or-later
// QMP client, framer and adapter against a scripted QMP server (tests/qmp/fake_qmp.h); the JSON
// shapes are QEMU 7.2's (captured from qemu-system-x86_64 7.2, trimmed).
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "plugin/host/json.h"
#include "plugin/hypervisor/qemu_cmdline.h"
#include "plugin/hypervisor/qmp_client.h"
#include "plugin/hypervisor/qmp_hypervisor.h"
#include "tests/qmp/fake_qmp.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
namespace json = qcommit::json;
using namespace std::chrono_literals;

namespace {

QmpOptions quick() {
  QmpOptions o;
  o.greeting_timeout = 300ms;
  o.command_timeout = 300ms;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

}  // namespace

json::Value parsed_qmp(const std::string& text) {
  std::string err;
  auto v = json::parse(text, json::kQmpLimits, &err);
  INFO(err);
  REQUIRE(v);
  return *v;
}

TEST_CASE("qmp.json.integers_serialize_limits") {
  const json::Value v = parsed_qmp(
      R"({"a": 123456789012, "b": -4, "c": 1.5, "d": 1e300, "e": "x\n",)"
      R"( "big": 9007199254740993, "umax": 18446744073709551615, "imin": -9223372036854775808,)"
      R"( "over": 18446744073709551616})");
  CHECK(json::to_int64(v["a"]) == 123456789012);
  CHECK(json::to_uint64(v["a"]) == 123456789012u);
  CHECK(json::to_int64(v["b"]) == -4);
  CHECK_FALSE(json::to_uint64(v["b"]));
  CHECK_FALSE(json::to_int64(v["c"]));
  CHECK_FALSE(json::to_int64(v["d"]));
  CHECK_FALSE(json::to_int64(v["e"]));
  // Exact over the whole 64-bit range, both signs; beyond it, not an integer.
  CHECK(json::to_int64(v["big"]) == 9007199254740993);
  CHECK(json::to_uint64(v["big"]) == 9007199254740993u);
  CHECK(json::to_uint64(v["umax"]) == std::numeric_limits<std::uint64_t>::max());
  CHECK_FALSE(json::to_int64(v["umax"]));
  CHECK(json::to_int64(v["imin"]) == std::numeric_limits<std::int64_t>::min());
  CHECK_FALSE(json::to_uint64(v["imin"]));
  CHECK_FALSE(json::to_uint64(v["over"]));
  const std::string text = json::dump(v);
  CHECK(contains(text, "\"a\":123456789012"));
  CHECK(contains(text, "\"big\":9007199254740993"));
  CHECK(contains(text, "\"umax\":18446744073709551615"));
  CHECK(contains(text, "\"c\":1.5"));
  CHECK(contains(text, "\"e\":\"x\\n\""));
  CHECK(json::dump(parsed_qmp(text)) == text);
  CHECK(json::dump_spaced(json::Ordered{{"event", "result"}, {"n", {1, 2}}, {"o", {{"k", "v"}}}}) ==
        R"({"event": "result", "n": [1, 2], "o": {"k": "v"}})");
  // The value cap: 1000 array elements + the array itself.
  std::string arr = "[";
  for (int i = 0; i < 1000; ++i) arr += i ? ",0" : "0";
  arr += "]";
  std::string err;
  CHECK(json::parse(arr, json::Limits{1 << 20, 1001}, &err));
  CHECK_FALSE(json::parse(arr, json::Limits{1 << 20, 1000}, &err));
  CHECK(contains(err, "too many values (more than 1000)"));
}

TEST_CASE("qmp.json.limits_and_utf8") {
  std::string err;
  // Nesting: kMaxNestingLevels arrays parse, one more is refused before anything is built.
  const std::size_t max = json::kMaxNestingLevels;
  const std::string at_cap = std::string(max, '[') + std::string(max, ']');
  CHECK(json::parse(at_cap, json::kQmpLimits, &err));
  const std::string deeper = std::string(max + 1, '[') + std::string(max + 1, ']');
  CHECK_FALSE(json::parse(deeper, json::kQmpLimits, &err));
  CHECK(err == "nesting too deep (more than " + std::to_string(max) + " levels)");
  CHECK_FALSE(json::parse(std::string(100000, '['), json::kQmpLimits, &err));
  CHECK(contains(err, "nesting too deep"));
  // Size: checked before parsing.
  const std::string big = "\"" + std::string(json::kControlMaxRequestBytes, 'x') + "\"";
  CHECK_FALSE(json::parse(big, json::kControlRequestLimits, &err));
  CHECK(err == "too large (more than " + std::to_string(json::kControlMaxRequestBytes) + " bytes)");
  // Invalid UTF-8 is not JSON; the message names it and leaves the bytes out.
  for (const char* bad : {"\"\xff\"", "\"\xc3\"", "\"\xed\xa0\x80\"", "{\"k\xfe\": 1}"}) {
    CAPTURE(bad);
    CHECK_FALSE(json::parse(bad, json::kQmpLimits, &err));
    CHECK(contains(err, "UTF-8"));
    CHECK(err.find('\xff') == std::string::npos);
    CHECK(err.find('\xfe') == std::string::npos);
  }
  CHECK(json::parse("\"\xc3\xa9\xf0\x9f\x98\x80\"", json::kQmpLimits, &err));  // é, 😀
  // A member name twice: refused (either value could be meant).
  CHECK_FALSE(json::parse(R"({"a": 1, "b": {"a": 2}, "a": 3})", json::kQmpLimits, &err));
  CHECK(err == "duplicate member name");
  CHECK(
      json::parse(R"({"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]})", json::kQmpLimits, &err));
  // Syntax errors: one line, a byte offset.
  CHECK_FALSE(json::parse(R"({"return": })", json::kQmpLimits, &err));
  CHECK(err.rfind("at byte 12: syntax error", 0) == 0);
  CHECK(err.find('\n') == std::string::npos);
  // Invalid UTF-8 in what qcommit writes (a file name) comes out as U+FFFD: valid JSON.
  const std::string out = json::dump_spaced(json::Ordered{{"filename",
                                                           "a\xff"
                                                           "b"}});
  CHECK(out ==
        "{\"filename\": \"a\xef\xbf\xbd"
        "b\"}");
  CHECK(json::parse(out, json::kQmpLimits, &err));
}

TEST_CASE("qmp.framer.splits_objects") {
  const std::string stream =
      "{\"QMP\": {\"x\": [1, {\"y\": \"}\"}]}}\r\n{\"a\": \"\\\"{\"}\n\n  {\n \"b\":\n [\n "
      "]\n}\r\n";
  // Whole, and fed one byte at a time: the same three messages.
  for (std::size_t chunk : {stream.size(), std::size_t{1}, std::size_t{7}}) {
    QmpFramer f(4096);
    std::vector<std::string> got;
    for (std::size_t i = 0; i < stream.size(); i += chunk) {
      std::string err;
      REQUIRE(f.feed(std::string_view(stream).substr(i, chunk), &err));
      while (auto m = f.next()) got.push_back(*m);
    }
    REQUIRE(got.size() == 3);
    CHECK(got[0] == "{\"QMP\": {\"x\": [1, {\"y\": \"}\"}]}}");
    CHECK(got[1] == "{\"a\": \"\\\"{\"}");
    for (const auto& m : got) CHECK(json::parse(m, json::kQmpLimits, nullptr));
    CHECK(f.buffered() == 0);
  }
  std::string err;
  QmpFramer g(4096);
  CHECK_FALSE(g.feed("SSH-2.0-OpenSSH_9.2\r\n", &err));
  CHECK(contains(err, "expected a JSON object, got 'S'"));
  QmpFramer h(4096);
  CHECK(h.feed("{\"a\": \"" + std::string(4000, 'x'), &err));
  CHECK_FALSE(h.feed(std::string(200, 'x'), &err));
  CHECK(contains(err, "larger than 4096 bytes"));
}

TEST_CASE("qmp.client.handshake_execute_events") {
  FakeQmp srv([](const json::Value& cmd) {
    if (command_name(cmd) == "query-name")
      // An event, a late reply to an older command, then the answer.
      return event("JOB_STATUS_CHANGE", R"({"status": "running", "id": "j1"})") +
             R"({"return": {"name": "stale"}, "id": "qcommit-0"})"
             "\r\n" +
             reply(cmd, R"({"name": "vm-100"})");
    if (command_name(cmd) == "echo-args") return reply(cmd, json::dump(cmd.at("arguments")));
    return error_reply(cmd, "CommandNotFound",
                       "The command " + command_name(cmd) + " has not been found");
  });
  QmpClient c = QmpClient::connect(srv.path(), quick());
  CHECK(json::member(c.greeting(), "QMP"));
  const json::Value name = c.execute("query-name");
  CHECK(json::string_member(name, "name") == "vm-100");
  auto events = c.take_queued_events();
  REQUIRE(events.size() == 1);
  CHECK(events[0].name == "JOB_STATUS_CHANGE");
  CHECK(json::string_member(events[0].data, "id") == "j1");
  CHECK(events[0].timestamp_us == 1700000000000005);

  const json::Value args{{"device", "vd\"a"}, {"speed", 1048576}, {"big", 9007199254740993u}};
  const json::Value echoed = c.execute("echo-args", args);
  CHECK(json::string_member(echoed, "device") == "vd\"a");
  CHECK(json::to_int64(echoed["speed"]) == 1048576);
  CHECK(json::to_uint64(echoed["big"]) == 9007199254740993u);

  const std::string e = error_of([&] { (void)c.execute("no-such-command"); });
  CHECK(e.rfind(srv.path() + ": no-such-command: The command", 0) == 0);
  CHECK(contains(e, "(CommandNotFound)"));
  try {
    (void)c.execute("no-such-command");
    FAIL("no error");
  } catch (const QmpCommandError& ce) {
    CHECK(ce.error_class == "CommandNotFound");
  }
  CHECK(c.is_open());  // a command error leaves the connection usable
  CHECK(json::string_member(c.execute("query-name"), "name") == "vm-100");

  const auto names = srv.received_names();
  REQUIRE(names.size() >= 2);
  CHECK(names[0] == "qmp_capabilities");
  for (const auto& cmd : srv.received())
    CHECK(json::member(cmd, "id"));  // every command carries an id
}

TEST_CASE("qmp.client.pretty_printed_monitor") {
  // `-mon ...,pretty=on`: messages spread over lines.
  const std::string greeting =
      "{\n    \"QMP\": {\n        \"version\": {},\n        \"capabilities\": [\n        ]\n    "
      "}\n}\n";
  FakeQmp srv(
      [](const json::Value& cmd) {
        const std::string id = json::dump(cmd.at("id"));
        return "{\n    \"return\": [\n        {\n            \"device\": \"vda\"\n        }\n    "
               "],\n    \"id\": " +
               id + "\n}\n";
      },
      greeting);
  QmpClient c = QmpClient::connect(srv.path(), quick());
  const json::Value r = c.execute("query-block");
  REQUIRE(r.is_array());
  CHECK(json::string_member(r.at(0), "device") == "vda");
}

TEST_CASE("qmp.client.not_a_monitor") {
  auto none = [](const json::Value&) { return std::string(); };
  {
    FakeQmp srv(none, "SSH-2.0-OpenSSH_9.2p1\r\n");
    const std::string e = error_of([&] { (void)QmpClient::connect(srv.path(), quick()); });
    CHECK(e.rfind(srv.path() + ": not a QMP monitor: protocol error: expected a JSON object", 0) ==
          0);
    CHECK(e.find('\n') == std::string::npos);
  }
  {
    FakeQmp srv(none, "{\"hello\": \"world\"}\n");
    const std::string e = error_of([&] { (void)QmpClient::connect(srv.path(), quick()); });
    CHECK(e == srv.path() + ": not a QMP monitor: its first message has no \"QMP\" greeting");
  }
  {
    FakeQmp srv(none, "");  // silent, like a monitor another client holds
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { (void)QmpClient::connect(srv.path(), quick()); });
    CHECK(e.rfind(srv.path() + ": no QMP greeting within 0.3 s", 0) == 0);
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  }
  {
    FakeQmp srv(none, std::string(10000, '{'));  // never ends: bounded by the message size
    QmpOptions o = quick();
    o.max_message_bytes = 4096;
    const std::string e = error_of([&] { (void)QmpClient::connect(srv.path(), o); });
    CHECK(contains(e, "larger than 4096 bytes"));
  }
  {
    FakeQmp srv(
        [](const json::Value& cmd) {
          return error_reply(cmd, "CommandNotFound",
                             "Capabilities negotiation is already complete");
        },
        kGreeting, true);
    const std::string e = error_of([&] { (void)QmpClient::connect(srv.path(), quick()); });
    CHECK(e ==
          srv.path() +
              ": capability negotiation refused: Capabilities negotiation is already complete");
  }
  const std::string missing = "/nonexistent-dir/qmp.sock";
  CHECK(error_of([&] { (void)QmpClient::connect(missing, quick()); }) ==
        missing + ": cannot connect: No such file or directory");
  const std::string too_long = "/tmp/" + std::string(200, 'x');
  CHECK(error_of([&] {
          (void)QmpClient::connect(too_long, quick());
        }).rfind(too_long + ": not a usable", 0) == 0);
}

TEST_CASE("qmp.client.garbage_oversized_timeout_eof") {
  std::string mode;
  FakeQmp srv([&](const json::Value& cmd) -> std::string {
    if (mode == "garbage") return "]]]\r\n";
    if (mode == "badjson") return "{\"return\": }\r\n";
    if (mode == "oversized") return "{\"return\": \"" + std::string(8192, 'x') + "\"}\r\n";
    if (mode == "deep") return reply(cmd, std::string(40, '[') + std::string(40, ']'));
    if (mode == "utf8") return reply(cmd, "\"\xff\"");
    if (mode == "values") {
      std::string arr = "[0";
      for (int i = 0; i < 100; ++i) arr += ",0";
      return reply(cmd, arr + "]");
    }
    if (mode == "silent") return "";
    if (mode == "close") return FakeQmp::kClose;
    return reply(cmd);
  });
  QmpOptions o = quick();
  o.max_message_bytes = 4096;
  o.max_message_values = 64;
  for (const auto& me : std::vector<std::pair<std::string, std::string>>{
           {"garbage", "protocol error: expected a JSON object, got ']'"},
           {"badjson",
            "protocol error: invalid JSON: at byte 12: syntax error while parsing value - "
            "unexpected '}'"},
           {"oversized", "protocol error: message larger than 4096 bytes"},
           {"values", "protocol error: invalid JSON: too many values (more than 64)"},
           {"deep", "protocol error: invalid JSON: nesting too deep (more than 32 levels)"},
           {"utf8",
            "protocol error: invalid JSON: at byte 13: syntax error while parsing value - "
            "invalid string: ill-formed UTF-8 byte"},
           {"silent", "no reply to query-x within 0.3 s"},
           {"close", "connection closed by the peer (QEMU quit?)"}}) {
    // Plain references, not a structured binding: clang 14 cannot capture one (CAPTURE).
    const std::string& m = me.first;
    const std::string& expect = me.second;
    CAPTURE(m);
    mode = "";
    QmpClient c = QmpClient::connect(srv.path(), o);
    mode = m;
    const std::string e = error_of([&] { (void)c.execute("query-x"); });
    CAPTURE(e);
    CHECK(e.rfind(srv.path() + ": " + expect, 0) == 0);
    CHECK_FALSE(c.is_open());  // transport failures close the connection
    CHECK(error_of([&] { (void)c.execute("query-x"); }) == srv.path() + ": connection closed");
    c.close();
    // The server drops the old client when it sees EOF; wait so the next connect is accepted.
    std::this_thread::sleep_for(20ms);
  }
}

TEST_CASE("qmp.client.events_bounded_and_waited_for") {
  FakeQmp srv([](const json::Value& cmd) {
    std::string out;
    for (int i = 0; i < 50; ++i)
      out += event("JOB_STATUS_CHANGE",
                   R"({"status": "running", "id": "j)" + std::to_string(i) + "\"}");
    return out + reply(cmd);
  });
  QmpOptions o = quick();
  o.max_queued_events = 10;
  QmpClient c = QmpClient::connect(srv.path(), o);
  (void)c.execute("query-block-jobs");
  auto ev = c.take_events(0ms);
  REQUIRE(ev.size() == 10);
  CHECK(json::string_member(ev.front().data, "id") == "j40");  // the oldest were dropped
  CHECK(c.dropped_events() == 40);
  // Nothing queued: take_events waits up to its timeout, and returns early when one arrives.
  auto t0 = std::chrono::steady_clock::now();
  CHECK(c.take_events(100ms).empty());
  CHECK(std::chrono::steady_clock::now() - t0 >= 90ms);
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    srv.push(
        event("BLOCK_JOB_READY",
              R"({"device": "qcommit-vda", "len": 5, "offset": 5, "speed": 0, "type": "commit"})"));
  });
  t0 = std::chrono::steady_clock::now();
  ev = c.take_events(5000ms);
  later.join();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].name == "BLOCK_JOB_READY");
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
}

TEST_CASE("qmp.client.hostile_event_timestamps") {
  // {seconds, microseconds} as a monitor might send them, and the microseconds the client keeps:
  // QEMU's form (both integers, 0 <= microseconds < 1 s, seconds small enough for int64_t
  // microseconds) or 0, never an overflowed product (UBSan: signed integer overflow).
  struct Stamp {
    const char* seconds;
    const char* micros;
    std::int64_t want;
  };
  const std::vector<Stamp> stamps{
      {"1700000000", "5", 1700000000000005},
      {"9223372036853", "999999", 9223372036853999999},  // the largest accepted
      {"9223372036854", "999999", 0},                    // 9223372036854999999 > INT64_MAX
      {"9300000000000", "0", 0},                         // 9.3e18 us
      {"9007199254740992", "0", 0},                      // 2^53 s, the largest exact integer
      {"9.3e18", "0", 0},
      {"1e300", "0", 0},
      {"-1", "-1", 0},
      {"-9007199254740991", "0", 0},
      {"1700000000", "-1", 0},
      {"1700000000", "1000000", 0},
      {"1700000000", "9007199254740991", 0},
      {"1.5", "0", 0},
      {"1700000000", "0.5", 0},
      {"\"1700000000\"", "5", 0},
  };
  FakeQmp srv([&](const json::Value& cmd) {
    std::string out;
    for (const Stamp& st : stamps)
      out += std::string(R"({"timestamp": {"seconds": )") + st.seconds + R"(, "microseconds": )" +
             st.micros +
             R"(}, "event": "STOP", "data": {}})"
             "\r\n";
    out += R"({"event": "RESUME", "timestamp": {"seconds": 1}, "data": {}})"
           "\r\n";
    return out + reply(cmd);
  });
  QmpClient c = QmpClient::connect(srv.path(), quick());
  (void)c.execute("query-status");
  auto ev = c.take_queued_events();
  REQUIRE(ev.size() == stamps.size() + 1);
  for (std::size_t i = 0; i < stamps.size(); ++i) {
    CAPTURE(stamps[i].seconds);
    CAPTURE(stamps[i].micros);
    CHECK(ev[i].timestamp_us == stamps[i].want);
  }
  CHECK(ev.back().timestamp_us == 0);  // microseconds missing
}

// --- adapter ---------------------------------------------------------------------------------

namespace {

// query-block of `-drive file=top.qcow2,if=none,id=vda -device virtio-blk-pci,drive=vda,id=disk0`
// on top.qcow2 → mid.qcow2 → base.qcow2, and of a -blockdev disk (device "", qdev path).
const char* kQueryBlock = R"([
 {"device": "vda", "qdev": "/machine/peripheral/disk0/virtio-backend", "locked": false,
  "inserted": {"node-name": "#block182", "drv": "qcow2", "file": "/s/top.qcow2",
   "backing_file": "/s/mid.qcow2", "backing_file_depth": 2,
   "cache": {"writeback": true, "direct": true, "no-flush": false},
   "image": {"filename": "/s/top.qcow2", "format": "qcow2", "backing-filename": "mid.qcow2",
    "backing-image": {"filename": "/s/mid.qcow2", "format": "qcow2",
     "backing-image": {"filename": "/s/base.qcow2", "format": "qcow2", "virtual-size": 67108864}}}}},
 {"device": "", "qdev": "/machine/peripheral/vdb/virtio-backend",
  "inserted": {"node-name": "top-fmt", "drv": "qcow2", "file": "/s/b-top.qcow2",
   "cache": {"writeback": true, "direct": false, "no-flush": false},
   "image": {"filename": "/s/b-top.qcow2", "format": "qcow2",
    "backing-image": {"filename": "/s/b-base.raw", "format": "raw"}}}},
 {"device": "cd0", "locked": false, "removable": true}
])";

const char* kNamedNodes = R"([
 {"node-name": "#block592", "drv": "qcow2", "file": "/s/base.qcow2"},
 {"node-name": "#block474", "drv": "file", "file": "/s/base.qcow2"},
 {"node-name": "#block311", "drv": "qcow2", "file": "/s/mid.qcow2"},
 {"node-name": "#block272", "drv": "file", "file": "/s/mid.qcow2"},
 {"node-name": "#block182", "drv": "qcow2", "file": "/s/top.qcow2"},
 {"node-name": "#block168", "drv": "raw", "file": "/s/b-base.raw"},
 {"node-name": "#block055", "drv": "file", "file": "/s/b-base.raw"},
 {"node-name": "top-fmt", "drv": "qcow2", "file": "/s/b-top.qcow2"}
])";

const char* kBlockStats = R"([
 {"device": "vda", "node-name": "#block182", "qdev": "/machine/peripheral/disk0/virtio-backend",
  "stats": {"wr_operations": 7, "wr_total_time_ns": 7000000, "flush_operations": 2,
   "flush_total_time_ns": 900000, "rd_operations": 3}, "parent": {"stats": {"wr_operations": 99}}},
 {"device": "", "node-name": "top-fmt", "qdev": "/machine/peripheral/vdb/virtio-backend",
  "stats": {"wr_operations": 1, "wr_total_time_ns": 5, "flush_operations": 0, "flush_total_time_ns": 0}}
])";

json::Value parsed(const char* text) {
  return parsed_qmp(text);
}

}  // namespace

TEST_CASE("qmp.adapter.parse_query_block_stats_jobs") {
  const auto disks = parse_query_block(parsed(kQueryBlock));
  REQUIRE(disks.size() == 2);  // the empty cd drive is skipped
  CHECK(disks[0].info.target == "vda");
  CHECK(disks[0].info.source == "/s/top.qcow2");
  CHECK(disks[0].info.backing_chain == std::vector<std::string>{"/s/mid.qcow2", "/s/base.qcow2"});
  CHECK(disks[0].formats == std::vector<std::string>{"qcow2", "qcow2", "qcow2"});
  CHECK(disks[0].qmp_device() == "vda");
  CHECK(disks[0].matches("disk0"));
  CHECK(disks[0].matches("/s/top.qcow2"));
  CHECK_FALSE(disks[0].matches(""));
  CHECK(disks[1].info.target == "vdb");  // -blockdev: named by the device id
  CHECK(disks[1].qmp_device() == "top-fmt");
  CHECK(disks[1].info.backing_chain == std::vector<std::string>{"/s/b-base.raw"});
  CHECK(disks[0].info.cache == "none");  // direct + writeback: libvirt's cache=none
  CHECK(disks[1].info.cache.empty());    // through the page cache

  const auto nodes = parse_named_block_nodes(parsed(kNamedNodes));
  CHECK(node_of(nodes, "/s/mid.qcow2", "qcow2") == "#block311");
  CHECK(node_of(nodes, "/s/b-base.raw", "raw") == "#block168");  // not the protocol node
  CHECK(node_of(nodes, "/s/other.qcow2", "qcow2").empty());

  const auto s0 = parse_blockstats(parsed(kBlockStats), disks[0]);
  REQUIRE(s0);
  CHECK(s0->wr_reqs == 7);  // the backend's counters, not the protocol node's ("parent")
  CHECK(s0->wr_total_times_ns == 7000000);
  CHECK(s0->flush_reqs == 2);
  CHECK(s0->flush_total_times_ns == 900000);
  const auto s1 = parse_blockstats(parsed(kBlockStats), disks[1]);
  REQUIRE(s1);
  CHECK(s1->wr_reqs == 1);

  CHECK(qdev_id("/machine/peripheral/scsi0/virtio-backend") == "scsi0");
  CHECK(qdev_id("/machine/peripheral-anon/device[0]/virtio-backend").empty());
  CHECK(qdev_id("ide0-hd0") == "ide0-hd0");
  CHECK(qcommit_job_id("drive-scsi0") == "qcommit-drive-scsi0");
  CHECK(qcommit_job_id("/machine/x") == "qcommit-_machine_x");
  CHECK(name_from_socket("/var/run/qemu-server/100.qmp") == "100");
  CHECK(name_from_socket("qmp") == "qmp");

  const auto jobs = parse_block_jobs(parsed(R"([
    {"device": "qcommit-vda", "type": "commit", "status": "ready", "len": 0, "offset": 0,
     "speed": 1048576, "ready": true, "auto-dismiss": true},
    {"device": "j2", "type": "commit", "status": "running", "len": 100, "offset": 100, "speed": 0,
     "ready": false},
    {"device": "j3", "type": "mirror", "status": "running", "len": 100, "offset": 100, "ready": false}])"));
  REQUIRE(jobs.size() == 3);
  // Ready with nothing to copy (0/0): still cur == end > 0, which is what "ready" means to
  // LiveMerge and the governor.
  const JobInfo ready = to_job_info(jobs[0], true);
  CHECK(ready.type == JobType::ActiveCommit);
  CHECK(ready.end > 0);
  CHECK(ready.cur == ready.end);
  CHECK(ready.bandwidth_bytes_per_s == 1048576);
  // An active commit that copied everything but is not ready: not cur == end.
  const JobInfo busy = to_job_info(jobs[1], true);
  CHECK(busy.cur + 1 == busy.end);
  // A non-active commit is just copying: cur == end is fine; foreign jobs are typed by QEMU's type.
  CHECK(to_job_info(jobs[1], false).cur == 100);
  CHECK(to_job_info(jobs[1], std::nullopt).type == JobType::Commit);
  CHECK(to_job_info(jobs[0], std::nullopt).type == JobType::ActiveCommit);
  CHECK(to_job_info(jobs[2], std::nullopt).type == JobType::Copy);
  CHECK(to_job_info(jobs[2], std::nullopt).cur == 99);
}

TEST_CASE("qmp.adapter.commit_speed_events_pivot") {
  // A scripted QEMU: one commit job on vda; its state is driven by the test.
  std::mutex m;
  std::string job_status;  // "" = no job
  bool ready = false;
  std::string active_layer = "/s/top.qcow2";
  FakeQmp srv([&](const json::Value& cmd) -> std::string {
    std::lock_guard<std::mutex> g(m);
    const std::string& c = command_name(cmd);
    if (c == "query-name") return reply(cmd, "{}");  // unnamed: the socket's name is used
    if (c == "query-version")
      return reply(
          cmd,
          R"({"qemu": {"major": 7, "minor": 2, "micro": 11}, "package": "Debian 1:7.2+dfsg-7"})");
    if (c == "query-block") {
      std::string qb = kQueryBlock;
      if (active_layer != "/s/top.qcow2") {
        // After the pivot: base is the active layer.
        qb = R"([{"device": "vda", "qdev": "/machine/peripheral/disk0/virtio-backend",
                 "inserted": {"node-name": "#block592", "image": {"filename": "/s/base.qcow2",
                 "format": "qcow2"}}}])";
      }
      return reply(cmd, qb);
    }
    if (c == "query-named-block-nodes") return reply(cmd, kNamedNodes);
    if (c == "query-blockstats") return reply(cmd, kBlockStats);
    if (c == "query-block-jobs") {
      if (job_status.empty()) return reply(cmd, "[]");
      return reply(cmd, R"([{"device": "qcommit-vda", "type": "commit", "status": ")" + job_status +
                            R"(", "len": 1000, "offset": 400, "speed": 4194304, "ready": )" +
                            (ready ? "true" : "false") + "}]");
    }
    if (c == "block-commit") {
      job_status = "running";
      return event("JOB_STATUS_CHANGE", R"({"status": "created", "id": "qcommit-vda"})") +
             reply(cmd);
    }
    if (c == "block-job-set-speed") {
      if (job_status.empty()) return error_reply(cmd, "DeviceNotActive", "Block job 'x' not found");
      return reply(cmd);
    }
    if (c == "block-job-complete") {
      if (!ready)
        return error_reply(cmd, "GenericError",
                           "The active block job 'qcommit-vda' cannot be completed");
      job_status = "";
      active_layer = "/s/base.qcow2";
      return event(
                 "BLOCK_JOB_COMPLETED",
                 R"({"device": "qcommit-vda", "len": 1000, "offset": 1000, "speed": 0, "type": "commit"})") +
             reply(cmd);
    }
    return error_reply(cmd, "CommandNotFound", c);
  });

  QmpHypervisor hv(srv.path(), "", quick());
  std::vector<JobEvent> events;
  hv.set_event_sink([&](const JobEvent& e) { events.push_back(e); });
  REQUIRE(hv.connect());
  CHECK(hv.name() == "qmp");  // qmp.sock, no -name
  CHECK(hv.qemu_version() == 7002011u);
  CHECK(hv.resolve_disk("disk0") == "vda");
  CHECK(hv.resolve_disk("vdb") == "vdb");
  CHECK_FALSE(hv.resolve_disk("vdz"));
  auto doms = hv.running_domains();
  REQUIRE(doms.size() == 1);
  CHECK(doms[0].disks.size() == 2);
  CHECK_FALSE(hv.job_info("qmp", "vda"));
  CHECK_FALSE(hv.set_job_speed("qmp", "vda", 1000));  // no job: an ordinary false
  CHECK(hv.block_stats("qmp", "vda")->wr_reqs == 7);
  CHECK_FALSE(hv.block_stats("other-vm", "vda"));

  // Errors name the disk and what was asked.
  CHECK(
      error_of([&] { hv.start_commit("qmp", "vda", "/s/base.qcow2", "/s/top.qcow2", 1, false); }) ==
      "qmp vda: block commit of /s/top.qcow2 into /s/base.qcow2: /s/top.qcow2 is the active layer");
  CHECK(contains(
      error_of([&] { hv.start_commit("qmp", "vda", "/s/nope.qcow2", "/s/top.qcow2", 1, true); }),
      "/s/nope.qcow2 is not in the disk's chain"));

  hv.start_commit("qmp", "vda", "/s/base.qcow2", "/s/top.qcow2", 4194304, true);
  json::Value commit;
  for (const auto& c : srv.received())
    if (command_name(c) == "block-commit") commit = c.at("arguments");
  CHECK(
      json::dump(commit) ==
      R"({"base-node":"#block592","device":"vda","job-id":"qcommit-vda","speed":4194304,"top-node":"#block182"})");
  auto info = hv.job_info("qmp", "vda");
  REQUIRE(info);
  CHECK(info->type == JobType::ActiveCommit);  // typed by us: QEMU says "commit"
  CHECK(info->cur == 400);
  CHECK(info->end == 1000);
  CHECK(hv.running_domains()[0].disks[0].mirror == "/s/base.qcow2");
  CHECK(hv.set_job_speed("qmp", "vda", 2 << 20));
  CHECK_FALSE(hv.set_job_speed("qmp", "vda", 0));  // 0 would be unlimited: never sent
  json::Value speed;
  for (const auto& c : srv.received())
    if (command_name(c) == "block-job-set-speed") speed = c.at("arguments");
  CHECK(json::dump(speed) == R"({"device":"qcommit-vda","speed":2097152})");
  // A speed past 2^53 is sent exact.
  CHECK(hv.set_job_speed("qmp", "vda", 9007199254740993u));
  for (const auto& c : srv.received())
    if (command_name(c) == "block-job-set-speed") speed = c.at("arguments");
  CHECK(json::to_uint64(speed["speed"]) == 9007199254740993u);

  // Events reach the sink from pump(), mapped to the disk.
  srv.push(event(
      "BLOCK_JOB_READY",
      R"({"device": "qcommit-vda", "len": 1000, "offset": 1000, "speed": 0, "type": "commit"})"));
  hv.pump(2000ms);
  REQUIRE(events.size() >= 2);
  CHECK(events[0].kind == JobEventKind::StatusChange);
  CHECK(events[0].detail == "qcommit-vda created");
  CHECK(events[0].disk == "vda");
  CHECK(events.back().kind == JobEventKind::Ready);
  CHECK(events.back().disk == "vda");
  CHECK(events.back().domain == "qmp");
  CHECK(events.back().type == JobType::ActiveCommit);

  // Pivot: not before QEMU says ready; then complete, done once the job is gone and BASE is
  // the active layer.
  CHECK_FALSE(hv.pivot("qmp", "vda"));
  {
    std::lock_guard<std::mutex> g(m);
    job_status = "ready";
    ready = true;
  }
  CHECK(hv.pivot("qmp", "vda"));
  hv.pump(0ms);
  CHECK(events.back().kind == JobEventKind::Completed);
  bool completed_sent = false;
  for (const auto& n : srv.received_names()) completed_sent |= n == "block-job-complete";
  CHECK(completed_sent);
  CHECK(hv.running_domains()[0].disks[0].source == "/s/base.qcow2");
}

TEST_CASE("qmp.adapter.failed_job_and_lost_connection") {
  std::atomic<bool> quit{false};
  FakeQmp srv([&](const json::Value& cmd) -> std::string {
    const std::string& c = command_name(cmd);
    if (quit) return FakeQmp::kClose;
    if (c == "query-name") return reply(cmd, R"({"name": "vm-7"})");
    if (c == "query-block") return reply(cmd, kQueryBlock);
    if (c == "query-named-block-nodes") return reply(cmd, kNamedNodes);
    if (c == "query-block-jobs") return reply(cmd, "[]");
    if (c == "block-commit")
      return reply(cmd) +
             event("BLOCK_JOB_ERROR",
                   R"({"device": "qcommit-vda", "operation": "write", "action": "report"})") +
             event(
                 "BLOCK_JOB_COMPLETED",
                 R"({"device": "qcommit-vda", "len": 9, "offset": 3, "speed": 0, "type": "commit", "error": "No space left on device"})");
    return error_reply(cmd, "CommandNotFound", c);
  });
  QmpHypervisor hv(srv.path(), "", quick());
  std::vector<JobEvent> events;
  hv.set_event_sink([&](const JobEvent& e) { events.push_back(e); });
  REQUIRE(hv.connect());
  CHECK(hv.name() == "vm-7");
  CHECK_FALSE(hv.qemu_version());  // query-version unknown to this QEMU: not assumed
  hv.start_commit("vm-7", "vda", "/s/base.qcow2", "/s/mid.qcow2", 1 << 20, false);
  hv.pump(200ms);
  REQUIRE(events.size() == 2);
  CHECK(events[0].kind == JobEventKind::StatusChange);
  CHECK(events[0].detail == "qcommit-vda error write report");
  CHECK(events[1].kind == JobEventKind::Failed);
  CHECK(events[1].disk == "vda");
  CHECK(events[1].type == JobType::Commit);
  CHECK(hv.last_job_error() == "job qcommit-vda failed: No space left on device");
  CHECK_FALSE(hv.job_info("vm-7", "vda"));

  // QEMU goes away: calls throw HypervisorDisconnected naming the socket; connect() fails with
  // a one-line reason.
  quit = true;
  const std::string e = error_of([&] { (void)hv.running_domains(); });
  CHECK(e == srv.path() + ": connection closed by the peer (QEMU quit?)");
  CHECK_FALSE(hv.connected());
  try {
    (void)hv.job_info("vm-7", "vda");
    FAIL("no exception");
  } catch (const HypervisorDisconnected& d) {
    CHECK(contains(d.what(), srv.path()));
  }
  hv.pump(10ms);  // disconnected: sleeps, no throw
  quit = false;
  std::this_thread::sleep_for(20ms);
  REQUIRE(hv.connect());  // reconnects to the same monitor
  CHECK(srv.accepted() == 2);
  QmpHypervisor gone("/nonexistent/100.qmp", "", quick());
  CHECK_FALSE(gone.connect());
  CHECK(gone.last_error() == "/nonexistent/100.qmp: cannot connect: No such file or directory");
}

// domain(): which iothread serves each disk, from the devices' QOM properties as QEMU answers
// qom-get: a virtio-blk "iothread" link, a virtio-blk "iothread-vq-mapping", a SCSI disk's
// controller (through its "parent_bus"), and a virtio-blk disk left to the main loop.
TEST_CASE("qmp.adapter.iothreads_from_qom") {
  std::mutex m;
  std::string iothreads = R"([{"id": "iot1", "thread-id": 4242, "poll-max-ns": 32768}])";
  std::vector<std::string> asked;
  FakeQmp srv([&](const json::Value& cmd) -> std::string {
    std::lock_guard<std::mutex> g(m);
    const std::string& c = command_name(cmd);
    if (c == "query-name") return reply(cmd, R"({"name": "vm-io"})");
    if (c == "query-block-jobs") return reply(cmd, "[]");
    if (c == "query-iothreads") return reply(cmd, iothreads);
    if (c == "query-block")
      return reply(cmd, R"([
 {"device": "vda", "qdev": "/machine/peripheral/disk0/virtio-backend",
  "inserted": {"node-name": "#block1", "image": {"filename": "/s/a.qcow2", "format": "qcow2"}}},
 {"device": "", "qdev": "/machine/peripheral/vdb/virtio-backend",
  "inserted": {"node-name": "n2", "image": {"filename": "/s/b.qcow2", "format": "qcow2"}}},
 {"device": "", "qdev": "scsi0-0-0-0",
  "inserted": {"node-name": "n3", "image": {"filename": "/s/c.qcow2", "format": "qcow2"}}},
 {"device": "", "qdev": "/machine/peripheral/vdd/virtio-backend",
  "inserted": {"node-name": "n4", "image": {"filename": "/s/d.qcow2", "format": "qcow2"}}}])");
    if (c != "qom-get") return error_reply(cmd, "CommandNotFound", c);
    const json::Value& args = *json::member(cmd, "arguments");
    const std::string path = json::string_member(args, "path");
    const std::string prop = json::string_member(args, "property");
    asked.push_back(path + " " + prop);
    const auto not_found = [&] {
      return error_reply(cmd, "GenericError", "Property '" + prop + "' not found");
    };
    if (path == "/machine/peripheral/scsi0-0-0-0") {
      if (prop != "parent_bus") return not_found();
      return reply(cmd, R"("/machine/peripheral/scsi0/virtio-backend/scsi0.0")");
    }
    if (path == "/machine/peripheral/scsi0/virtio-backend")
      return prop == "iothread" ? reply(cmd, R"("/objects/iot1")") : not_found();
    if (prop == "iothread")
      return reply(
          cmd, path == "/machine/peripheral/disk0/virtio-backend" ? R"("/objects/iot1")" : R"("")");
    if (prop == "iothread-vq-mapping")
      return reply(cmd, path == "/machine/peripheral/vdb/virtio-backend"
                            ? R"([{"iothread": "iot1", "vqs": [0, 1]}, {"iothread": "iot2"}])"
                            : "[]");
    return not_found();
  });
  QmpHypervisor hv(srv.path(), "", quick());
  REQUIRE(hv.connect());
  const std::optional<DomainInfo> d = hv.domain("vm-io");
  REQUIRE(d);
  CHECK(d->iothreads);
  REQUIRE(d->defined_disks.size() == 4);
  CHECK(d->defined_disks[0].target == "vda");
  CHECK(d->defined_disks[0].iothread == "iot1");
  CHECK(d->defined_disks[1].target == "vdb");
  CHECK(d->defined_disks[1].iothread == "iot1");
  CHECK(d->defined_disks[2].target == "scsi0-0-0-0");
  CHECK(d->defined_disks[2].iothread == "iot1");
  CHECK(d->defined_disks[3].target == "vdd");
  CHECK(d->defined_disks[3].iothread.empty());
  CHECK(d->disks[0].iothread == "iot1");
  // The QMP peer here is this test process, whose command line names no disk: no io mode.
  CHECK_FALSE(d->defined_disks[0].io_known);
  CHECK(d->defined_disks[0].io.empty());
  {
    std::lock_guard<std::mutex> g(m);
    CHECK(std::find(asked.begin(), asked.end(),
                    "/machine/peripheral/scsi0/virtio-backend iothread") != asked.end());
    iothreads = "[]";
  }
  // The per-tick view asks QEMU nothing of iothreads.
  const std::size_t before = asked.size();
  CHECK(hv.running_domains().front().defined_disks.empty());
  CHECK(asked.size() == before);
  CHECK_FALSE(hv.domain("vm-io")->iothreads);
  CHECK_FALSE(hv.domain("other"));

  CHECK(parse_iothreads(parsed_qmp(R"([{"id": "a"}, {"thread-id": 1}, {"id": "b"}])")) ==
        std::vector<std::string>{"a", "b"});
  CHECK(iothread_of_property(parsed_qmp(R"("/objects/iot9")")) == "iot9");
  CHECK(iothread_of_property(parsed_qmp(R"("")")).empty());
  CHECK(iothread_of_property(parsed_qmp("[]")).empty());
  CHECK(iothread_of_property(parsed_qmp("null")).empty());
}

// A disk's aio mode from QEMU's command line (QMP does not report it), in the spellings QEMU takes:
// -drive (Proxmox VE 8), -blockdev and -device as JSON (libvirt) or key=value with dotted keys,
// a filter above the format node, a root node a snapshot replaced, and what stays unknown.
TEST_CASE("qmp.adapter.aio_from_command_line") {
  // clang-format off
  const QemuCommandLine cl = parse_qemu_command_line({
      "/usr/bin/kvm", "-id", "100", "-name", "vm100,debug-threads=on",
      "-drive", "file=/dev/pve/vm-100-disk-0,if=none,id=drive-scsi0,aio=io_uring,format=raw,"
                "cache=none",
      "-device", "scsi-hd,bus=scsihw0.0,scsi-id=0,drive=drive-scsi0,id=scsi0",
      "-drive", "file=/srv/a,,b.qcow2,if=none,id=drive-virtio1,format=qcow2",
      "--drive", "file=/srv/c.qcow2,if=none,id=d2,file.aio=native,cache.direct=on",
      "-blockdev", R"({"driver":"file","filename":"/var/lib/libvirt/images/v.qcow2",)"
                   R"("node-name":"libvirt-2-storage","aio":"native",)"
                   R"("cache":{"direct":true,"no-flush":false}})",
      "-blockdev", R"({"node-name":"libvirt-2-format","read-only":false,"driver":"qcow2",)"
                   R"("file":"libvirt-2-storage","backing":null})",
      "-device", R"({"driver":"virtio-blk-pci","bus":"pci.4","addr":"0x0",)"
                 R"("drive":"libvirt-2-format","id":"virtio-disk0","bootindex":1})",
      "-blockdev", "driver=qcow2,node-name=nested,file.driver=file,file.filename=/x.qcow2,"
                   "file.aio=io_uring",
      "-object", "throttle-group,id=tg,x-bps-write=8388608",
      "-blockdev", "driver=file,filename=/t.qcow2,node-name=t-file",
      "-blockdev", "qcow2,file=t-file,node-name=t-fmt",
      "-blockdev", "driver=throttle,throttle-group=tg,file=t-fmt,node-name=t-slow",
      "-device", "virtio-blk-pci,drive=t-slow,id=vdt",
      "-blockdev", "driver=nbd,server.type=inet,server.host=h,server.port=10809,node-name=net",
      "-blockdev", "driver=qcow2,node-name=loop-a,file=loop-b",
      "-blockdev", "driver=raw,node-name=loop-b,file=loop-a",
      "-blockdev", "{not json",
      "-drive"});
  // clang-format on
  CHECK(cl.drives.size() == 3);
  CHECK(cl.blockdevs.size() == 9);  // the malformed JSON is left out
  CHECK(cl.devices.size() == 3);
  CHECK(cl.drives[1].at("file") == "/srv/a,b.qcow2");
  CHECK(cl.blockdevs[4].at("driver") == "qcow2");  // the implied first key

  CHECK(aio_of(cl, {"drive-scsi0", "scsi0", "#block123"}) == "io_uring");
  CHECK(aio_of(cl, {"drive-virtio1", "", "#block456"}) == "");  // set nowhere: QEMU's threads
  CHECK(aio_of(cl, {"d2", "", ""}) == "native");
  CHECK(aio_of(cl, {"", "virtio-disk0", "libvirt-2-format"}) == "native");
  // After an external snapshot the root is the overlay's node: the device's drive still leads.
  CHECK(aio_of(cl, {"", "virtio-disk0", "libvirt-3-format"}) == "native");
  CHECK(aio_of(cl, {"", "", "nested"}) == "io_uring");
  CHECK(aio_of(cl, {"", "vdt", "t-slow"}) == "");  // through the filter and the format node
  CHECK_FALSE(aio_of(cl, {"", "", "net"}));        // no protocol node with an aio
  CHECK_FALSE(aio_of(cl, {"", "", "loop-a"}));     // a loop ends
  CHECK_FALSE(aio_of(cl, {"hotplugged", "sdh", "sdh-fmt"}));
  CHECK_FALSE(aio_of(QemuCommandLine{}, {"drive-scsi0", "scsi0", ""}));

  const std::vector<std::string> self = read_cmdline(::getpid());
  REQUIRE_FALSE(self.empty());
  CHECK(self[0].find("qmp_tests") != std::string::npos);
  CHECK(read_cmdline(-1).empty());
}
