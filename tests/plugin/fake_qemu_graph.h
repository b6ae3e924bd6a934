// SPDX-License-Identifier: GPL-2.0-or-later
// A model of QEMU's block graph answering the QMP commands plugin/target_throttle sends, checking
// each as QEMU would (names that exist, a node in use not deleted, a reopen naming every option
// the node was opened with).  Two layers as libvirt opens them, cache=none: protocol and format
// node each, and the mirror_top filter of an active commit.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "plugin/govern/target_throttle.h"

namespace qcommit::plugin::test {

struct Node {
  std::string drv;
  std::string file;  // filename
  bool ro = false;
  bool direct = true;
  std::string detect_zeroes = "off";
  std::map<std::string, std::string> children;  // edge name → node name
  json::Value opened;                           // options of its last open/reopen
  std::string group;                            // throttle nodes
};

struct FakeQemu {
  std::map<std::string, Node> nodes;
  std::map<std::string, std::uint64_t> groups;  // id → bps-write
  std::vector<std::string> commands;
  std::set<std::string> refuse;  // commands answered with an error
  // A reopen took a filter out whose group was unlimited (bps-write 0) at that moment.
  bool unlimited_before_reopen = false;

  explicit FakeQemu(const std::string& base = "/s/base.qcow2",
                    const std::string& top = "/s/top.qcow2") {
    nodes["libvirt-1-storage"] = Node{"file", base, false, true, "off", {}, {}, {}};
    nodes["libvirt-1-format"] =
        Node{"qcow2", base, false, true, "off", {{"file", "libvirt-1-storage"}}, {}, {}};
    nodes["libvirt-2-storage"] = Node{"file", top, false, true, "off", {}, {}, {}};
    nodes["libvirt-2-format"] =
        Node{"qcow2", top,   false,
             true,    "off", {{"file", "libvirt-2-storage"}, {"backing", "libvirt-1-format"}},
             {},      {}};
    nodes["#block123"] =
        Node{"mirror_top", top, false, true, "off", {{"backing", "libvirt-2-format"}}, {}, {}};
  }

  // A filter `name` with group `group` between the format node `format` and its file node, as a
  // qcommit process puts it in.
  void add_filter(const std::string& name, const std::string& group, const std::string& format,
                  std::uint64_t bytes_per_s) {
    groups[group] = bytes_per_s;
    nodes[name] = Node{
        "throttle", "", false, true, "off", {{"file", nodes[format].children["file"]}}, {}, group};
    nodes[format].children["file"] = name;
  }

  json::Value named() const {
    json::Value out = json::Value::array();
    for (const auto& [name, n] : nodes) {
      json::Value v = json::Value::object();
      v["node-name"] = name;
      v["drv"] = n.drv;
      // QEMU names a node through its children: a format node over a filter no longer reports
      // the image's path (QEMU 10.0.13 in the lab: the base was not found by it), a filter
      // reports its child's.
      auto f = n.children.find("file");
      if (n.drv == "throttle")
        v["file"] = nodes.at(f->second).file;
      else if (f != n.children.end() && nodes.at(f->second).drv == "throttle")
        v["file"] = "json:{\"driver\": \"" + n.drv + "\", \"file\": {\"driver\": \"throttle\"}}";
      else
        v["file"] = n.file;
      v["ro"] = n.ro;
      v["detect_zeroes"] = n.detect_zeroes;
      json::Value c = json::Value::object();
      c["writeback"] = true;
      c["direct"] = n.direct;
      c["no-flush"] = false;
      v["cache"] = c;
      out.push_back(v);
    }
    return out;
  }
  json::Value graph() const {
    json::Value g = json::Value::object();
    g["nodes"] = json::Value::array();
    g["edges"] = json::Value::array();
    std::map<std::string, int> id;
    int next = 1;
    for (const auto& [name, n] : nodes) {
      id[name] = next++;
      json::Value v = json::Value::object();
      v["id"] = id[name];
      v["type"] = "block-driver";
      v["name"] = name;
      g["nodes"].push_back(v);
    }
    for (const auto& [name, n] : nodes)
      for (const auto& [edge, child] : n.children) {
        json::Value e = json::Value::object();
        e["parent"] = id[name];
        e["child"] = id.at(child);
        e["name"] = edge;
        g["edges"].push_back(e);
      }
    return g;
  }
  int parents(const std::string& name) const {
    int k = 0;
    for (const auto& [_, n] : nodes)
      for (const auto& [edge, child] : n.children) k += child == name;
    return k;
  }

