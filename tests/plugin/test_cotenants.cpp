// SPDX-License-Identifier: GPL-2.0-or-later
// Offline-merge policy and co-tenants: which budget a merge gets (resolve_policy: option >
// domain metadata > pool section > [default] > built-in) and which running guests' disks count
// as its co-tenants (CotenantSource against the scripted hypervisor).
#include <doctest/doctest.h>

#include "fake_hypervisor.h"
#include "plugin/policy/config.h"
#include "plugin/govern/cotenants.h"

using namespace qcommit::plugin;
using namespace std::chrono_literals;

namespace {
constexpr double kMiB = 1024.0 * 1024;
const char* kConf =
    "[default]\nbudget=15ms\n"
    "[pool:images]\nbudget=7ms\nfloor=2M\n"
    "[pool:0a0a0a0a-1111-2222-3333-444444444444]\nbudget=9ms\n";
std::string meta(const std::string& attrs) {
  return std::string("<qcommit:policy xmlns:qcommit=\"") + kMetadataNamespace + "\" " + attrs + "/>";
}
}  // namespace

TEST_CASE("plugin.policy.resolution_order") {
  const DaemonConfig cfg = parse_config(kConf, "/etc/q.conf");
  SUBCASE("[default] when the pool has no section") {
    const auto r = resolve_policy(cfg, {.pool_name = "scratch"});
    CHECK(r.source == PolicySource::DefaultPolicy);
    CHECK(r.policy.budget == 15ms);
    CHECK(r.detail == "[default] in /etc/q.conf");
  }
  SUBCASE("the pool's section, by name or UUID; it inherits [default]") {
    auto r = resolve_policy(cfg, {.pool_name = "images"});
    CHECK(r.source == PolicySource::PoolPolicy);
    CHECK(std::string(to_string(r.source)) == "pool-policy");
    CHECK(r.policy.budget == 7ms);
    CHECK(r.policy.floor_bytes_per_s == 2 * kMiB);
    CHECK(r.detail == "[pool:images] in /etc/q.conf");
    r = resolve_policy(cfg, {.pool_name = "renamed", .pool_uuid = "0A0A0A0A-1111-2222-3333-444444444444"});
    CHECK(r.source == PolicySource::PoolPolicy);
    CHECK(r.policy.budget == 9ms);
  }
  SUBCASE("domain metadata beats the pool; floor/ceiling it does not set stay the pool's") {
    auto r = resolve_policy(cfg, {.domain_policy_xml = meta("budget=\"3ms\""), .pool_name = "images"});
    CHECK(r.source == PolicySource::DomainMetadata);
    CHECK(r.policy.budget == 3ms);
    CHECK(r.policy.floor_bytes_per_s == 2 * kMiB);
    // Metadata without a budget: the budget still comes from the pool.
    r = resolve_policy(cfg, {.domain_policy_xml = meta("ceiling=\"100M\""), .pool_name = "images"});
    CHECK(r.source == PolicySource::PoolPolicy);
    CHECK(r.policy.budget == 7ms);
    CHECK(r.policy.ceiling_bytes_per_s == 100 * kMiB);
    // Bad metadata is named and ignored, as qcommitd does.
    r = resolve_policy(cfg, {.domain_policy_xml = meta("budget=\"soon\""), .pool_name = "images"});
    CHECK(r.source == PolicySource::PoolPolicy);
    CHECK(r.policy.budget == 7ms);
    REQUIRE(r.metadata_error);
    CHECK(r.metadata_error->find("bad duration") != std::string::npos);
  }
  SUBCASE("--budget beats everything, the bounds still come from the policy") {
    const auto r = resolve_policy(
        cfg, {.budget_option = 30ms, .domain_policy_xml = meta("budget=\"3ms\""), .pool_name = "images"});
    CHECK(r.source == PolicySource::Option);
    CHECK(r.policy.budget == 30ms);
    CHECK(r.policy.floor_bytes_per_s == 2 * kMiB);
    CHECK(r.detail == "--budget");
  }
  SUBCASE("built-in without a file or without [default]") {
    auto r = resolve_policy(DaemonConfig{}, {.pool_name = "images"});
    CHECK(r.source == PolicySource::BuiltIn);
    CHECK(r.policy == Policy{});
    CHECK(r.detail == "built-in default");
    const DaemonConfig pools_only = parse_config("[pool:images]\nbudget=7ms\n", "p.conf");
    r = resolve_policy(pools_only, {.pool_name = "other"});
    CHECK(r.source == PolicySource::BuiltIn);
    CHECK(r.policy.budget == 20ms);
    CHECK(r.detail.find("p.conf has no [default]") != std::string::npos);
    r = resolve_policy(pools_only, {.pool_name = "images"});
    CHECK(r.source == PolicySource::PoolPolicy);
  }
}

