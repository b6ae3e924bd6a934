// Control socket of qcommitd: UNIX stream socket, mode 0600, peers must have our uid (root).
// One JSON request per line, one JSON response per line:
//   {"cmd":"status"}  →  {"ok":true,"connected":...,"jobs":[...],"released":[...]}
//   malformed / unknown / oversized  →  {"ok":false,"error":"..."} (oversized: then closed)
// The server runs its own thread and never touches the governor: the daemon publishes a status
// snapshot (a JSON text) that the handler returns.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "plugin/governor.h"
#include "plugin/json.h"

namespace qcommit::plugin {

inline constexpr std::size_t kMaxRequestBytes = 4096;
inline constexpr std::size_t kMaxControlClients = 16;

// Answers one request line (without the newline).  Pure.
using StatusSource = std::function<std::string()>;
[[nodiscard]] std::string answer_request(const std::string& line, const StatusSource& status);

// JSON of a governor status (the "status" response, with "ok":true).
[[nodiscard]] std::string status_json(const GovernorStatus& st, TimePoint now);

class ControlServer {
 public:
  // Creates the socket's directory (0700) when missing, replaces a stale socket, binds, chmods
  // 0600 and listens.  Throws std::runtime_error naming the path.
  ControlServer(std::string path, StatusSource status);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  void start();
  void stop();

 private:
  void run();

  std::string path_;
  StatusSource status_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

}  // namespace qcommit::plugin
