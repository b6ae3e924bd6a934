// SPDX-License-Identifier: GPL-2.0-or-later
// Control socket of qcommitd: UNIX stream socket, mode 0600, peers must have our uid (root).
// One JSON request per line, one JSON response per line:
//   {"cmd":"status"}  →  {"ok":true,"connected":...,"jobs":[...],"released":[...]}
//   {"cmd":"domain-event","domain":NAME,"event":EV}  →  {"ok":true}   (sent by the libvirt hook;
//       EV one of kHookEvents; the domain name is data: any bytes JSON can carry, ≤
//       kMaxDomainNameBytes)
//   malformed / unknown / oversized  →  {"ok":false,"error":"..."} (oversized: then closed)
// Requests are parsed within json::kControlRequestLimits (plugin/json.h).
// The server runs its own thread and never touches the governor: the daemon publishes a status
// snapshot (a JSON text) that the handler returns.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "plugin/govern/governor.h"
#include "plugin/host/json.h"

namespace qcommit::plugin {

// A request line is at most json::kControlMaxRequestBytes (plugin/json.h).
inline constexpr std::size_t kMaxControlClients = 16;

inline constexpr std::size_t kMaxDomainNameBytes = 1024;
// Events queued for the daemon loop between two steps; beyond that they are dropped (the poll
// finds everything anyway; the hook only makes it sooner).
inline constexpr std::size_t kMaxQueuedHookEvents = 256;
// Domain lifecycle events the libvirt hook forwards (operations of /etc/libvirt/hooks/qemu).
inline constexpr const char* kHookEvents[] = {"started", "stopped", "reconnect", "release"};

// Answers one request line (without the newline).  Pure apart from calling `on_domain_event`
// (which must only queue: it runs on the control thread).
using StatusSource = std::function<std::string()>;
using DomainEventSink = std::function<void(const std::string& domain, const std::string& event)>;
[[nodiscard]] std::string answer_request(const std::string& line, const StatusSource& status,
                                         const DomainEventSink& on_domain_event = {});

// JSON of a governor status (the "status" response, with "ok":true).
[[nodiscard]] std::string status_json(const GovernorStatus& st, TimePoint now);

class ControlServer {
 public:
  // Creates the socket's directory (0700) when missing, replaces a stale socket, binds, chmods
  // 0600 and listens.  Throws std::runtime_error naming the path.
  ControlServer(std::string path, StatusSource status, DomainEventSink on_domain_event = {});
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  void start();
  void stop();

 private:
  void run();

  std::string path_;
  StatusSource status_;
  DomainEventSink on_domain_event_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::atomic<bool> stopping_{false};
};

}  // namespace qcommit::plugin
