// SPDX-License-Identifier: GPL-2.0-or-later
// Domain lifecycle news from the libvirt hook (control socket "domain-event"): the governor looks
// at that domain at once instead of at its next poll.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "plugin/daemon/control.h"
#include "plugin/govern/governor.h"
#include "plugin/host/json.h"
#include "tests/plugin/fake_hypervisor.h"
#include "tests/plugin/world.h"

using namespace qcommit::plugin;
using namespace qcommit::plugin::test;
using namespace std::chrono_literals;

namespace {

// The "ok" member of a response line.
bool ok_of(const std::string& response) {
  const auto v = qcommit::json::parse(response, qcommit::json::kControlResponseLimits, nullptr);
  REQUIRE(v);
  return v->at("ok").get<bool>();
}

}  // namespace

TEST_CASE("plugin.control.domain_event") {
  auto status = [] { return std::string("{\"ok\":true,\"jobs\":[]}"); };
  std::vector<std::pair<std::string, std::string>> got;
  DomainEventSink sink = [&](const std::string& d, const std::string& e) {
    got.emplace_back(d, e);
  };
  const std::string hostile = "vm \"q\" 'x' $(touch /tmp/p) `id`; rm -rf /\nsecond line\t\x01";
  const std::string req = qcommit::json::dump(
      qcommit::json::Ordered{{"cmd", "domain-event"}, {"domain", hostile}, {"event", "stopped"}});
  CHECK(answer_request(req, status, sink) == "{\"ok\":true}");
  REQUIRE(got.size() == 1);
  CHECK(got[0].first == hostile);  // byte for byte, never interpreted
  CHECK(got[0].second == "stopped");
  for (const std::string& bad :
       {std::string(R"({"cmd":"domain-event","domain":"vm1","event":"prepare"})"),
        std::string(R"({"cmd":"domain-event","domain":"vm1"})"),
        std::string(R"({"cmd":"domain-event","domain":"","event":"started"})"),
        std::string(R"({"cmd":"domain-event","domain":7,"event":"started"})"),
        std::string(R"({"cmd":"domain-event","domain":"vm1","event":"started","x":1})"),
        "{\"cmd\":\"domain-event\",\"domain\":\"" + std::string(kMaxDomainNameBytes + 1, 'a') +
            "\",\"event\":\"started\"}"}) {
    CHECK_FALSE(ok_of(answer_request(bad, status, sink)));
  }
  CHECK(got.size() == 1);
  // A server without a sink refuses instead of pretending.
  CHECK_FALSE(ok_of(answer_request(req, status)));
}

TEST_CASE("plugin.governor.hook_event_scans_domain_now") {
  World w;
  Governed gv(w);
  gv.run(1s);
  gv.run(20ms);   // just after a poll: the next one is ~0.5 s away
  w.start_job();  // no libvirt event: the hook's "started"/"reconnect" is the news
  gv.g.domain_event("vm1", "reconnect");
  (void)gv.g.step(w.now);
  CHECK(gv.g.job_count() == 1);
  CHECK(w.hv.speed("vm1", "vda") > 0);

  gv.run(1s);
  gv.run(20ms);
  // The domain stops: QEMU and its job are gone; the hook says so before the next poll.
  w.hv.jobs.clear();
  std::erase_if(w.hv.domains, [](const DomainInfo& d) { return d.name == "vm1"; });
  gv.g.domain_event("vm1", "stopped");
  (void)gv.g.step(w.now);
  CHECK(gv.g.job_count() == 0);
  const auto st = gv.g.status(w.now);
  REQUIRE(st.released.size() == 1);
  CHECK(st.released[0].domain == "vm1");
}
