// SPDX-License-Identifier: GPL-2.0-or-later
// The one trace format (qcommit merge --trace, qcommitd --trace): optional "# key=value" lines
// with the run's parameters, then one header line naming the columns in snake_case (units as
// suffixes: _s, _ms, _bytes, _bytes_per_s; the time first, as t_s), then one row per sample.
// Every field is written through csv_field (common/log_field.h), so a name holding commas,
// quotes or newlines keeps its row one line of the header's columns; readers find columns by
// name (qcommit report, scripts/plot-trace).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

namespace qcommit::trace_csv {

// "# key=value\n": control characters escaped as in log_field (a parameter stays one line).
[[nodiscard]] std::string param_line(std::string_view key, std::string_view value);

// "a,b,c\n". Column names must be snake_case: [a-z][a-z0-9_]*.
[[nodiscard]] std::string header_line(std::initializer_list<std::string_view> columns);

// One row: each field through csv_field, joined by commas, "\n" at the end.
[[nodiscard]] std::string row_line(std::initializer_list<std::string_view> fields);

// A number with `decimals` places, as printf's %.*f ("" for not-a-number: unknown).
[[nodiscard]] std::string fixed(double v, int decimals);

}  // namespace qcommit::trace_csv
