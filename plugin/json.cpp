#include "plugin/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace qcommit::plugin::json {

const Value* Value::find(const std::string& key) const {
  if (!is_object()) return nullptr;
  const auto& o = object();
  auto it = o.find(key);
  return it == o.end() ? nullptr : &it->second;
}

std::optional<std::int64_t> Value::integer() const {
  if (!is_number()) return std::nullopt;
  const double d = number();
  if (std::fabs(d) > kMaxExactInteger || std::trunc(d) != d) return std::nullopt;
  return static_cast<std::int64_t>(d);
}

std::optional<std::uint64_t> Value::unsigned_integer() const {
  const std::optional<std::int64_t> i = integer();
  if (!i || *i < 0) return std::nullopt;
  return static_cast<std::uint64_t>(*i);
}

namespace {

class Parser {
 public:
  Parser(std::string_view s, std::size_t max_values) : s_(s), max_values_(max_values) {}

  std::optional<Value> run(std::string* error) {
    std::optional<Value> v = value(0);
    if (v) {
      ws();
      if (pos_ != s_.size()) fail("trailing characters");
    }
    if (!err_.empty()) {
      if (error) *error = err_ + " at byte " + std::to_string(pos_);
      return std::nullopt;
    }
    return v;
  }

 private:
  void fail(const char* m) {
    if (err_.empty()) err_ = m;
  }
  void ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool lit(std::string_view w) {
    if (s_.substr(pos_, w.size()) == w) {
      pos_ += w.size();
      return true;
    }
    return false;
  }
  std::optional<Value> value(int depth) {
    if (depth > kMaxDepth) {
      fail("nesting too deep");
      return std::nullopt;
    }
    if (++values_ > max_values_) {
      fail("too many values");
      return std::nullopt;
    }
    ws();
    if (pos_ >= s_.size()) {
      fail("unexpected end of input");
      return std::nullopt;
    }
    const char c = s_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      auto s = str();
      if (!s) return std::nullopt;
      return Value{*s};
    }
    if (lit("true")) return Value{true};
    if (lit("false")) return Value{false};
    if (lit("null")) return Value{nullptr};
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail("unexpected character");
    return std::nullopt;
  }
  std::optional<Value> number() {
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      size_t n = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, ++n;
      return n;
    };
    if (digits() == 0) return fail("bad number"), std::nullopt;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) return fail("bad number"), std::nullopt;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) return fail("bad number"), std::nullopt;
    }
    const std::string text(s_.substr(start, pos_ - start));
    const double d = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(d)) return fail("number out of range"), std::nullopt;
    return Value{d};
  }
  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  std::optional<unsigned> hex4() {
    if (pos_ + 4 > s_.size()) return std::nullopt;
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else return std::nullopt;
    }
    return v;
  }
  std::optional<std::string> str() {
    ++pos_;  // opening quote
    std::string out;
    while (pos_ < s_.size()) {
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in string"), std::nullopt;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) break;
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          auto cp = hex4();
          if (!cp) return fail("bad \\u escape"), std::nullopt;
          unsigned code = *cp;
          if (code >= 0xD800 && code <= 0xDBFF) {
            if (!lit("\\u")) return fail("lone surrogate"), std::nullopt;
            auto lo = hex4();
            if (!lo || *lo < 0xDC00 || *lo > 0xDFFF) return fail("bad surrogate pair"), std::nullopt;
            code = 0x10000 + ((code - 0xD800) << 10) + (*lo - 0xDC00);
          } else if (code >= 0xDC00 && code <= 0xDFFF) {
            return fail("lone surrogate"), std::nullopt;
          }
          utf8(out, code);
          break;
        }
        default: return fail("bad escape"), std::nullopt;
      }
    }
    fail("unterminated string");
    return std::nullopt;
  }
  std::optional<Value> array(int depth) {
    ++pos_;
    Array a;
    ws();
    if (lit("]")) return Value{std::move(a)};
    for (;;) {
      auto v = value(depth + 1);
      if (!v) return std::nullopt;
      a.push_back(std::move(*v));
      ws();
      if (lit(",")) continue;
      if (lit("]")) return Value{std::move(a)};
      fail("expected , or ]");
      return std::nullopt;
    }
  }
  std::optional<Value> object(int depth) {
    ++pos_;
    Object o;
    ws();
    if (lit("}")) return Value{std::move(o)};
    for (;;) {
      ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') return fail("expected member name"), std::nullopt;
      auto k = str();
      if (!k) return std::nullopt;
      ws();
      if (!lit(":")) return fail("expected :"), std::nullopt;
      auto v = value(depth + 1);
      if (!v) return std::nullopt;
      if (!o.emplace(std::move(*k), std::move(*v)).second)
        return fail("duplicate member name"), std::nullopt;
      ws();
      if (lit(",")) continue;
      if (lit("}")) return Value{std::move(o)};
      fail("expected , or }");
      return std::nullopt;
    }
  }

  std::string_view s_;
  std::size_t max_values_;
  std::size_t values_ = 0;
  size_t pos_ = 0;
  std::string err_;
};

void write(std::string& out, const Value& v) {
  if (std::holds_alternative<std::nullptr_t>(v.v)) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.boolean() ? "true" : "false";
  } else if (v.is_number()) {
    char buf[32];
    if (const auto i = v.integer())
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(*i));
    else
      std::snprintf(buf, sizeof buf, "%.17g", v.number());
    out += buf;
  } else if (v.is_string()) {
    out += quote(v.string());
  } else if (v.is_array()) {
    out += '[';
    bool first = true;
    for (const auto& e : v.array()) {
      if (!first) out += ',';
      first = false;
      write(out, e);
    }
    out += ']';
  } else {
    out += '{';
    bool first = true;
    for (const auto& [k, e] : v.object()) {
      if (!first) out += ',';
      first = false;
      out += quote(k);
      out += ':';
      write(out, e);
    }
    out += '}';
  }
}

}  // namespace

std::optional<Value> parse(std::string_view text, std::string* error, std::size_t max_values) {
  return Parser(text, max_values).run(error);
}

std::string serialize(const Value& v) {
  std::string out;
  write(out, v);
  return out;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace qcommit::plugin::json
