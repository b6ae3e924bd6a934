// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/hypervisor/qmp_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

namespace qcommit::plugin {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxReadsPerTake = 64;
constexpr std::int64_t kMicrosPerSecond = 1000000;
// The largest seconds field whose timestamp, microseconds included, fits in int64_t microseconds.
constexpr std::int64_t kMaxTimestampSeconds =
    (std::numeric_limits<std::int64_t>::max() - (kMicrosPerSecond - 1)) / kMicrosPerSecond;

// An event's {"seconds", "microseconds"} in microseconds, or 0 (no timestamp) unless both are
// integers with 0 <= seconds <= kMaxTimestampSeconds and 0 <= microseconds < 1 s, as QEMU sends
// them: a monitor that sends anything else gets no timestamp rather than an overflowed one.
std::int64_t event_timestamp_us(const json::Value& ts) {
  const json::Value* s = json::member(ts, "seconds");
  const json::Value* us = json::member(ts, "microseconds");
  if (!s || !us) return 0;
  const std::optional<std::int64_t> sec = json::to_int64(*s), micro = json::to_int64(*us);
  if (!sec.has_value() || !micro.has_value()) return 0;
  const std::int64_t seconds = sec.value(), micros = micro.value();
  if (seconds < 0 || seconds > kMaxTimestampSeconds || micros < 0 || micros >= kMicrosPerSecond)
    return 0;
  return seconds * kMicrosPerSecond + micros;
}

std::string seconds_text(std::chrono::milliseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", static_cast<double>(d.count()) / 1000.0);
  return buf;
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > 1000000 ? 1000000 : static_cast<int>(left.count());
}

// {"arguments": ARGS, "execute": COMMAND, "id": ID}; no arguments unless ARGS is an object.
json::Value command_message(std::string_view command, const json::Value& arguments,
                            const std::string& id) {
  json::Value msg = json::Value::object();
  msg["execute"] = command;
  if (arguments.is_object()) msg["arguments"] = arguments;
  msg["id"] = id;
  return msg;
}

void set_nonblocking(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) (void)::fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

}  // namespace

QmpCommandError QmpClient::command_error(std::string_view command, const json::Value& error) const {
  std::string cls = json::string_member(error, "class");
  std::string desc = json::string_member(error, "desc");
  if (cls.empty()) cls = "Error";
  if (desc.empty()) desc = "(no description)";
  return QmpCommandError(label_ + ": " + std::string(command) + ": " + desc + " (" + cls + ")", cls,
                         desc);
}

std::optional<std::string> QmpOptions::validate() const {
  if (greeting_timeout.count() <= 0 || command_timeout.count() <= 0)
    return "qmp: greeting and command timeouts must be > 0";
  if (max_message_bytes < 4096) return "qmp: max_message_bytes must be >= 4096";
  if (max_message_values < 16) return "qmp: max_message_values must be >= 16";
  if (max_queued_events == 0) return "qmp: max_queued_events must be >= 1";
  return std::nullopt;
}

// --- framing ---------------------------------------------------------------------------------

bool QmpFramer::feed(std::string_view bytes, std::string* error) {
  buf_.append(bytes);
  while (scan_pos_ < buf_.size()) {
    const char c = buf_[scan_pos_];
    if (depth_ == 0) {
      if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
        scan_start_ = ++scan_pos_;
        continue;
      }
      if (c != '{') {
        char what[64];
        const auto u = static_cast<unsigned char>(c);
        if (u >= 0x20 && u < 0x7f)
          std::snprintf(what, sizeof what, "'%c'", c);
        else
          std::snprintf(what, sizeof what, "byte 0x%02x", u);
        if (error) *error = std::string("expected a JSON object, got ") + what;
        return false;
      }
      scan_start_ = scan_pos_;
      depth_ = 1;
      ++scan_pos_;
      continue;
    }
    if (++scan_pos_ - scan_start_ > max_) {
      if (error) *error = "message larger than " + std::to_string(max_) + " bytes";
      return false;
    }
    if (in_string_) {
      if (escape_)
        escape_ = false;
      else if (c == '\\')
        escape_ = true;
      else if (c == '"')
        in_string_ = false;
      continue;
    }
    if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if (c == '}' || c == ']') {
      if (--depth_ == 0) {
        ready_.emplace_back(buf_, scan_start_, scan_pos_ - scan_start_);
        scan_start_ = scan_pos_;
      }
    }
  }
  // Drop what was consumed once it is a good part of the buffer.
  if (scan_start_ > 0 && scan_start_ * 2 >= buf_.size()) {
    buf_.erase(0, scan_start_);
    scan_pos_ -= scan_start_;
    scan_start_ = 0;
  }
  return true;
}

