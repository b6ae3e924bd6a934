// SPDX-License-Identifier: GPL-2.0-or-later
// The policy of qcommit's commands (plugin/policy/command_policy.h): an offline merge's budget
// from domain metadata, then the pool, then [default], the bounds capped by --max-rate with the
// floor never above the ceiling; qcommit live's governor configuration from its options.
#include <doctest/doctest.h>

#include "plugin/policy/command_policy.h"

using namespace qcommit::plugin;
using namespace std::chrono_literals;

namespace {
constexpr double kMiB = 1024.0 * 1024;
const char* kConf =
    "[default]\nbudget=15ms\nfloor=3M\nceiling=300M\n"
    "[pool:images]\nbudget=7ms\nfloor=2M\nceiling=200M\n";
std::string meta(const std::string& attrs) {
  return std::string("<qcommit:policy xmlns:qcommit=\"") + kMetadataNamespace + "\" " + attrs +
         "/>";
}
MergePolicyInputs in_pool(std::string pool) {
  MergePolicyInputs in;
  in.domain = "vm1";
  in.pool_name = std::move(pool);
  return in;
}
}  // namespace

TEST_CASE("plugin.policy.merge_metadata_then_pool_then_default") {
  const DaemonConfig cfg = parse_config(kConf, "/etc/q.conf");
  MergePolicyInputs in = in_pool("images");
  in.domain_policy_xml = meta("budget=\"3ms\" ceiling=\"100M\"");
  // Metadata beats the pool: budget and ceiling its own, the floor it does not set the pool's.
  MergePolicyDecision d = resolve_merge_policy(cfg, in);
  CHECK(d.resolution.source == PolicySource::DomainMetadata);
  CHECK(d.resolution.detail == "domain vm1");
  CHECK(d.resolution.policy.budget == 3ms);
  CHECK(d.resolution.policy.ceiling_bytes_per_s == 100 * kMiB);
  CHECK(d.resolution.policy.floor_bytes_per_s == 2 * kMiB);
  CHECK(d.notes.empty());
  // Without metadata the pool beats [default].
  in.domain_policy_xml.reset();
  d = resolve_merge_policy(cfg, in);
  CHECK(d.resolution.source == PolicySource::PoolPolicy);
  CHECK(d.resolution.policy.budget == 7ms);
  CHECK(d.resolution.policy.floor_bytes_per_s == 2 * kMiB);
  CHECK(d.resolution.policy.ceiling_bytes_per_s == 200 * kMiB);
  // A pool without a section, found by UUID or not at all: [default].
  d = resolve_merge_policy(cfg, in_pool("scratch"));
  CHECK(d.resolution.source == PolicySource::DefaultPolicy);
  CHECK(d.resolution.policy.budget == 15ms);
  CHECK(d.resolution.policy.floor_bytes_per_s == 3 * kMiB);
  // Bad metadata: named in a note and ignored, the pool's policy stands.
  in.domain_policy_xml = meta("budget=\"soon\"");
  d = resolve_merge_policy(cfg, in);
  CHECK(d.resolution.source == PolicySource::PoolPolicy);
  CHECK(d.resolution.policy.budget == 7ms);
  REQUIRE(d.notes.size() == 1);
  CHECK(d.notes[0].rfind("domain vm1: domain metadata policy budget: ", 0) == 0);
  CHECK(d.notes[0].find("(ignored)") != std::string::npos);
  // --budget beats the metadata; the bounds still come from it.
  in.domain_policy_xml = meta("budget=\"3ms\" ceiling=\"100M\"");
  in.budget = 30ms;
  d = resolve_merge_policy(cfg, in);
  CHECK(d.resolution.source == PolicySource::Option);
  CHECK(d.resolution.policy.budget == 30ms);
  CHECK(d.resolution.policy.ceiling_bytes_per_s == 100 * kMiB);
}

