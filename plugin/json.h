// Small strict JSON reader/writer for the control socket protocol (one request / response per
// line).  No libvirt, no glib; the CLI links it too.
#pragma once

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
};

// Parses exactly one JSON value (surrounding whitespace allowed).  On error returns nullopt and
// sets *error to one line.
[[nodiscard]] std::optional<Value> parse(std::string_view text, std::string* error);

[[nodiscard]] std::string quote(std::string_view s);

}  // namespace qcommit::plugin::json
