// SPDX-License-Identifier: GPL-2.0-or-later
// Names as data in one-line records (qcommitd's log, notices, errors) and in CSV rows (traces).
// Domain, disk, pool and file names come from whoever defined them and may hold spaces, quotes,
// shell syntax and newlines: written as fields they keep a record on one line and its fields
// separable.
#pragma once

#include <string>
#include <string_view>

namespace qcommit {

// `s` as it is when it is non-empty and consists of [A-Za-z0-9._:/@+=,-] only, else in double
// quotes with \" \\ and control characters escaped (\n \r \t, others \xNN).
[[nodiscard]] std::string log_field(std::string_view s);

// `s` with control characters (bytes < 0x20 and 0x7f) escaped as in log_field; backslashes and
// quotes are left alone (fields are quoted by log_field).
[[nodiscard]] std::string log_escape_controls(std::string_view s);

// A CSV field (qcommitd --trace): control characters escaped as in log_field, then quoted with
// doubled quotes when it holds a comma or a quote, so a row stays one line of the same columns.
[[nodiscard]] std::string csv_field(std::string_view s);

}  // namespace qcommit
