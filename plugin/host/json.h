// SPDX-License-Identifier: GPL-2.0-or-later
// JSON for everything qcommit reads and writes (QMP, the control socket, the CLI's
// --output=json): nlohmann-json, plus the caps that JSON from outside the process is parsed
// within, and the two layouts qcommit prints.
//
// Numbers: integers are exact over the whole 64-bit range (a QMP counter past 2^53 such as
// wr_total_time_ns reads as it was sent).  Strings: parsing refuses invalid UTF-8; dumping
// replaces it with U+FFFD, so what qcommit prints is always valid JSON.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace qcommit::json {

// What is parsed: objects keyed by a std::map (sorted, logarithmic lookup, so an object with
// many members cannot make parsing quadratic).
using Value = nlohmann::json;
// What qcommit writes: members in the order they are added.
using Ordered = nlohmann::ordered_json;

// --- caps on JSON read from outside the process -----------------------------------------------

// Arrays and objects nested in each other, the outermost counting as level 1.
inline constexpr std::size_t kMaxNestingLevels = 32;
// One QMP message (a query-block answer of a big VM is ~100 KiB).
inline constexpr std::size_t kQmpMaxMessageBytes = std::size_t{4} << 20;
// Values (numbers, strings, arrays, ...) in one QMP message: each costs far more memory than the
// 2 bytes of input ("0,") it may take, so the size alone does not bound the memory.
inline constexpr std::size_t kQmpMaxMessageValues = std::size_t{1} << 18;
// One request line a client sends to qcommitd's control socket.
inline constexpr std::size_t kControlMaxRequestBytes = 4096;
inline constexpr std::size_t kControlMaxRequestValues = 256;
// One response line of qcommitd (`qcommit status` reads it).
inline constexpr std::size_t kControlMaxResponseBytes = std::size_t{16} << 20;
inline constexpr std::size_t kControlMaxResponseValues = std::size_t{1} << 20;
// The --output=json document of a qcommit child process (`qcommit demo` runs info, map, merge).
inline constexpr std::size_t kChildMaxOutputBytes = std::size_t{16} << 20;
inline constexpr std::size_t kChildMaxOutputValues = std::size_t{1} << 20;

struct Limits {
  std::size_t max_bytes = 0;
  std::size_t max_values = 0;
  std::size_t max_levels = kMaxNestingLevels;
};

inline constexpr Limits kQmpLimits{kQmpMaxMessageBytes, kQmpMaxMessageValues};
inline constexpr Limits kControlRequestLimits{kControlMaxRequestBytes, kControlMaxRequestValues};
inline constexpr Limits kControlResponseLimits{kControlMaxResponseBytes, kControlMaxResponseValues};
inline constexpr Limits kChildOutputLimits{kChildMaxOutputBytes, kChildMaxOutputValues};

// --- parsing ----------------------------------------------------------------------------------

namespace detail {

// Thrown by the parser callback to stop a parse that goes beyond the limits.
struct LimitExceeded {
  std::string what;
};

// Follows a parse event by event (nlohmann's parser callback): nesting, values, member names.
class LimitCheck {
 public:
  explicit LimitCheck(const Limits& limits) : limits_(limits) {}

  template <class Json>
  bool operator()(int depth, Value::parse_event_t event, const Json& parsed) {
    using Event = Value::parse_event_t;
    switch (event) {
      case Event::object_start:
        open(depth);
        names_.emplace_back();
        break;
      case Event::array_start:
        open(depth);
        break;
      case Event::object_end:
        names_.pop_back();
        break;
      case Event::key:
        add_name(parsed.template get_ref<const std::string&>());
        break;
      case Event::value:
        count_value();
        break;
      case Event::array_end:
        break;
    }
    return true;  // keep every value
  }

 private:
  // `depth`: the arrays and objects around the one that starts.
  void open(int depth) {
    if (static_cast<std::size_t>(depth) + 1 > limits_.max_levels)
      throw LimitExceeded{"nesting too deep (more than " + std::to_string(limits_.max_levels) +
                          " levels)"};
    count_value();
  }
  void count_value() {
    if (++values_ > limits_.max_values)
      throw LimitExceeded{"too many values (more than " + std::to_string(limits_.max_values) + ")"};
  }
  // A member name twice in one object would be read as either of its values: refused.
  void add_name(const std::string& name) {
    if (!names_.back().insert(name).second) throw LimitExceeded{"duplicate member name"};
  }