std::optional<std::string> QmpFramer::next() {
  if (ready_.empty()) return std::nullopt;
  std::string m = std::move(ready_.front());
  ready_.pop_front();
  return m;
}

// --- client ----------------------------------------------------------------------------------

QmpClient QmpClient::connect(const std::string& path, QmpOptions opt) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    throw QmpError(path + ": not a usable UNIX socket path (empty or longer than " +
                   std::to_string(sizeof addr.sun_path - 1) + " bytes)");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) throw QmpError(path + ": socket: " + std::strerror(errno));
  int rc;
  do {
    rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    if (errno == EAGAIN)
      throw QmpError(path +
                     ": cannot connect: the monitor's connection queue is full (another "
                     "client holds the QMP monitor)");
    throw QmpError(path + ": cannot connect: " + std::strerror(errno));
  }
  return QmpClient(std::move(fd), path, opt);
}

QmpClient::QmpClient(UniqueFd fd, std::string label, QmpOptions opt)
    : fd_(std::move(fd)), label_(std::move(label)), opt_(opt), framer_(opt.max_message_bytes) {
  if (auto e = opt_.validate()) throw QmpError(label_ + ": " + *e);
  if (!fd_.valid()) throw QmpError(label_ + ": no connection");
  set_nonblocking(fd_.get());
  const Clock::time_point deadline = Clock::now() + opt_.greeting_timeout;
  std::optional<json::Value> msg;
  try {
    while (!(msg = next_message())) {
      if (!read_some(deadline))
        fail("no QMP greeting within " + seconds_text(opt_.greeting_timeout) +
             " (not a QMP monitor, or another client holds it)");
    }
  } catch (const QmpError& e) {
    // Anything wrong before the greeting means this is not a QMP monitor.
    const std::string prefix = label_ + ": ";
    std::string what = e.what();
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    if (what.rfind("no QMP greeting", 0) == 0) throw;
    throw QmpError(prefix + "not a QMP monitor: " + what);
  }
  const json::Value* qmp = json::member(*msg, "QMP");
  if (!qmp || !qmp->is_object()) {
    fd_.reset();
    throw QmpError(label_ + ": not a QMP monitor: its first message has no \"QMP\" greeting");
  }
  greeting_ = *msg;
  try {
    (void)execute("qmp_capabilities");
  } catch (const QmpCommandError& e) {
    fd_.reset();
    throw QmpError(label_ + ": capability negotiation refused: " + e.description);
  }
}

void QmpClient::fail(const std::string& what) {
  fd_.reset();
  throw QmpError(label_ + ": " + what);
}

bool QmpClient::read_some(Clock::time_point deadline) {
  if (!fd_.valid()) throw QmpError(label_ + ": connection closed");
  for (;;) {
    pollfd p{fd_.get(), POLLIN, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc < 0) {
      if (errno == EINTR) continue;
      fail(std::string("poll: ") + std::strerror(errno));
    }
    if (rc == 0) return false;
    char buf[kQmpReadChunkBytes];
    const ssize_t n = ::read(fd_.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      fail(std::string("read: ") + std::strerror(errno));
    }
    if (n == 0) fail("connection closed by the peer (QEMU quit?)");
    std::string err;
    if (!framer_.feed(std::string_view(buf, static_cast<std::size_t>(n)), &err))
      fail("protocol error: " + err);
    return true;
  }
}

json::Limits QmpClient::limits() const {
  return json::Limits{opt_.max_message_bytes, opt_.max_message_values, json::kMaxNestingLevels};
}