TEST_CASE("plugin.policy.max_rate_caps_floor_and_ceiling") {
  const DaemonConfig cfg = parse_config(kConf, "/etc/q.conf");
  MergePolicyInputs in = in_pool("images");  // floor 2M, ceiling 200M
  SUBCASE("above the ceiling: nothing changes") {
    in.max_rate_bytes_per_s = 500 * kMiB;
    const MergePolicyDecision d = resolve_merge_policy(cfg, in);
    CHECK(d.resolution.policy.ceiling_bytes_per_s == 200 * kMiB);
    CHECK(d.resolution.policy.floor_bytes_per_s == 2 * kMiB);
    CHECK(d.max_rate_bytes_per_s == 500 * kMiB);
  }
  SUBCASE("between floor and ceiling: the ceiling is the cap") {
    in.max_rate_bytes_per_s = 50 * kMiB;
    const MergePolicyDecision d = resolve_merge_policy(cfg, in);
    CHECK(d.resolution.policy.ceiling_bytes_per_s == 50 * kMiB);
    CHECK(d.resolution.policy.floor_bytes_per_s == 2 * kMiB);
  }
  SUBCASE("below the floor: floor and ceiling both the cap") {
    in.max_rate_bytes_per_s = 1 * kMiB;
    const MergePolicyDecision d = resolve_merge_policy(cfg, in);
    CHECK(d.resolution.policy.ceiling_bytes_per_s == 1 * kMiB);
    CHECK(d.resolution.policy.floor_bytes_per_s == 1 * kMiB);
    CHECK_FALSE(d.resolution.policy.validate());
  }
  SUBCASE("the metadata's ceiling is capped too") {
    in.domain_policy_xml = meta("ceiling=\"100M\" floor=\"40M\"");
    in.max_rate_bytes_per_s = 8 * kMiB;
    const MergePolicyDecision d = resolve_merge_policy(cfg, in);
    CHECK(d.resolution.policy.ceiling_bytes_per_s == 8 * kMiB);
    CHECK(d.resolution.policy.floor_bytes_per_s == 8 * kMiB);
  }
  CHECK(cap_rate(Policy{}, std::nullopt) == Policy{});
}

TEST_CASE("plugin.policy.inputs_validate") {
  MergePolicyInputs in;
  CHECK_FALSE(in.validate());
  in.budget = 0ms;
  CHECK(in.validate().value_or("") == "budget must be more than 0");
  in.budget = 20ms;
  in.max_rate_bytes_per_s = 1000;
  CHECK(in.validate().value_or("") == "max-rate must be >= 4K (bytes/s)");
  LivePolicyInputs live;
  CHECK_FALSE(live.validate());
  live.budget = 61s;
  CHECK(live.validate().value_or("") == "budget must be at most 60s");
}

TEST_CASE("plugin.policy.live_governor_config") {
  LivePolicyInputs in;
  in.uri = "qemu:///session";
  in.budget = 5ms;
  LivePolicy lp = live_policy(in);
  CHECK(lp.config.uri == "qemu:///session");
  CHECK(lp.config.defaults.budget == 5ms);
  CHECK(lp.config.defaults.floor_bytes_per_s == Policy{}.floor_bytes_per_s);
  CHECK(lp.config.defaults.ceiling_bytes_per_s == Policy{}.ceiling_bytes_per_s);
  CHECK(lp.initial_speed_bytes_per_s ==
        lp.config.defaults.controller_config().initial_rate_bytes_per_s);
  // --max-rate under the built-in floor (1M): floor, ceiling and the starting speed are the cap.
  in.max_rate_bytes_per_s = 512 * 1024;
  lp = live_policy(in);
  CHECK(lp.config.defaults.ceiling_bytes_per_s == 512 * 1024);
  CHECK(lp.config.defaults.floor_bytes_per_s == 512 * 1024);
  CHECK(lp.initial_speed_bytes_per_s == 512 * 1024);
  // --probe: a period on any storage, off, or an error naming the option and the value.
  in.probe = "50ms";
  lp = live_policy(in);
  CHECK(lp.config.defaults.probe == ProbeMode::kOn);
  CHECK(lp.config.defaults.probe_period == 50ms);
  in.probe = "sometimes";
  try {
    (void)live_policy(in);
    FAIL("--probe sometimes accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) == "--probe sometimes: not auto, off or a period such as 50ms");
  }
  in.probe = "1h";
  CHECK_THROWS_AS((void)live_policy(in), ConfigError);
}

TEST_CASE("plugin.policy.daemon_overrides") {
  const DaemonConfig file = parse_config(kConf, "/etc/q.conf");
  // Nothing given: the file's connection and socket.
  DaemonConfig c =
      with_overrides(file, {.config_path = "/etc/q.conf", .uri = "", .socket_path = ""});
  CHECK(c.uri == qcommit::defaults::kUri);
  CHECK(c.socket_path == qcommit::defaults::kSocketPath);
  CHECK(c.pools.count("images") == 1);
  c = with_overrides(
      file,
      {.config_path = "/etc/q.conf", .uri = "qemu+ssh://h/system", .socket_path = "/run/q/s.sock"});
  CHECK(c.uri == "qemu+ssh://h/system");
  CHECK(c.socket_path == "/run/q/s.sock");
  try {
    (void)with_overrides(
        file, {.config_path = "/etc/q.conf", .uri = "", .socket_path = std::string(120, 's')});
    FAIL("a socket path longer than sun_path accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) == "/etc/q.conf: socket path empty or too long");
  }
}
