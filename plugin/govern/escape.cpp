// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/escape.h"

#include <algorithm>
#include <cstdio>

#include "common/units.h"

namespace qcommit::plugin {

namespace {

using units::mib_text;

std::string seconds(std::optional<throttle::Duration> t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", t ? std::chrono::duration<double>(*t).count() : 0.0);
  return buf;
}

}  // namespace

std::uint64_t escape_threshold(std::uint64_t window_bytes) {
  return std::max(kEscapeWindowFactor * window_bytes, kEscapeFloorBytes);
}

std::optional<throttle::Duration> EscapeState::cost() const {
  if (!escaped || drain_bytes_per_s <= 0) return std::nullopt;
  return std::chrono::duration_cast<throttle::Duration>(
      std::chrono::duration<double>(static_cast<double>(peak_bytes) / drain_bytes_per_s));
}

EscapeNews observe_escape(EscapeState& st, std::uint64_t target_bytes, std::uint64_t window_bytes,
                          double drain_bytes_per_s, throttle::TimePoint now) {
  if (!st.escaped) {
    if (target_bytes <= escape_threshold(window_bytes)) return EscapeNews::kNone;
    st.escaped = true;
    st.peak_bytes = target_bytes;
    st.drain_bytes_per_s = drain_bytes_per_s;
    st.hold_since = now;
    return EscapeNews::kEscaped;
  }
  st.peak_bytes = std::max(st.peak_bytes, target_bytes);
  if (drain_bytes_per_s > 0) st.drain_bytes_per_s = drain_bytes_per_s;  // measured while draining
  if (!st.hold_since || target_bytes > window_bytes) return EscapeNews::kNone;
  st.held_for = now - *st.hold_since;
  st.hold_since.reset();
  return EscapeNews::kBackWithinWindow;
}

std::string escape_line(EscapeNews news, const EscapeState& st, const std::string& target,
                        std::uint64_t window_bytes, const std::string& bdi_limit) {
  const std::string cost =
      "about " + seconds(st.cost()) + " of storage at " + mib_text(st.drain_bytes_per_s) + "/s";
  const std::string limit = bdi_limit.empty() ? "" : "; kernel dirty limit " + bdi_limit;
  if (news == EscapeNews::kBackWithinWindow)
    return "escaped job back within its window after " + seconds(st.held_for) +
           " at the minimum speed; peak " + mib_text(static_cast<double>(st.peak_bytes)) + ", " +
           cost + limit;
  return "escaped governance: " + mib_text(static_cast<double>(st.peak_bytes)) + " of " + target +
         " dirty or under writeback (more than the " +
         mib_text(static_cast<double>(escape_threshold(window_bytes))) +
         " a governed job ever has), " + cost +
         "; held at the minimum speed until it is written out to its window" + limit;
}

}  // namespace qcommit::plugin
