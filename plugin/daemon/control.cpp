// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/daemon/control.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace qcommit::plugin {

namespace {

std::string error_response(const std::string& msg) {
  return json::dump(json::Ordered{{"ok", false}, {"error", msg}});
}

const std::string kOk = json::dump(json::Ordered{{"ok", true}});

std::string domain_event(const json::Value& req, const DomainEventSink& sink) {
  const json::Value* dom = json::member(req, "domain");
  const json::Value* ev = json::member(req, "event");
  if (req.size() != 3 || !dom || !ev)
    return error_response("malformed request: domain-event takes exactly \"domain\" and \"event\"");
  const std::string& domain = json::string_member(req, "domain");
  const std::string& event = json::string_member(req, "event");
  if (domain.empty() || domain.size() > kMaxDomainNameBytes)
    return error_response("malformed request: \"domain\" must be a non-empty string of at most " +
                          std::to_string(kMaxDomainNameBytes) + " bytes");
  if (std::find(std::begin(kHookEvents), std::end(kHookEvents), std::string_view(event)) ==
      std::end(kHookEvents))
    return error_response("malformed request: unknown domain event");
  if (!sink) return error_response("domain events are not accepted here");
  sink(domain, event);
  return kOk;
}

double ms(Duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// A number, or null when absent.
json::Ordered number_or_null(const std::optional<double>& v) {
  return v ? json::Ordered(*v) : json::Ordered(nullptr);
}

json::Ordered ms_or_null(const std::optional<Duration>& d) {
  return d ? json::Ordered(ms(*d)) : json::Ordered(nullptr);
}

json::Ordered s_or_null(const std::optional<Duration>& d) {
  return d ? json::Ordered(std::chrono::duration<double>(*d).count()) : json::Ordered(nullptr);
}

json::Ordered job_json(const JobStatus& j) {
  return json::Ordered{{"domain", j.domain},
                       {"disk", j.disk},
                       {"id", j.id},
                       {"type", to_string(j.type)},
                       {"target", j.target},
                       {"storage", j.storage},
                       {"pool", j.pool},
                       {"budget_ms", ms(j.budget)},
                       {"speed_bytes_per_s", j.speed_bytes_per_s},
                       {"speed_wanted_bytes_per_s", j.speed_wanted_bytes_per_s},
                       {"time_to_govern_ms", ms_or_null(j.time_to_govern)},
                       {"found_by", to_string(j.found_by)},
                       {"scan_began_after_ms", ms_or_null(j.scan_began_after)},
                       {"job_listed_after_ms", ms_or_null(j.job_listed_after)},
                       {"speed_taken_after_ms", ms_or_null(j.speed_taken_after)},
                       {"copied_before_governed_bytes", j.copied_before_governed_bytes},
                       {"late_adoption", j.late_adoption},
                       {"window_bytes", j.window_bytes},
                       {"backlog_bytes", j.backlog_bytes},
                       {"delay_measured_ms", ms_or_null(j.delay_measured)},
                       {"delay_charged_ms", ms_or_null(j.delay_charged)},
                       {"own_queue_bytes", j.own_queue_bytes ? json::Value(*j.own_queue_bytes) : json::Value(nullptr)},
                       {"own_queue_rate_bytes_per_s", j.own_queue_rate_bytes_per_s},
                       {"latency_p99_ms", ms_or_null(j.latency_p99)},
                       {"bytes_left", j.bytes_left},
                       {"eta_s", number_or_null(j.eta_s)},
                       {"converging", j.converging ? json::Ordered(*j.converging) : json::Ordered(nullptr)},
                       {"added_bytes_per_s", j.added_bytes_per_s},
                       {"converge_floor_bytes_per_s", j.converge_floor_bytes_per_s},
                       {"phase", j.phase},
                       {"ready", j.ready},
                       {"settling", j.settling},
                       {"settles", j.settles},
                       {"settles_given_up", j.settles_given_up},
                       {"probe", to_string(j.probe)},
                       {"probe_off_reason", j.probe_off_reason},
                       {"probe_period_ms", ms_or_null(j.probe_period)},
                       {"probe_p99_ms", ms_or_null(j.probe_p99)},
                       {"probe_last_ms", ms_or_null(j.probe_last)},
                       {"policy_error", j.policy_error},
                       {"target_throttle", j.target_throttle},
                       {"escaped", j.escaped},
                       {"escaped_bytes", j.escaped_bytes},
                       {"escape_cost_s", s_or_null(j.escape_cost)},
                       {"escape_held", j.escape_held},
                       {"bdi_limit", j.bdi_limit},
                       {"floor", j.floor}};
}

json::Ordered released_json(const ReleasedJob& r, TimePoint now) {
  return json::Ordered{{"domain", r.domain},
                       {"disk", r.disk},
                       {"id", r.id},
                       {"type", to_string(r.type)},
                       {"state", end_state(r)},
                       {"reason", r.reason},
                       {"age_s", std::chrono::duration<double>(now - r.at).count()}};
}

}  // namespace

std::string answer_request(const std::string& line, const StatusSource& status,
                           const DomainEventSink& on_domain_event) {
  if (line.size() > json::kControlMaxRequestBytes) return error_response("request too large");
  std::string err;
  std::optional<json::Value> req = json::parse(line, json::kControlRequestLimits, &err);
  if (!req) return error_response("malformed request: " + err);
  if (!req->is_object()) return error_response("malformed request: expected a JSON object");
  const json::Value* cmd = json::member(*req, "cmd");
  if (!cmd || !cmd->is_string()) return error_response("malformed request: missing \"cmd\" string");
  const std::string& name = cmd->get_ref<const std::string&>();
  if (name == "domain-event") return domain_event(*req, on_domain_event);
  if (req->size() != 1) return error_response("malformed request: unknown members");
  if (name == "status") return status();
  if (name == "ping") return kOk;
  return error_response("unknown command " + json::dump(*cmd));
}

std::string status_json(const GovernorStatus& st, TimePoint now) {
  json::Ordered jobs = json::Ordered::array();
  for (const auto& j : st.jobs) jobs.push_back(job_json(j));
  json::Ordered released = json::Ordered::array();
  for (const auto& r : st.released) released.push_back(released_json(r, now));
  return json::dump(json::Ordered{
      {"ok", true}, {"connected", st.connected}, {"jobs", jobs}, {"released", released}});
}

ControlServer::ControlServer(std::string path, StatusSource status, DomainEventSink on_domain_event)
    : path_(std::move(path)),
      status_(std::move(status)),
      on_domain_event_(std::move(on_domain_event)) {
  sockaddr_un addr{};
  if (path_.empty() || path_.size() >= sizeof addr.sun_path)
    throw std::runtime_error(path_ + ": socket path empty or too long");
  const auto slash = path_.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    const std::string dir = path_.substr(0, slash);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      throw std::runtime_error(dir + ": cannot create directory: " + std::strerror(errno));
    // Where the socket goes must be ours: not a symlink to elsewhere, not a directory another
    // user could swap the socket in.
    struct stat ds {};
    if (::lstat(dir.c_str(), &ds) != 0 || !S_ISDIR(ds.st_mode))
      throw std::runtime_error(dir + ": not a directory (a symlink?); refusing to put the socket there");
    if (ds.st_uid != ::geteuid() && ds.st_uid != 0)
      throw std::runtime_error(dir + ": belongs to another user; refusing to put the socket there");
  }
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw std::runtime_error(path_ + ": socket: " + std::strerror(errno));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
  // A stale socket from a crashed daemon: replace it only if nobody answers on it.
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      ::close(listen_fd_);
      throw std::runtime_error(path_ + ": exists and is not a socket");
    }
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool alive =
        probe >= 0 && ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    if (probe >= 0) ::close(probe);
    if (alive) {
      ::close(listen_fd_);
      throw std::runtime_error(path_ + ": another qcommitd is listening");
    }
    ::unlink(path_.c_str());
  }
  const mode_t old = ::umask(0177);
  const int rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old);
  // The umask made it 0600 at bind(); no chmod by name, which would follow a symlink put there.
  if (rc != 0 || ::listen(listen_fd_, 16) != 0) {
    const std::string e = std::strerror(errno);
    ::close(listen_fd_);
    throw std::runtime_error(path_ + ": cannot listen: " + e);
  }
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw std::runtime_error(path_ + ": pipe: " + std::strerror(errno));
  }
}

