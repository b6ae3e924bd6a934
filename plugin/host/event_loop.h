// SPDX-License-Identifier: GPL-2.0-or-later
// The loop qcommitd and `qcommit live` run a Governor in: libvirt's default event loop, registered
// once per process, with a wake timer that bounds each wait so the governor's steps run on time
// without libvirt traffic; and the stop signals (SIGINT, SIGTERM) that end such a loop between
// two steps.
#pragma once

#include <chrono>
#include <stdexcept>

namespace qcommit::plugin {

// libvirt refused to register its event loop or to add the wake timer.
struct EventLoopError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class EventLoop {
 public:
  // Registers libvirt's default event loop (the first loop of the process only) and adds the wake
  // timer, due every `wait`.  Throws EventLoopError.
  explicit EventLoop(std::chrono::milliseconds wait);
  ~EventLoop();  // removes the wake timer
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Each wait from now on lasts at most `wait`: the wake timer's period, counted from now.
  void set_wait(std::chrono::milliseconds wait);
  // One pass of libvirt's loop: waits for an event or the wake timer, then dispatches what is
  // due.  false: the loop is broken.
  [[nodiscard]] bool run_once();
  // set_wait(wait), then run_once().
  [[nodiscard]] bool run_once(std::chrono::milliseconds wait);

  // Process-wide, also where the waiting is not libvirt's (`qcommit live --qmp`): SIGINT and
  // SIGTERM request the stop, SIGPIPE is ignored (a peer gone is an error the call reports).
  static void install_stop_signals();
  // Whether SIGINT or SIGTERM arrived since install_stop_signals().
  [[nodiscard]] static bool stop_requested();

 private:
  static constexpr int kNoTimer = -1;  // libvirt's timer ids are 0 and up
  int timer_ = kNoTimer;
};

}  // namespace qcommit::plugin
