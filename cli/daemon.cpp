// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/daemon.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cli/options.h"
#include "plugin/host/json.h"
#include "qcow2/unique_fd.h"

namespace qcommit::cli {
namespace {

// How long a response may take to arrive (qcommitd answers from a snapshot at once).
constexpr int kResponseTimeoutMs = 5000;

// A connected stream socket to `path`; invalid with `error` set.
UniqueFd connect_to(const std::string& path, std::string& error) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) throw UsageError(path + ": socket path too long");
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    error = std::string("socket: ") + std::strerror(errno);
    return fd;
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    error = path + ": cannot connect to qcommitd: " + std::strerror(errno);
    fd.reset();
  }
  return fd;
}

}  // namespace

bool qcommitd_answers(const std::string& path) {
  std::string error;
  try {
    return connect_to(path, error).valid();
  } catch (const UsageError&) {
    return false;
  }
}

std::optional<std::string> ask_qcommitd(const std::string& socket_path, const std::string& request,
                                        std::string& error) {
  UniqueFd fd = connect_to(socket_path, error);
  if (!fd.valid()) return std::nullopt;
  const std::string req = request + "\n";
  if (::send(fd.get(), req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    error = socket_path + ": send failed";
    return std::nullopt;
  }
  std::string line;
  char buf[4096];
  while (line.find('\n') == std::string::npos && line.size() <= json::kControlMaxResponseBytes) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, kResponseTimeoutMs) <= 0) break;
    const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  if (auto nl = line.find('\n'); nl != std::string::npos) line.resize(nl);
  return line;
}

}  // namespace qcommit::cli