ControlServer::~ControlServer() {
  stop();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

void ControlServer::start() {
  thread_ = std::thread([this] { run(); });
}

void ControlServer::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  const char c = 1;
  // A full pipe has a wake-up in it already: nothing to do when this write fails.
  if (::write(wake_[1], &c, 1) < 0) {
  }
  thread_.join();
}

namespace {

struct Client {
  int fd;
  std::string buf;
};

// Blocking-with-timeout write of a whole response line.
void send_line(int fd, const std::string& s) {
  std::string line = s + "\n";
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = ::send(fd, line.data() + off, line.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 1000) <= 0) return;  // slow reader: give up on it
      continue;
    }
    return;
  }
}

}  // namespace

void ControlServer::run() {
  std::vector<Client> clients;
  while (!stopping_) {
    std::vector<pollfd> fds;
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& c : clients) fds.push_back({c.fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) break;
    std::vector<int> drop;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Client& c = clients[i - 2];
      char buf[1024];
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        drop.push_back(c.fd);
        continue;
      }
      c.buf.append(buf, static_cast<size_t>(n));
      size_t nl;
      bool closed = false;
      while ((nl = c.buf.find('\n')) != std::string::npos) {
        std::string line = c.buf.substr(0, nl);
        c.buf.erase(0, nl + 1);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        send_line(c.fd, answer_request(line, status_, on_domain_event_));
      }
      if (c.buf.size() > json::kControlMaxRequestBytes) {
        send_line(c.fd, error_response("request too large (limit " +
                                       std::to_string(json::kControlMaxRequestBytes) + " bytes)"));
        drop.push_back(c.fd);
        closed = true;
      }
      (void)closed;
    }
    for (int fd : drop) {
      ::close(fd);
      std::erase_if(clients, [fd](const Client& c) { return c.fd == fd; });
    }
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        ucred cred{};
        socklen_t len = sizeof cred;
        const bool ok =
            ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == ::geteuid();
        if (!ok) {
          send_line(fd, error_response("permission denied"));
          ::close(fd);
        } else if (clients.size() >= kMaxControlClients) {
          send_line(fd, error_response("too many clients"));
          ::close(fd);
        } else {
          clients.push_back(Client{fd, {}});
        }
      }
    }
  }
  for (auto& c : clients) ::close(c.fd);
}

}  // namespace qcommit::plugin
