// SPDX-License-Identifier: GPL-2.0-or-later
// The one grammar of sizes, rates and durations, for every option of qcommit and qcommitd, the
// policy file (/etc/qcommit/qcommitd.conf) and a domain's <qcommit:policy/> metadata, with the
// bounds each kind of value has. qcommit(1), DURATIONS AND SIZES, describes it. No dependencies.
//
//   duration  a decimal number (digits with at most one '.', no sign, no exponent), optional
//             blanks, a unit: ns, us, ms or s ("20ms", "20 ms", "0.02s", "500us"). A bare number
//             is refused ("20" is 20 ms to some readers and 20 s to others), except a bare 0
//             where zero is allowed (--wait 0). At most kMaxDuration.
//   size      a decimal number, optional blanks, an optional binary unit: K, M, G or T (any case,
//             also KiB/KB/MiB...), or B ("4096", "64K", "1.5G", "1MiB").
//   rate      a size, optionally followed by "/s" ("50M", "50M/s"): bytes per second.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace qcommit::units {

inline constexpr std::chrono::hours kMaxDuration{1};
// The largest latency budget (--budget, budget=): beyond it pacing no longer protects anyone.
inline constexpr std::chrono::seconds kMaxBudget{60};
// The slowest and fastest rate a policy's floor and ceiling or --max-rate may set (bytes/s):
// the fastest is far above any storage, and exact as a double and as the int64 speed QEMU takes.
inline constexpr double kMinRateBytesPerS = 4096.0;
inline constexpr double kMaxRateBytesPerS = 1024.0 * 1024 * 1024 * 1024;  // 1 TiB/s
// The largest size any option takes (bytes).
inline constexpr double kMaxSizeBytes = 1024.0 * 1024 * 1024 * 1024 * 1024;  // 1 PiB

// Each reader returns the value, or nullopt with `error` set to one line that shows the fix
// ("a duration needs a unit: 20ms or 20s"); the caller prefixes the option or key.
[[nodiscard]] std::optional<std::chrono::nanoseconds> read_duration(std::string_view text,
                                                                   std::string& error);
// A duration that may be zero (a bare "0" too): --wait.
[[nodiscard]] std::optional<std::chrono::nanoseconds> read_wait(std::string_view text,
                                                               std::string& error);
// A latency budget: a duration more than 0 and at most kMaxBudget.
[[nodiscard]] std::optional<std::chrono::nanoseconds> read_budget(std::string_view text,
                                                                 std::string& error);
[[nodiscard]] std::optional<double> read_size(std::string_view text, std::string& error);
// A rate in bytes per second, from kMinRateBytesPerS to kMaxRateBytesPerS.
[[nodiscard]] std::optional<double> read_rate(std::string_view text, std::string& error);

// `bytes` in MiB with one decimal, as log lines and status show sizes and rates: "32.6 MiB".
[[nodiscard]] std::string mib_text(double bytes);

// The problem of a budget outside (0, kMaxBudget], nullopt when it is fine.
[[nodiscard]] std::optional<std::string> budget_problem(std::chrono::nanoseconds budget);

}  // namespace qcommit::units
