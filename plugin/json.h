// Small strict JSON reader/writer for the control socket protocol (one request / response per
// line) and QMP (plugin/qmp_client.h).  No libvirt, no glib; the CLI links it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace qcommit::plugin::json {

inline constexpr int kMaxDepth = 32;
// Default cap on the values one parse() may create: each costs ~50-100 bytes of memory against
// 2 bytes of input ("0,"), so the input size alone does not bound the memory.
inline constexpr std::size_t kMaxValues = 1u << 20;
// Integers up to this magnitude are exact in a double.
inline constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

struct Value;
using Array = std::vector<Value>;
using Object = std::map<std::string, Value>;

struct Value {
  std::variant<std::nullptr_t, bool, double, std::string, Array, Object> v = nullptr;

  [[nodiscard]] bool is_object() const { return std::holds_alternative<Object>(v); }
  [[nodiscard]] bool is_array() const { return std::holds_alternative<Array>(v); }
  [[nodiscard]] bool is_string() const { return std::holds_alternative<std::string>(v); }
  [[nodiscard]] bool is_number() const { return std::holds_alternative<double>(v); }
  [[nodiscard]] bool is_bool() const { return std::holds_alternative<bool>(v); }
  [[nodiscard]] const Object& object() const { return std::get<Object>(v); }
  [[nodiscard]] const Array& array() const { return std::get<Array>(v); }
  [[nodiscard]] const std::string& string() const { return std::get<std::string>(v); }
  [[nodiscard]] double number() const { return std::get<double>(v); }
  [[nodiscard]] bool boolean() const { return std::get<bool>(v); }
  // Member lookup; nullptr when not an object or absent.
  [[nodiscard]] const Value* find(const std::string& key) const;
  // The number as an integer when it is one (no fraction, within ±2^53), else nullopt.
  [[nodiscard]] std::optional<std::int64_t> integer() const;
  // Same, for integers >= 0.
  [[nodiscard]] std::optional<std::uint64_t> unsigned_integer() const;
};

// Parses exactly one JSON value (surrounding whitespace allowed).  On error returns nullopt and
// sets *error to one line.
// At most `max_values` values (strings, numbers, arrays, ... each count one).
[[nodiscard]] std::optional<Value> parse(std::string_view text, std::string* error,
                                         std::size_t max_values = kMaxValues);

// Compact JSON text of a value; integral numbers within ±2^53 are written without a fraction,
// other numbers with 17 significant digits.
[[nodiscard]] std::string serialize(const Value& v);

[[nodiscard]] std::string quote(std::string_view s);

}  // namespace qcommit::plugin::json
