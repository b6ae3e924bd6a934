// SPDX-License-Identifier: GPL-2.0-or-later
// The event loop of qcommitd and `qcommit live` (plugin/host/event_loop.h): its wake timer bounds
// each wait and goes with the loop; SIGINT and SIGTERM request the stop, SIGPIPE is ignored.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

#include "plugin/host/event_loop.h"

using qcommit::plugin::EventLoop;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

// Far longer than any wait a test expects to see end.
constexpr auto kLongWait = 10s;
// Passes of the loop a test times: libvirt's GLib loop may spend the first on its own idle work
// (the release of a replaced or removed timer).
constexpr int kPasses = 4;

// How long kPasses passes of the loop took.
[[nodiscard]] Clock::duration timed_passes(EventLoop& loop) {
  const auto start = Clock::now();
  for (int i = 0; i < kPasses; ++i) REQUIRE(loop.run_once());
  return Clock::now() - start;
}

// In a child: whether the stop is requested after `sig`, and only then; SIGPIPE ignored.
[[nodiscard]] int child_sees_stop_after(int sig) {
  EventLoop::install_stop_signals();
  if (EventLoop::stop_requested()) return 2;
  struct sigaction pipe_action {};
  sigaction(SIGPIPE, nullptr, &pipe_action);
  if (pipe_action.sa_handler != SIG_IGN) return 3;
  raise(sig);
  return EventLoop::stop_requested() ? 0 : 1;
}

// The exit code of child_sees_stop_after(sig) run in a child process.
[[nodiscard]] int stop_status_after(int sig) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(child_sees_stop_after(sig));
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("plugin.event_loop.wake_timer_bounds_each_wait") {
  EventLoop loop(5ms);
  CHECK(timed_passes(loop) < kLongWait / 2);
}

TEST_CASE("plugin.event_loop.set_wait_shortens_the_wait") {
  {
    EventLoop loop(kLongWait);
    loop.set_wait(5ms);
    CHECK(timed_passes(loop) < kLongWait / 2);
  }
  // A second loop of the process shares libvirt's, registered once; its own shortened wait
  // holds there too.  (That the first loop's timer went with it: timer_removed_with_the_loop.)
  EventLoop second(kLongWait);
  second.set_wait(5ms);
  CHECK(timed_passes(second) < kLongWait / 2);
}

TEST_CASE("plugin.event_loop.timer_removed_with_the_loop") {
  {
    EventLoop fast(1ms);
    REQUIRE(fast.run_once());
  }
  constexpr auto kSlowWait = 200ms;
  EventLoop slow(kSlowWait);
  // The removed 1 ms timer would end every pass within a few milliseconds.
  CHECK(timed_passes(slow) >= kSlowWait);
}

TEST_CASE("plugin.event_loop.stop_signals_request_the_stop") {
  CHECK(stop_status_after(SIGINT) == 0);
  CHECK(stop_status_after(SIGTERM) == 0);
}