TEST_CASE("plugin.cotenants.same_storage") {
  auto owned = std::make_unique<test::FakeHypervisor>();
  test::FakeHypervisor& hv = *owned;
  hv.pool_list = {{"images", "u-images", "/srv/images"}, {"other", "u-other", "/srv/other"}};
  hv.volumes["/srv/vols/vm4.qcow2"] = {"images", "u-images", "/srv/images"};  // volume of the pool
  auto disk = [](std::string target, std::string source, std::uint64_t dev) {
    DiskInfo d;
    d.target = std::move(target);
    d.source = std::move(source);
    d.device = dev;
    return d;
  };
  hv.domains = {
      {"vm1", "1", {disk("vda", "/srv/images/vm1.qcow2", 5)}, {}},     // same pool
      {"vm2", "2", {disk("vda", "/srv/other/vm2.qcow2", 6)}, {}},      // other pool, other fs
      {"vm3", "3", {disk("vdb", "/mnt/x/vm3.qcow2", 9)}, {}},          // same filesystem
      {"vm4", "4", {disk("vdc", "/srv/vols/vm4.qcow2", 7)}, {}},       // a volume of the pool
  };
  hv.stats[{"vm1", "vda"}] = {10, 10'000'000, 5, 20'000'000};
  hv.stats[{"vm3", "vdb"}] = {1, 1'000'000, 0, 0};
  // vm4/vdc: no stats (e.g. the domain went away between listing and sampling): skipped.
  CotenantSource src(std::move(owned), "/srv/images/base.qcow2", 9);
  REQUIRE(src.scan());
  REQUIRE(src.target_pool());
  CHECK(src.target_pool()->name == "images");
  CHECK(src.disks() == std::vector<std::string>{"vm1/vda", "vm3/vdb", "vm4/vdc"});
  auto s = src.sample();
  REQUIRE(s.size() == 2);
  CHECK(s[0].id == "vm1/vda");
  CHECK(s[0].counters.flush_total_times_ns == 20'000'000);
  CHECK(s[1].id == "vm3/vdb");

  // libvirtd goes away: no samples, no exception; back at the next rescan, which is the only
  // reconnection attempt (no connect per sample).
  hv.libvirtd_stops();
  CHECK(src.sample().empty());
  CHECK(src.disks().empty());
  hv.daemon_up = true;
  const int connects = hv.connects;
  size_t n = 0;
  unsigned calls = 0;
  while (n == 0 && calls < 2 * kCotenantRescanSamples) {
    n = src.sample().size();
    ++calls;
  }
  CHECK(n == 2);
  CHECK(calls <= kCotenantRescanSamples);
  CHECK(hv.connects == connects + 1);
}

TEST_CASE("plugin.cotenants.unknown_storage_has_none") {
  // BASE outside every pool and its filesystem unknown: nobody is a co-tenant, not even a
  // disk in the same directory tree (no evidence of shared storage).
  auto owned = std::make_unique<test::FakeHypervisor>();
  owned->pool_list = {{"images", "u-images", "/srv/images"}};
  DiskInfo d;
  d.target = "vda";
  d.source = "/srv/images/vm1.qcow2";
  owned->domains = {{"vm1", "1", {d}, {}}};
  owned->stats[{"vm1", "vda"}] = {1, 1, 0, 0};
  CotenantSource src(std::move(owned), "/var/tmp/base.qcow2", std::nullopt);
  REQUIRE(src.scan());
  CHECK(!src.target_pool());
  CHECK(src.disks().empty());
  CHECK(src.sample().empty());
}
