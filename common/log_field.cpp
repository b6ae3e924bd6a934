// SPDX-License-Identifier: GPL-2.0-or-later
#include "common/log_field.h"

#include <cstdio>

namespace qcommit {

namespace {

bool bare_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '/' || c == '@' || c == '+' || c == '=' || c == ',' ||
         c == '-';
}

bool control_char(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u < 0x20 || u == 0x7f;
}

void append_control(std::string& out, char c) {
  switch (c) {
    case '\n':
      out += "\\n";
      return;
    case '\r':
      out += "\\r";
      return;
    case '\t':
      out += "\\t";
      return;
    default: {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x",
                    static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    }
  }
}

}  // namespace

std::string log_field(std::string_view s) {
  bool bare = !s.empty();
  for (char c : s) bare = bare && bare_char(c);
  if (bare) return std::string(s);
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (control_char(c)) {
      append_control(out, c);
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string log_escape_controls(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (control_char(c))
      append_control(out, c);
    else
      out += c;
  }
  return out;
}

std::string csv_field(std::string_view s) {
  const std::string e = log_escape_controls(s);
  if (e.find_first_of(",\"") == std::string::npos) return e;
  std::string out = "\"";
  for (char c : e) {
    if (c == '"') out += '"';
    out += c;
  }
  out += '"';
  return out;
}

}  // namespace qcommit
