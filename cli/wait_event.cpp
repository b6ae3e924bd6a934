// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/wait_event.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace qcommit::cli {

json::Ordered wait_event(const engine::WaitNotice& n) {
  using engine::WaitFor;
  json::Ordered j{{"event", "wait"}, {"for", engine::wait_for_name(n.what)}, {"message", n.message}};
  if (n.timeout)
    j["timeout-s"] = quantity(rounded(std::chrono::duration<double>(*n.timeout).count(), 3));
  switch (n.what) {
    case WaitFor::kLock:
    case WaitFor::kClose:
    case WaitFor::kDeviceNode:
      j["path"] = n.path;
      break;
    case WaitFor::kDomainShutdown:
    case WaitFor::kBlockJob:
      j["domain"] = n.domain;
      break;
    case WaitFor::kConnection:
      if (!n.uri.empty()) j["uri"] = n.uri;
      if (!n.qmp.empty()) j["qmp"] = n.qmp;
      break;
  }
  if (n.what == WaitFor::kLock || n.what == WaitFor::kClose) {
    json::Ordered holders = json::Ordered::array();
    for (const auto& h : n.holders)
      holders.push_back(json::Ordered{{"pid", std::int64_t(h.pid)}, {"command", h.name}});
    j["holders"] = std::move(holders);
  }
  if (n.what == WaitFor::kLock) j["conflict"] = n.conflict;
  if (n.what == WaitFor::kBlockJob) {
    j["disk"] = n.disk;
    j["job"] = n.job;
    if (n.percent) j["percent"] = rounded(*n.percent, 1);
  }
  return j;
}

void show_wait(const engine::WaitNotice& n, bool json_out, std::string_view prefix) {
  if (json_out) {
    print_json(wait_event(n));
  } else {
    std::fprintf(stderr, "%.*s: %s\n", int(prefix.size()), prefix.data(), n.message.c_str());
    std::fflush(stderr);
  }
}

}  // namespace qcommit::cli
