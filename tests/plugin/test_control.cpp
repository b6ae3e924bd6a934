// SPDX-License-Identifier: GPL-2.0-or-later
#include <doctest/doctest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "plugin/daemon/control.h"
#include "plugin/host/json.h"

using namespace qcommit::plugin;
namespace json = qcommit::json;

namespace {

int connect_to(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Reads one line (or until EOF / 2 s).
std::string read_line(int fd, bool* eof = nullptr) {
  std::string out;
  char c;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) break;
    const ssize_t n = ::recv(fd, &c, 1, 0);
    if (n <= 0) {
      if (eof) *eof = true;
      break;
    }
    if (c == '\n') break;
    out += c;
  }
  return out;
}

void send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

}  // namespace

TEST_CASE("plugin.json.parse") {
  std::string err;
  auto v = json::parse(R"( {"a":[1,2.5e3,-0.5,true,false,null],"b":"x\"\u00e9\ud83d\ude00"} )",
                       json::kControlRequestLimits, &err);
  REQUIRE(v);
  CHECK(v->at("a").at(1).get<double>() == 2500);
  CHECK(json::string_member(*v, "b") == "x\"\xc3\xa9\xf0\x9f\x98\x80");
  for (const char* bad : {"{", "{\"a\":}", "[1,]", "{\"a\":1}x", "\"\x01\"", "01x",
                          "{\"a\":1,\"a\":2}", "\"\\ud800\"", "nul", "\"\xff\"", ""}) {
    CAPTURE(bad);
    CHECK_FALSE(json::parse(bad, json::kControlRequestLimits, &err));
    CHECK_FALSE(err.empty());
  }
  std::string deep(100, '[');
  CHECK_FALSE(json::parse(deep + std::string(100, ']'), json::kControlRequestLimits, &err));
  CHECK(err.find("too deep") != std::string::npos);
}

TEST_CASE("plugin.control.answer_request") {
  auto status = [] { return std::string("{\"ok\":true,\"jobs\":[]}"); };
  CHECK(answer_request(R"({"cmd":"status"})", status) == status());
  CHECK(answer_request("{\"cmd\":\"ping\"}", status) == "{\"ok\":true}");
  for (const char* bad : {"", "status", "[]", "{\"cmd\":1}", "{\"cmd\":\"status\",\"x\":1}",
                          "{\"cmd\":\"reboot\"}"}) {
    const std::string r = answer_request(bad, status);
    auto v = json::parse(r, json::kControlResponseLimits, nullptr);
    REQUIRE(v);
    CHECK(v->at("ok") == false);
    CHECK_FALSE(json::string_member(*v, "error").empty());
  }
  CHECK(answer_request(std::string(json::kControlMaxRequestBytes + 1, ' '), status)
            .find("too large") != std::string::npos);
  // Too deep, invalid UTF-8: refused with the reason, and the response itself is valid JSON.
  const std::string deep = "{\"cmd\":" + std::string(40, '[') + std::string(40, ']') + "}";
  CHECK(answer_request(deep, status).find("nesting too deep") != std::string::npos);
  const std::string utf8 = answer_request("{\"cmd\":\"st\xffus\"}", status);
  CHECK(utf8.find("UTF-8") != std::string::npos);
  CHECK(json::parse(utf8, json::kControlResponseLimits, nullptr));
}

TEST_CASE("plugin.control.socket_round_trip") {
  char dir[] = "/tmp/qcommit-sock-XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string path = std::string(dir) + "/run/qcommitd.sock";
  GovernorStatus st;
  st.connected = true;
  JobStatus js;
  js.domain = "vm \"1\"";
  js.disk = "vda";
  js.type = JobType::ActiveCommit;
  js.budget = std::chrono::milliseconds(20);
  js.speed_bytes_per_s = 123456;
  js.latency_p99 = std::chrono::milliseconds(3);
  js.bytes_left = 1000;
  js.eta_s = 2.5;
  js.probe = ProbeState::kOff;
  js.probe_off_reason = "cannot create the probe file /p/.qcommit-probe-1-0: Read-only file system";
  js.target_throttle = "off: blockdev-reopen refused";
  st.jobs.push_back(js);
  const std::string snapshot = status_json(st, TimePoint{});
  {
    ControlServer server(path, [&] { return snapshot; });
    server.start();
    struct stat sb {};
    REQUIRE(::stat(path.c_str(), &sb) == 0);
    CHECK((sb.st_mode & 0777) == 0600);
    CHECK((::stat(dir, &sb) == 0));

    const int fd = connect_to(path);
    REQUIRE(fd >= 0);
    send_all(fd, "{\"cmd\":\"status\"}\n{\"cmd\":\"ping\"}\n");
    const std::string r1 = read_line(fd);
    auto v = json::parse(r1, json::kControlResponseLimits, nullptr);
    REQUIRE(v);
    CHECK(v->at("ok") == true);
    CHECK(r1.rfind("{\"ok\":true,\"connected\":true,\"jobs\":[{\"domain\":", 0) == 0);
    const auto& job = v->at("jobs").at(0);
    CHECK(json::string_member(job, "domain") == "vm \"1\"");
    CHECK(json::string_member(job, "type") == "active-commit");
    CHECK(json::to_uint64(job.at("speed_bytes_per_s")) == 123456u);
    CHECK(job.at("latency_p99_ms").get<double>() == 3);
    CHECK(job.at("eta_s").get<double>() == 2.5);
    CHECK(json::string_member(job, "probe") == "off");
    CHECK(json::string_member(job, "probe_off_reason") == js.probe_off_reason);
    CHECK(job.at("probe_last_ms").is_null());
    CHECK(job.at("probe_period_ms").is_null());
    CHECK(json::string_member(job, "target_throttle") == js.target_throttle);
    CHECK(read_line(fd) == "{\"ok\":true}");
    send_all(fd, "this is not json\n");
    CHECK(read_line(fd).find("malformed request") != std::string::npos);
    // Oversized: error, then the server closes the connection.
    send_all(fd, std::string(json::kControlMaxRequestBytes + 100, 'a'));
    bool eof = false;
    CHECK(read_line(fd, &eof).find("too large") != std::string::npos);
    (void)read_line(fd, &eof);
    CHECK(eof);
    ::close(fd);

    // A second server on the same live socket is refused.
    CHECK_THROWS_AS(ControlServer(path, [] { return std::string(); }), std::runtime_error);
  }
  // The socket is removed on shutdown; a stale one is replaced.
  struct stat sb {};
  CHECK(::stat(path.c_str(), &sb) != 0);
  {
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    ::close(s);  // stale socket file, nobody listening
    ControlServer server(path, [] { return std::string("{\"ok\":true}"); });
    server.start();
    const int fd = connect_to(path);
    REQUIRE(fd >= 0);
    send_all(fd, "{\"cmd\":\"status\"}\n");
    CHECK(read_line(fd) == "{\"ok\":true}");
    ::close(fd);
  }
  ::rmdir((std::string(dir) + "/run").c_str());
  ::rmdir(dir);
}