  std::optional<json::Value> call(std::string_view command, const json::Value& a,
                                  std::string* error) {
    commands.emplace_back(command);
    auto fail = [error](std::string e) -> std::optional<json::Value> {
      *error = std::move(e);
      return std::nullopt;
    };
    if (refuse.count(std::string(command))) return fail("refused by the test");
    if (command == "query-named-block-nodes") return named();
    if (command == "x-debug-query-block-graph") return graph();
    if (command == "qom-list") {  // /objects: the groups, and one object not ours
      if (json::string_member(a, "path") != "/objects") return fail("path not found");
      json::Value list = json::Value::array();
      json::Value other = json::Value::object();
      other["name"] = "iothread0";
      other["type"] = "child<iothread>";
      list.push_back(other);
      for (const auto& [id, _] : groups) {
        json::Value o = json::Value::object();
        o["name"] = id;
        o["type"] = "child<throttle-group>";
        list.push_back(o);
      }
      return list;
    }
    if (command == "object-add") {
      const std::string id = json::string_member(a, "id");
      if (groups.count(id)) return fail("duplicate ID '" + id + "'");
      groups[id] = a.at("limits").at("bps-write").get<std::uint64_t>();
      return json::Value::object();
    }
    if (command == "object-del") {
      const std::string id = json::string_member(a, "id");
      if (!groups.count(id)) return fail("object '" + id + "' not found");
      for (const auto& [_, n] : nodes)
        if (n.group == id) return fail("object '" + id + "' is in use");
      groups.erase(id);
      return json::Value::object();
    }
    if (command == "qom-set") {
      const std::string id = json::string_member(a, "path");
      if (!groups.count(id)) return fail("Device '" + id + "' not found");
      groups[id] = a.at("value").at("bps-write").get<std::uint64_t>();
      return json::Value::object();
    }
    if (command == "blockdev-add") {
      const std::string name = json::string_member(a, "node-name");
      if (nodes.count(name)) return fail("Duplicate nodes with node-name='" + name + "'");
      if (!groups.count(json::string_member(a, "throttle-group")))
        return fail("Throttle group not found");
      const std::string file = json::string_member(a, "file");
      if (!nodes.count(file)) return fail("Cannot find device='' nor node-name='" + file + "'");
      nodes[name] = Node{"throttle", "",
                         false,      true,
                         "off",      {{"file", file}},
                         a,          json::string_member(a, "throttle-group")};
      return json::Value::object();
    }
    if (command == "blockdev-del") {
      const std::string name = json::string_member(a, "node-name");
      if (!nodes.count(name)) return fail("Failed to find node with node-name='" + name + "'");
      if (parents(name) > 0) return fail("Node " + name + " is in use");
      nodes.erase(name);
      return json::Value::object();
    }
    if (command == "blockdev-reopen") {
      const json::Value& o = a.at("options").at(0);
      const std::string name = json::string_member(o, "node-name");
      if (!nodes.count(name)) return fail("Cannot find node named '" + name + "'");
      Node& n = nodes[name];
      // Every option the node was opened with must be named again (an option left out returns
      // to its default).
      for (const char* k : {"driver", "read-only", "cache", "detect-zeroes", "discard", "file"})
        if (!o.contains(k)) return fail(std::string("option '") + k + "' missing in the test");
      if (n.drv == "qcow2" && !o.contains("backing")) return fail("backing missing in the test");
      if (json::string_member(o, "driver") != n.drv) return fail("Cannot change the driver");
      if (o.at("read-only").get<bool>() != n.ro) return fail("read-only changed in the test");
      if (o.at("cache").at("direct").get<bool>() != n.direct) return fail("cache changed");
      if (json::string_member(o, "detect-zeroes") != n.detect_zeroes) return fail("dz changed");
      const std::string file = json::string_member(o, "file");
      if (auto old = n.children.find("file"); old != n.children.end() &&
                                              nodes[old->second].drv == "throttle" &&
                                              groups[nodes[old->second].group] == 0)
        unlimited_before_reopen = true;
      if (!nodes.count(file)) return fail("Cannot find node named '" + file + "'");
      n.children["file"] = file;
      if (n.drv == "qcow2") {
        const json::Value& b = o.at("backing");
        if (b.is_null())
          n.children.erase("backing");
        else
          n.children["backing"] = b.get<std::string>();
      }
      n.opened = o;
      return json::Value::object();
    }
    return fail("The command " + std::string(command) + " has not been found");
  }
  QmpCall qmp() {
    return
        [this](std::string_view c, const json::Value& a, std::string* e) { return call(c, a, e); };
  }
};

}  // namespace qcommit::plugin::test
