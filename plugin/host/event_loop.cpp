// SPDX-License-Identifier: GPL-2.0-or-later
// libvirt's default event loop with its wake timer, and the stop signals, for qcommitd and
// `qcommit live` (plugin/host/event_loop.h).
#include "plugin/host/event_loop.h"

#include <libvirt/libvirt.h>
#include <signal.h>

#include <atomic>
#include <mutex>

namespace qcommit::plugin {
namespace {

std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "set from a signal handler");

void on_stop_signal(int) {
  g_stop_requested = true;
}

// The timer only ends the wait; the loop's caller runs what is due.
void on_wake(int, void*) {}

// libvirt's default loop once per process; a failed registration is tried again by the next loop.
void register_default_loop() {
  static std::once_flag registered;
  std::call_once(registered, [] {
    if (virEventRegisterDefaultImpl() < 0)
      throw EventLoopError("cannot register the libvirt event loop");
  });
}

[[nodiscard]] int libvirt_ms(std::chrono::milliseconds wait) {
  return static_cast<int>(wait.count());
}

[[nodiscard]] int add_wake_timer(std::chrono::milliseconds wait) {
  const int timer = virEventAddTimeout(libvirt_ms(wait), on_wake, nullptr, nullptr);
  if (timer < 0) throw EventLoopError("cannot add the event loop timer");
  return timer;
}

}  // namespace

EventLoop::EventLoop(std::chrono::milliseconds wait) {
  register_default_loop();
  timer_ = add_wake_timer(wait);
}

EventLoop::~EventLoop() {
  if (timer_ != kNoTimer) (void)virEventRemoveTimeout(timer_);
}

void EventLoop::set_wait(std::chrono::milliseconds wait) {
  virEventUpdateTimeout(timer_, libvirt_ms(wait));
}

bool EventLoop::run_once() {
  return virEventRunDefaultImpl() >= 0;
}

bool EventLoop::run_once(std::chrono::milliseconds wait) {
  set_wait(wait);
  return run_once();
}

void EventLoop::install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

bool EventLoop::stop_requested() {
  return g_stop_requested;
}

}  // namespace qcommit::plugin
