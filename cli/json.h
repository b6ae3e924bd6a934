// Minimal JSON output helpers for the CLI (no policy, no parsing).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace qcommit::cli {

inline std::string json_string(std::string_view s) {
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
          out += char(c);
        }
    }
  }
  return out + "\"";
}

inline const char* json_bool(bool b) { return b ? "true" : "false"; }

}  // namespace qcommit::cli
