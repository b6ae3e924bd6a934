// SPDX-License-Identifier: GPL-2.0-or-later
// A scripted QMP server on a temporary UNIX socket for the QMP client/adapter tests: sends a
// greeting, then answers each command line with whatever the test's handler returns (replies,
// events, garbage, nothing), in a thread of its own.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "plugin/host/json.h"

namespace qcommit::plugin::test {

inline const char* kGreeting =
    R"({"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, )"
    R"("capabilities": ["oob"]}})"
    "\r\n";

// The reply QEMU would send to `cmd` with `ret` (JSON text) as its return value.
inline std::string reply(const json::Value& cmd, const std::string& ret = "{}") {
  const json::Value* id = json::member(cmd, "id");
  return "{\"return\": " + ret + (id ? ", \"id\": " + json::dump(*id) : "") + "}\r\n";
}
inline std::string error_reply(const json::Value& cmd, const std::string& cls,
                               const std::string& desc) {
  json::Value msg{{"error", {{"class", cls}, {"desc", desc}}}};
  if (const json::Value* id = json::member(cmd, "id")) msg["id"] = *id;
  return json::dump(msg) + "\r\n";
}
inline std::string event(const std::string& name, const std::string& data) {
  return R"({"timestamp": {"seconds": 1700000000, "microseconds": 5}, "event": ")" + name +
         R"(", "data": )" + data + "}\r\n";
}
inline const std::string& command_name(const json::Value& cmd) {
  return json::string_member(cmd, "execute");
}

class FakeQmp {
 public:
  static constexpr const char* kClose = "\x01close";  // handler result: hang up

  // `handler` gets every command but qmp_capabilities (answered with {} unless
  // `handle_capabilities`), returns the bytes to send.  `greeting` is sent on accept ("" =
  // nothing).
  explicit FakeQmp(std::function<std::string(const json::Value&)> handler,
                   std::string greeting = kGreeting, bool handle_capabilities = false)
      : handler_(std::move(handler)),
        greeting_(std::move(greeting)),
        handle_capabilities_(handle_capabilities) {
    char tmpl[] = "/tmp/qcommit-qmp-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp");
    dir_ = tmpl;
    path_ = dir_ + "/qmp.sock";
    listen_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path_.c_str(), sizeof a.sun_path - 1);
    if (::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_, 4) != 0)
      throw std::runtime_error("bind/listen " + path_);
    if (::pipe(stop_) != 0) throw std::runtime_error("pipe");
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeQmp() {
    (void)!::write(stop_[1], "x", 1);
    thread_.join();
    ::close(listen_);
    ::close(stop_[0]);
    ::close(stop_[1]);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  FakeQmp(const FakeQmp&) = delete;
  FakeQmp& operator=(const FakeQmp&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::vector<json::Value> received() {
    std::lock_guard<std::mutex> g(m_);
    return received_;
  }
  [[nodiscard]] std::vector<std::string> received_names() {
    std::vector<std::string> out;
    for (const auto& c : received()) out.push_back(command_name(c));
    return out;
  }
  // Bytes sent to the current client from outside a command (events between commands).
  void push(const std::string& bytes) {
    std::lock_guard<std::mutex> g(m_);
    pushed_ += bytes;
    (void)!::write(stop_[1], "p", 1);
  }
  [[nodiscard]] int accepted() const { return accepted_; }

 private:
  void send_all(int fd, const std::string& s) {
    std::size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<std::size_t>(n);
    }
  }
  void serve() {
    int client = -1;
    std::string buf;
    for (;;) {
      pollfd p[3] = {{stop_[0], POLLIN, 0}, {listen_, POLLIN, 0}, {client, POLLIN, 0}};
      if (::poll(p, client >= 0 ? 3 : 2, -1) < 0) continue;
      if (p[0].revents) {
        char c = 0;
        (void)!::read(stop_[0], &c, 1);
        if (c == 'x') break;
        std::string out;
        {
          std::lock_guard<std::mutex> g(m_);
          out.swap(pushed_);
        }
        if (client >= 0) send_all(client, out);
        continue;
      }
      if (p[1].revents && client < 0) {
        client = ::accept(listen_, nullptr, nullptr);
        ++accepted_;
        buf.clear();
        if (!greeting_.empty()) send_all(client, greeting_);
        continue;
      }
      if (client >= 0 && p[2].revents) {
        char tmp[65536];
        const ssize_t n = ::read(client, tmp, sizeof tmp);
        if (n <= 0) {
          ::close(client);
          client = -1;
          continue;
        }
        buf.append(tmp, static_cast<std::size_t>(n));
        std::size_t nl;
        while (client >= 0 && (nl = buf.find('\n')) != std::string::npos) {
          const std::string line = buf.substr(0, nl);
          buf.erase(0, nl + 1);
          std::optional<json::Value> cmd = json::parse(line, json::kQmpLimits, nullptr);
          if (!cmd) {
            send_all(client,
                     "{\"error\": {\"class\": \"GenericError\", \"desc\": \"bad JSON\"}}\r\n");
            continue;
          }
          {
            std::lock_guard<std::mutex> g(m_);
            received_.push_back(*cmd);
          }
          const std::string out = command_name(*cmd) == "qmp_capabilities" && !handle_capabilities_
                                      ? reply(*cmd)
                                      : handler_(*cmd);
          if (out == kClose) {
            ::close(client);
            client = -1;
          } else {
            send_all(client, out);
          }
        }
      }
    }
    if (client >= 0) ::close(client);
  }

  std::function<std::string(const json::Value&)> handler_;
  std::string greeting_;
  bool handle_capabilities_ = false;
  std::string dir_, path_;
  int listen_ = -1;
  int stop_[2] = {-1, -1};
  std::thread thread_;
  std::mutex m_;
  std::vector<json::Value> received_;
  std::string pushed_;
  std::atomic<int> accepted_{0};
};

}  // namespace qcommit::plugin::test