std::optional<json::Value> QmpClient::next_message() {
  std::optional<std::string> text = framer_.next();
  if (!text) return std::nullopt;
  std::string err;
  std::optional<json::Value> v = json::parse(*text, limits(), &err);
  if (!v) fail("protocol error: invalid JSON: " + err);
  return v;
}

void QmpClient::queue_event(const json::Value& msg) {
  QmpEvent e;
  const json::Value* name = json::member(msg, "event");
  if (!name || !name->is_string()) fail("protocol error: event without a name");
  e.name = name->get<std::string>();
  if (const json::Value* d = json::member(msg, "data")) e.data = *d;
  if (const json::Value* ts = json::member(msg, "timestamp"))
    e.timestamp_us = event_timestamp_us(*ts);
  events_.push_back(std::move(e));
  while (events_.size() > opt_.max_queued_events) {
    events_.pop_front();
    ++dropped_events_;
  }
}

void QmpClient::send_line(const std::string& text) {
  const Clock::time_point deadline = Clock::now() + opt_.command_timeout;
  std::size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::send(fd_.get(), text.data() + off, text.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_.get(), POLLOUT, 0};
      if (::poll(&p, 1, remaining_ms(deadline)) == 0)
        fail("cannot send a command within " + seconds_text(opt_.command_timeout));
      continue;
    }
    if (n < 0 && errno == EPIPE) fail("connection closed by the peer (QEMU quit?)");
    fail(std::string("send: ") + std::strerror(errno));
  }
}

json::Value QmpClient::execute(std::string_view command, const json::Value& arguments) {
  if (!fd_.valid()) throw QmpError(label_ + ": connection closed");
  const std::string id = "qcommit-" + std::to_string(next_id_++);
  send_line(json::dump(command_message(command, arguments, id)) + "\n");
  const Clock::time_point deadline = Clock::now() + opt_.command_timeout;
  for (;;) {
    std::optional<json::Value> msg = next_message();
    if (!msg) {
      if (!read_some(deadline))
        fail("no reply to " + std::string(command) + " within " +
             seconds_text(opt_.command_timeout));
      continue;
    }
    if (!msg->is_object()) fail("protocol error: a message is not a JSON object");
    if (msg->contains("event")) {
      queue_event(*msg);
      continue;
    }
    const json::Value* ret = json::member(*msg, "return");
    const json::Value* err = json::member(*msg, "error");
    if (!ret && !err) fail("protocol error: a message is neither a reply nor an event");
    const json::Value* mid = json::member(*msg, "id");
    // A reply carrying another id answers a command that timed out earlier: skip it.  One
    // without an id answers a request QEMU could not parse: ours.
    if (mid && *mid != id) continue;
    if (ret) return *ret;
    throw command_error(command, *err);
  }
}

std::optional<pid_t> QmpClient::peer_pid() const {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (!fd_.valid() || ::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      cred.pid <= 0)
    return std::nullopt;
  return cred.pid;
}

std::deque<QmpEvent> QmpClient::take_queued_events() {
  std::deque<QmpEvent> out;
  out.swap(events_);
  return out;
}

std::deque<QmpEvent> QmpClient::take_events(std::chrono::milliseconds wait) {
  if (!fd_.valid()) throw QmpError(label_ + ": connection closed");
  const Clock::time_point deadline = Clock::now() + wait;
  auto drain = [this] {
    while (std::optional<json::Value> msg = next_message()) {
      if (!msg->is_object()) fail("protocol error: a message is not a JSON object");
      if (msg->contains("event")) queue_event(*msg);
      // Replies outside execute() are late answers to timed-out commands: dropped.
    }
  };
  drain();  // messages that arrived behind the last reply
  // Wait once (unless events are already queued), then take what is readable without waiting,
  // for a bounded number of reads (a stream of events must not keep us here).
  for (int reads = 0; reads < kMaxReadsPerTake &&
                      read_some(reads == 0 && events_.empty() ? deadline : Clock::now());
       ++reads)
    drain();
  return take_queued_events();
}

}  // namespace qcommit::plugin
