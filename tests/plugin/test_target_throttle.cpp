// SPDX-License-Identifier: GPL-2.0-or-later
// plugin/target_throttle: the QMP steps that put a throttle filter under a job's target and take
// it out, against a model of QEMU's block graph (fake_qemu_graph.h).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "plugin/govern/target_throttle.h"
#include "tests/plugin/fake_qemu_graph.h"

namespace qcommit::plugin::test {

TEST_CASE("plugin.target_throttle.in_and_out") {
  FakeQemu q;
  FormatNodeOptions given;
  given.discard = "unmap";
  auto r = insert_target_throttle(q.qmp(), "/s/base.qcow2", given, "77-1", 4u << 20);
  REQUIRE(std::holds_alternative<TargetThrottle>(r));
  TargetThrottle t = std::get<TargetThrottle>(r);
  CHECK(t.nodes.format_node == "libvirt-1-format");
  CHECK(t.nodes.file_node == "libvirt-1-storage");
  // The base's format node reads through the filter, the filter from the base's file node.
  CHECK(q.nodes["libvirt-1-format"].children["file"] == "qcommit-tf-77-1");
  CHECK(q.nodes["qcommit-tf-77-1"].children["file"] == "libvirt-1-storage");
  CHECK(q.groups["qcommit-tg-77-1"] == 4u << 20);
  // The reopen named the node's options as they were: read-write, O_DIRECT, no backing.
  const json::Value& o = q.nodes["libvirt-1-format"].opened;
  CHECK(json::string_member(o, "discard") == "unmap");
  CHECK(o.at("backing").is_null());
  CHECK(o.at("cache").at("direct").get<bool>());
  CHECK_FALSE(set_target_throttle(q.qmp(), t, 9u << 20).has_value());
  CHECK(q.groups["qcommit-tg-77-1"] == 9u << 20);
  CHECK(t.bytes_per_s == 9u << 20);
  CHECK_FALSE(remove_target_throttle(q.qmp(), t, given).has_value());
  CHECK(q.nodes["libvirt-1-format"].children["file"] == "libvirt-1-storage");
  CHECK(q.nodes.count("qcommit-tf-77-1") == 0);
  CHECK(q.groups.empty());
}

TEST_CASE("plugin.target_throttle.middle_of_a_chain_keeps_its_backing") {
  // Committing the top into the middle layer: the middle's reopen names its own backing.
  FakeQemu q;
  auto r = insert_target_throttle(q.qmp(), "/s/top.qcow2", FormatNodeOptions{}, "1-2", 1u << 20);
  REQUIRE(std::holds_alternative<TargetThrottle>(r));
  CHECK(q.nodes["libvirt-2-format"].children["backing"] == "libvirt-1-format");
  CHECK(json::string_member(q.nodes["libvirt-2-format"].opened, "backing") == "libvirt-1-format");
  CHECK(json::string_member(q.nodes["libvirt-2-format"].opened, "discard") == "ignore");
}

TEST_CASE("plugin.target_throttle.a_failed_step_leaves_nothing") {
  for (const char* step : {"blockdev-add", "blockdev-reopen"}) {
    CAPTURE(step);
    FakeQemu q;
    q.refuse.insert(step);
    auto r = insert_target_throttle(q.qmp(), "/s/base.qcow2", FormatNodeOptions{}, "5-1", 1u << 20);
    REQUIRE(std::holds_alternative<std::string>(r));
    CHECK(std::get<std::string>(r).rfind(std::string(step) + ": ", 0) == 0);
    CHECK(q.nodes.count("qcommit-tf-5-1") == 0);
    CHECK(q.groups.empty());
    CHECK(q.nodes["libvirt-1-format"].children["file"] == "libvirt-1-storage");
  }
}

TEST_CASE("plugin.target_throttle.no_node_to_put_it_under") {
  // libvirt 11 opens a raw image without a format node: the job writes to the protocol node.
  FakeQemu q;
  q.nodes.erase("libvirt-1-format");
  q.nodes["libvirt-2-format"].children["backing"] = "libvirt-1-storage";
  q.nodes["libvirt-1-storage"].file = "/s/base.raw";
  auto r = insert_target_throttle(q.qmp(), "/s/base.raw", FormatNodeOptions{}, "1-1", 1u << 20);
  REQUIRE(std::holds_alternative<std::string>(r));
  CHECK(std::get<std::string>(r) == "no format node of /s/base.raw in QEMU");
  CHECK(q.groups.empty());
  // An unknown format driver is refused, not reopened with guessed options.
  FakeQemu q2;
  q2.nodes["libvirt-1-format"].drv = "vmdk";
  auto r2 = insert_target_throttle(q2.qmp(), "/s/base.qcow2", FormatNodeOptions{}, "1-1", 1u << 20);
  REQUIRE(std::holds_alternative<std::string>(r2));
  CHECK(std::get<std::string>(r2).find("is vmdk") != std::string::npos);
}

TEST_CASE("plugin.target_throttle.removal_after_libvirt_reopened_the_node") {
  // A cancelled commit: libvirt reopened the base read-only with its own file node, leaving the
  // filter without a parent.  Removal deletes the filter and group without reopening the node
  // (which would make it read-write again).
  FakeQemu q;
  auto r = insert_target_throttle(q.qmp(), "/s/base.qcow2", FormatNodeOptions{}, "3-1", 1u << 20);
  REQUIRE(std::holds_alternative<TargetThrottle>(r));
  q.nodes["libvirt-1-format"].children["file"] = "libvirt-1-storage";
  q.nodes["libvirt-1-format"].ro = true;
  const std::size_t before = q.commands.size();
  CHECK_FALSE(remove_target_throttle(q.qmp(), std::get<TargetThrottle>(r), {}).has_value());
  for (std::size_t i = before; i < q.commands.size(); ++i)
    CHECK(q.commands[i] != "blockdev-reopen");
  CHECK(q.nodes["libvirt-1-format"].ro);
  CHECK(q.nodes.count("qcommit-tf-3-1") == 0);
  CHECK(q.groups.empty());
}

TEST_CASE("plugin.target_throttle.orphans_of_dead_processes_removed") {
  // A qcommitd killed with its filter in (pid 4000001, gone) left it under the base, which after
  // the pivot meters the guest's own writes; another process's live filter stays.
  FakeQemu q;
  q.add_filter("qcommit-tf-4000001-3", "qcommit-tg-4000001-3", "libvirt-1-format", 1u << 20);
  q.add_filter("qcommit-tf-77-1", "qcommit-tg-77-1", "libvirt-2-format", 1u << 20);
  const auto alive = [](long pid) { return pid == 77; };
  const auto options = [](const std::string& file) -> std::optional<FormatNodeOptions> {
    if (file == "/s/base.qcow2") return FormatNodeOptions{"unmap"};
    return std::nullopt;
  };
  const std::vector<std::string> said = remove_orphan_throttles(q.qmp(), alive, options);
  REQUIRE(said.size() == 1);
  CHECK(said[0] ==
        "removed qcommit-tf-4000001-3 (left by process 4000001) from under libvirt-1-format");
  CHECK(q.nodes["libvirt-1-format"].children["file"] == "libvirt-1-storage");
  CHECK(json::string_member(q.nodes["libvirt-1-format"].opened, "discard") == "unmap");
  // Set unlimited before the reopen (which waits for what the filter holds).
  const auto set = std::find(q.commands.begin(), q.commands.end(), "qom-set");
  const auto reopen = std::find(q.commands.begin(), q.commands.end(), "blockdev-reopen");
  CHECK(set < reopen);
  CHECK(q.unlimited_before_reopen);
  CHECK(q.nodes.count("qcommit-tf-4000001-3") == 0);
  CHECK(q.groups.count("qcommit-tg-4000001-3") == 0);
  CHECK(q.nodes["libvirt-2-format"].children["file"] == "qcommit-tf-77-1");
  CHECK(q.groups.count("qcommit-tg-77-1") == 1);
  // Under a node whose options are not known: left in, and said so.
  FakeQemu q2;
  q2.add_filter("qcommit-tf-4000001-1", "qcommit-tg-4000001-1", "libvirt-2-format", 1u << 20);
  const std::vector<std::string> said2 = remove_orphan_throttles(q2.qmp(), alive, options);
  REQUIRE(said2.size() == 1);
  CHECK(said2[0].find("options are not known, left in") != std::string::npos);
  CHECK(q2.nodes["libvirt-2-format"].children["file"] == "qcommit-tf-4000001-1");
}

TEST_CASE("plugin.target_throttle.lone_groups_of_dead_processes_removed") {
  // A process that died between object-add and blockdev-add left a group without a filter; a
  // live process's group in the same state (it may be putting its filter in now) stays, and so
  // does a dead process's group whose filter could not be taken out.
  FakeQemu q;
  q.groups["qcommit-tg-4000001-2"] = 1u << 20;  // dead, no filter
  q.groups["qcommit-tg-77-4"] = 1u << 20;       // alive, no filter yet
  q.add_filter("qcommit-tf-4000002-1", "qcommit-tg-4000002-1", "libvirt-2-format", 1u << 20);
  const auto alive = [](long pid) { return pid == 77; };
  const auto options = [](const std::string&) -> std::optional<FormatNodeOptions> {
    return std::nullopt;  // libvirt-2's options are not known: that filter stays in
  };
  const std::vector<std::string> said = remove_orphan_throttles(q.qmp(), alive, options);
  REQUIRE(said.size() == 2);
  CHECK(said[0].find("qcommit-tf-4000002-1") != std::string::npos);
  CHECK(said[1] ==
        "removed the lone throttle group qcommit-tg-4000001-2 (left by process 4000001)");
  CHECK(q.groups.count("qcommit-tg-4000001-2") == 0);
  CHECK(q.groups.count("qcommit-tg-77-4") == 1);
  CHECK(q.groups.count("qcommit-tg-4000002-1") == 1);
  CHECK(q.nodes.count("qcommit-tf-4000002-1") == 1);
}

}  // namespace qcommit::plugin::test
