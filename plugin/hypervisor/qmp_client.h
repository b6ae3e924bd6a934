// SPDX-License-Identifier: GPL-2.0-or-later
// A small QMP client (QEMU Machine Protocol, QEMU's docs/interop/qmp-spec) over a UNIX stream
// socket: reads the greeting, negotiates capabilities, runs commands one at a time with id
// matching and queues the asynchronous events that arrive in between.  Transport only: no
// policy, no knowledge of block jobs (plugin/qmp_hypervisor.h maps QMP to the Hypervisor).
//
// Framing does not rely on newlines: a message is one complete JSON object (QEMU's `pretty=on`
// monitors spread one over many lines), bounded by QmpOptions::max_message_bytes, and parsed
// within the caps of plugin/json.h (nesting, values); integers are exact to 64 bits.
//
// Errors: QmpError is a transport or protocol failure (no greeting, not QMP, garbage, oversized,
// timeout, connection closed); the connection is closed and unusable afterwards.  QmpCommandError
// is QEMU's {"error": {...}} answer to a command; the connection stays usable.  Both messages
// start with the socket's label (its path).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "plugin/host/json.h"
#include "qcow2/unique_fd.h"

namespace qcommit::plugin {

struct QmpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct QmpCommandError : std::runtime_error {
  QmpCommandError(const std::string& what, std::string cls, std::string desc)
      : std::runtime_error(what), error_class(std::move(cls)), description(std::move(desc)) {}
  std::string error_class;  // "GenericError", "DeviceNotFound", "DeviceNotActive", ...
  std::string description;
};

inline constexpr std::size_t kQmpMaxQueuedEvents = 1024;
inline constexpr std::size_t kQmpReadChunkBytes = 64 * 1024;

struct QmpOptions {
  // QEMU serves one client per monitor socket: while another client holds it, the connection is
  // accepted by the kernel but no greeting comes.
  std::chrono::milliseconds greeting_timeout{5000};
  std::chrono::milliseconds command_timeout{30000};
  std::size_t max_message_bytes = json::kQmpMaxMessageBytes;
  std::size_t max_message_values = json::kQmpMaxMessageValues;
  std::size_t max_queued_events = kQmpMaxQueuedEvents;  // oldest dropped beyond this
  [[nodiscard]] std::optional<std::string> validate() const;
};

struct QmpEvent {
  std::string name;               // "JOB_STATUS_CHANGE", "BLOCK_JOB_READY", ...
  json::Value data;               // the "data" member (null when absent)
  std::int64_t timestamp_us = 0;  // QEMU's timestamp (host realtime), 0 when absent
};

// Splits a byte stream into complete top-level JSON objects.  Pure (no I/O), exposed for tests.
class QmpFramer {
 public:
  explicit QmpFramer(std::size_t max_message_bytes) : max_(max_message_bytes) {}
  // Appends bytes.  false (and *error set to one line) when the stream is not a sequence of JSON
  // objects or a message grows beyond the limit; the framer is unusable afterwards.
  [[nodiscard]] bool feed(std::string_view bytes, std::string* error);
  // Next complete message text, if any.
  [[nodiscard]] std::optional<std::string> next();
  [[nodiscard]] std::size_t buffered() const { return buf_.size() - scan_start_; }

 private:
  std::string buf_;
  std::size_t scan_start_ = 0;  // start of the current (incomplete) message in buf_
  std::size_t scan_pos_ = 0;    // next byte to scan
  int depth_ = 0;
  bool in_string_ = false;
  bool escape_ = false;
  std::deque<std::string> ready_;
  std::size_t max_;
};

class QmpClient {
 public:
  // Connects to the socket at `path`, reads the greeting and leaves capability negotiation mode
  // (qmp_capabilities).  Throws QmpError naming the path.
  [[nodiscard]] static QmpClient connect(const std::string& path, QmpOptions opt = {});
  // Takes a connected stream socket (tests: one end of a socketpair) and does the same handshake.
  QmpClient(UniqueFd fd, std::string label, QmpOptions opt = {});

  QmpClient(QmpClient&&) noexcept = default;
  QmpClient& operator=(QmpClient&&) noexcept = default;

  // Runs one command and returns its "return" value.  `arguments` must be an object or null.
  [[nodiscard]] json::Value execute(std::string_view command,
                                    const json::Value& arguments = json::Value());
  // Waits up to `wait` for input (0: only what is readable now) and returns the queued events,
  // oldest first.  Throws QmpError when the connection fails.
  [[nodiscard]] std::deque<QmpEvent> take_events(std::chrono::milliseconds wait);
  // Events queued so far without reading the socket.
  [[nodiscard]] std::deque<QmpEvent> take_queued_events();

  [[nodiscard]] bool is_open() const { return fd_.valid(); }
  void close() { fd_.reset(); }
  [[nodiscard]] const std::string& label() const { return label_; }
  [[nodiscard]] const json::Value& greeting() const { return greeting_; }
  [[nodiscard]] std::size_t dropped_events() const { return dropped_events_; }
  // The process on the other end of the socket (SO_PEERCRED): QEMU, unless a proxy relays the
  // monitor; nullopt when the kernel does not say (closed, or a process outside this PID
  // namespace).
  [[nodiscard]] std::optional<pid_t> peer_pid() const;

 private:
  [[noreturn]] void fail(const std::string& what);
  // Reads what arrives within `timeout` (steady clock) into the framer; false on timeout.
  [[nodiscard]] bool read_some(std::chrono::steady_clock::time_point deadline);
  [[nodiscard]] std::optional<json::Value> next_message();
  [[nodiscard]] json::Limits limits() const;
  // QEMU's {"error": {"class", "desc"}} of `command` as the exception to throw.
  [[nodiscard]] QmpCommandError command_error(std::string_view command,
                                              const json::Value& error) const;
  void queue_event(const json::Value& msg);
  void send_line(const std::string& text);

  UniqueFd fd_;
  std::string label_;
  QmpOptions opt_;
  QmpFramer framer_;
  json::Value greeting_;
  std::deque<QmpEvent> events_;
  std::size_t dropped_events_ = 0;
  std::uint64_t next_id_ = 1;
};

}  // namespace qcommit::plugin