  Limits limits_;
  std::size_t values_ = 0;
  std::vector<std::set<std::string>> names_;  // of each open object, innermost last
};

// nlohmann's message without its "[json.exception...] " prefix and the bytes it last read
// (which may be anything the peer sent).
inline std::string describe(const Value::parse_error& e) {
  std::string what = e.what();
  if (const auto col = what.find(": "); col != std::string::npos) what.erase(0, col + 2);
  if (const auto read = what.find("; last read"); read != std::string::npos) what.resize(read);
  return "at byte " + std::to_string(e.byte) + ": " + what;
}

}  // namespace detail

// Parses one JSON document read from outside, within `limits`.  nullopt, with *error (when
// given) set to one line, when the text is larger than max_bytes, is not JSON (invalid UTF-8
// included), nests deeper than max_levels, holds more than max_values values or repeats a member
// name within an object.  Json::parse: Value, or Ordered to keep the members' order.
template <class Json = Value>
[[nodiscard]] std::optional<Json> parse(std::string_view text, const Limits& limits,
                                        std::string* error) {
  auto fail = [error](std::string what) -> std::optional<Json> {
    if (error) *error = std::move(what);
    return std::nullopt;
  };
  if (text.size() > limits.max_bytes)
    return fail("too large (more than " + std::to_string(limits.max_bytes) + " bytes)");
  detail::LimitCheck check(limits);
  try {
    return Json::parse(text, [&check](int depth, typename Json::parse_event_t event, Json& parsed) {
      return check(depth, event, parsed);
    });
  } catch (const detail::LimitExceeded& e) {
    return fail(e.what);
  } catch (const nlohmann::json::parse_error& e) {
    return fail(detail::describe(e));
  } catch (const nlohmann::json::exception& e) {  // a number out of range
    return fail(e.what());
  }
}

// --- reading parsed values --------------------------------------------------------------------

// Member `key` of `v`; nullptr when `v` is not an object or has no such member.
[[nodiscard]] inline const Value* member(const Value& v, std::string_view key) {
  if (!v.is_object()) return nullptr;
  const auto it = v.find(key);
  return it == v.end() ? nullptr : &*it;
}

// The value when it is a JSON integer within int64_t; nullopt otherwise (fractions, strings...).
[[nodiscard]] inline std::optional<std::int64_t> to_int64(const Value& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<std::int64_t>();
  return std::nullopt;
}

// The value when it is a JSON integer within uint64_t.
[[nodiscard]] inline std::optional<std::uint64_t> to_uint64(const Value& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i >= 0) return static_cast<std::uint64_t>(i);
  }
  return std::nullopt;
}

// Member `key` of `v` when it is a string, else "".
[[nodiscard]] inline const std::string& string_member(const Value& v, std::string_view key) {
  static const std::string empty;
  const Value* m = member(v, key);
  return m && m->is_string() ? m->get_ref<const std::string&>() : empty;
}

// Member `key` of `v` as an exact integer, 0 when it is absent or not one that fits.
[[nodiscard]] inline std::uint64_t uint64_member(const Value& v, std::string_view key) {
  const Value* m = member(v, key);
  return m ? to_uint64(*m).value_or(0) : 0;
}
[[nodiscard]] inline std::int64_t int64_member(const Value& v, std::string_view key) {
  const Value* m = member(v, key);
  return m ? to_int64(*m).value_or(0) : 0;
}

// Member `key` of `v` when it is a boolean, else `dflt`.
[[nodiscard]] inline bool bool_member(const Value& v, std::string_view key, bool dflt) {
  const Value* m = member(v, key);
  return m && m->is_boolean() ? m->get<bool>() : dflt;
}

// --- writing ----------------------------------------------------------------------------------

// Compact, one line, no spaces: {"ok":true,"jobs":[]} (the control socket, QMP).
template <class Json>
[[nodiscard]] std::string dump(const Json& v) {
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// One line with a space after each ':' and ',': {"event": "result", "deleted": ["a", "b"]} (the
// CLI's --output=json).  Strings and numbers are nlohmann's; only the separators differ.
template <class Json>
[[nodiscard]] std::string dump_spaced(const Json& v) {
  if (v.is_object()) {
    std::string out = "{";
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it != v.begin()) out += ", ";
      out += dump(Json(it.key())) + ": " + dump_spaced(it.value());
    }
    return out + "}";
  }
  if (v.is_array()) {
    std::string out = "[";
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it != v.begin()) out += ", ";
      out += dump_spaced(*it);
    }
    return out + "]";
  }
  return dump(v);
}

}  // namespace qcommit::json
