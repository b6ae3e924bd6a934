// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd configuration: /etc/qcommit/qcommitd.conf (GLib key file) and per-domain overrides.
//
//   [default]
//   budget=20ms      # added guest latency the merge may cause
//   floor=1M         # job speed never paced below this (bytes/s) unless the guests stall
//   ceiling=1G       # never above
//   probe=auto       # shared-queue probe (throttle/probe.h) on the job's target storage, standing
//                    # for guests on other hosts sharing it: auto = every 100ms where the target
//                    # is on a filesystem other hosts can share (engine/storage_kind.h), a
//                    # duration = that often on any filesystem, off = never
//   [pool:NAME] or [pool:UUID]   same keys, for disks in that libvirt storage pool
//
// Domain override: <metadata><qcommit:policy xmlns:qcommit="https://qcommit.dev/xmlns/1"
// budget="10ms" floor=".." ceiling=".."/></metadata>.  Unknown storage uses [default].
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "common/defaults.h"
#include "common/units.h"
#include "throttle/controller.h"
#include "throttle/probe.h"

namespace qcommit::plugin {

inline constexpr const char* kMetadataNamespace = "https://qcommit.dev/xmlns/1";
inline constexpr const char* kMetadataPrefix = "qcommit";
// The largest ceiling a policy may set (bytes/s): common/units.h holds the bounds.
inline constexpr double kMaxCeilingBytesPerS = units::kMaxRateBytesPerS;

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The shared-queue probe of a policy: never, where the target's storage can be shared with other
// hosts (auto), or on any storage.
enum class ProbeMode { kOff, kAuto, kOn };

struct Policy {
  std::chrono::nanoseconds budget = defaults::kBudget;
  double floor_bytes_per_s = defaults::kFloorBytesPerS;
  double ceiling_bytes_per_s = defaults::kCeilingBytesPerS;
  ProbeMode probe = ProbeMode::kAuto;  // the shared-queue probe
  std::chrono::nanoseconds probe_period = defaults::kProbePeriod;

  [[nodiscard]] std::optional<std::string> validate() const;
  [[nodiscard]] throttle::ProbeConfig probe_config() const;
  [[nodiscard]] throttle::ControllerConfig controller_config() const;
  bool operator==(const Policy&) const = default;
};

struct DaemonConfig {
  Policy defaults;
  std::map<std::string, Policy> pools;  // key: pool name or UUID (UUIDs lower-case)
  std::string origin;        // the file it was read from; empty: built-in defaults
  bool has_default = false;  // the file has a [default] section
  std::string uri = defaults::kUri;
  std::string socket_path = defaults::kSocketPath;

  [[nodiscard]] std::optional<std::string> validate() const;
};

// The one duration grammar of qcommit, qcommitd and this configuration: common/units.h
// (qcommit(1), DURATIONS AND SIZES).
inline constexpr std::chrono::hours kMaxDuration = units::kMaxDuration;
using units::read_duration;
// read_duration that throws ConfigError "<what>: <error>".
[[nodiscard]] std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& what);
// probe=off, auto (the default period) or a period (on any storage) onto `p`: the policy file's
// key and `qcommit live --probe`.  Throws ConfigError naming `what`.
void read_probe(const std::string& value, const std::string& what, Policy& p);
// "4096", "64K", "1M", "1.5G", "1MiB" (common/units.h); throws ConfigError naming `what`.
[[nodiscard]] double parse_size(const std::string& s, const std::string& what);

// Key-file text → config.  `origin` (the path) prefixes every error.  Throws ConfigError.
[[nodiscard]] DaemonConfig parse_config(const std::string& text, const std::string& origin);
// Reads and parses; a missing file yields the defaults (origin empty) when missing_ok or at the
// default path (defaults::kConfigPath, even when named).  Throws ConfigError.
[[nodiscard]] DaemonConfig load_config(const std::string& path, bool missing_ok);

// The policy of a disk in `pool` (by name, then UUID), else [default].
[[nodiscard]] Policy policy_for_pool(const DaemonConfig& cfg, const std::string* pool_name,
                                     const std::string* pool_uuid);

// Applies a domain's <qcommit:policy/> element to `p`.  Returns an error line (and leaves `p`
// unchanged) when the XML or a value is bad.  *budget_given: the element sets the budget.
[[nodiscard]] std::optional<std::string> apply_domain_override(const std::string& xml, Policy& p,
                                                               bool* budget_given = nullptr);

// Where a merge's budget came from, strongest first: the command line, the domain's metadata,
// the [pool:...] section of the pool holding the target, [default], the built-in default.
enum class PolicySource { Option, DomainMetadata, PoolPolicy, DefaultPolicy, BuiltIn };
[[nodiscard]] const char* to_string(PolicySource s);  // "option", "domain-metadata", ...

struct PolicyQuery {
  std::optional<std::chrono::nanoseconds> budget_option{};  // --budget
  std::optional<std::string> domain_policy_xml{};           // the domain's <qcommit:policy/>
  std::optional<std::string> pool_name{}, pool_uuid{};      // pool holding the target
};

struct PolicyResolution {
  Policy policy;  // budget from `source`; floor and ceiling from the same chain without the option
  PolicySource source = PolicySource::BuiltIn;
  std::string detail;  // e.g. "[pool:images] in /etc/qcommit/qcommitd.conf"
  std::optional<std::string> metadata_error;  // bad domain metadata: ignored, as qcommitd does
};

[[nodiscard]] PolicyResolution resolve_policy(const DaemonConfig& cfg, const PolicyQuery& q);

}  // namespace qcommit::plugin
