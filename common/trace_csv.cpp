// SPDX-License-Identifier: GPL-2.0-or-later
#include "common/trace_csv.h"

#include <cmath>
#include <cstdio>

#include "common/log_field.h"

namespace qcommit::trace_csv {

std::string param_line(std::string_view key, std::string_view value) {
  return "# " + log_escape_controls(key) + "=" + log_escape_controls(value) + "\n";
}

std::string header_line(std::initializer_list<std::string_view> columns) {
  std::string o;
  for (std::string_view c : columns) {
    if (!o.empty()) o += ',';
    o += c;
  }
  return o + "\n";
}

std::string row_line(std::initializer_list<std::string_view> fields) {
  std::string o;
  bool first = true;
  for (std::string_view f : fields) {
    if (!first) o += ',';
    first = false;
    o += csv_field(f);
  }
  return o + "\n";
}

std::string fixed(double v, int decimals) {
  if (std::isnan(v)) return {};
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace qcommit::trace_csv
