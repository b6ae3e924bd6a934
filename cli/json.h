// JSON output helpers for the CLI. Quoting is the control-socket protocol's (plugin/json.h), so
// the CLI and qcommitd escape strings the same way.
#pragma once

#include <string>
#include <string_view>

#include "plugin/json.h"

namespace qcommit::cli {

inline std::string json_string(std::string_view s) { return plugin::json::quote(s); }

inline const char* json_bool(bool b) { return b ? "true" : "false"; }

}  // namespace qcommit::cli
