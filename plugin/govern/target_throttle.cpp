// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/target_throttle.h"

#include <cstdlib>
#include <map>
#include <vector>

namespace qcommit::plugin {

namespace {

// Format drivers whose node this reopens: their options beyond the generic ones (qcow2's cache
// sizes, raw's offset/size) are not reported by QEMU, and the caller vouches that the node was
// opened without them (FormatNodeOptions, DiskInfo::format_options_known).
bool known_format(const std::string& drv) {
  return drv == "qcow2" || drv == "raw";
}

const json::Value* find_named(const json::Value& named_nodes, const std::string& name) {
  if (!named_nodes.is_array()) return nullptr;
  for (const json::Value& n : named_nodes)
    if (n.is_object() && json::string_member(n, "node-name") == name) return &n;
  return nullptr;
}

// One edge of x-debug-query-block-graph with its ends as node names ("" for an id the graph does
// not list), and whether its parent is a node (not a block backend or job).
struct Edge {
  std::string parent;
  bool parent_is_node = false;
  std::string child;
  std::string name;  // "file", "backing", ...
};

// The graph's edges whose child is a listed node.
std::vector<Edge> edges_of(const json::Value& graph) {
  std::vector<Edge> out;
  const json::Value* nodes = json::member(graph, "nodes");
  const json::Value* edges = json::member(graph, "edges");
  if (!nodes || !edges || !nodes->is_array() || !edges->is_array()) return out;
  std::map<std::int64_t, std::pair<std::string, bool>> names;  // id -> name, is a node
  for (const json::Value& n : *nodes) {
    const json::Value* id = json::member(n, "id");
    if (const std::optional<std::int64_t> v = id ? json::to_int64(*id) : std::nullopt)
      names[*v] = {json::string_member(n, "name"),
                   json::string_member(n, "type") == "block-driver"};
  }
  for (const json::Value& e : *edges) {
    const json::Value* p = json::member(e, "parent");
    const json::Value* c = json::member(e, "child");
    const std::optional<std::int64_t> pv = p ? json::to_int64(*p) : std::nullopt;
    const std::optional<std::int64_t> cv = c ? json::to_int64(*c) : std::nullopt;
    if (!pv || !cv || !names.count(*cv)) continue;
    const auto parent = names.find(*pv);
    out.push_back(Edge{parent == names.end() ? "" : parent->second.first,
                       parent != names.end() && parent->second.second, names[*cv].first,
                       json::string_member(e, "name")});
  }
  return out;
}

// The graph's children of the node named `parent`, by edge name ("file", "backing"), as node
// names.
std::map<std::string, std::string> children_of(const json::Value& graph,
                                               const std::string& parent) {
  std::map<std::string, std::string> out;
  for (const Edge& e : edges_of(graph))
    if (e.parent_is_node && e.parent == parent) out[e.name] = e.child;
  return out;
}

// The node whose `edge` child is `child` (node names), when there is one.
std::optional<std::string> parent_of(const json::Value& graph, const std::string& child,
                                     std::string_view edge) {
  for (const Edge& e : edges_of(graph))
    if (e.child == child && e.name == edge) return e.parent;
  return std::nullopt;
}

bool bool_member(const json::Value& v, std::string_view key) {
  const json::Value* m = json::member(v, key);
  return m && m->is_boolean() && m->get<bool>();
}

// The reopen options of a format node as it is open now (without `file`).
json::Value reopen_options(const json::Value& node, const std::map<std::string, std::string>& kids,
                           const FormatNodeOptions& given) {
  json::Value o = json::Value::object();
  const std::string drv = json::string_member(node, "drv");
  o["driver"] = drv;
  o["node-name"] = json::string_member(node, "node-name");
  o["read-only"] = bool_member(node, "ro");
  const json::Value* cache = json::member(node, "cache");
  json::Value c = json::Value::object();
  c["direct"] = cache ? bool_member(*cache, "direct") : false;
  c["no-flush"] = cache ? bool_member(*cache, "no-flush") : false;
  o["cache"] = c;
  const std::string dz = json::string_member(node, "detect_zeroes");
  o["detect-zeroes"] = dz.empty() ? "off" : dz;
  o["discard"] = given.discard;
  if (drv == "qcow2") {
    auto b = kids.find("backing");
    o["backing"] = b == kids.end() ? json::Value(nullptr) : json::Value(b->second);
  }
  return o;
}

std::optional<json::Value> call(const QmpCall& qmp, std::string_view command,
                                const json::Value& args, std::string* error) {
  std::string e;
  std::optional<json::Value> r = qmp(command, args, &e);
  if (!r) *error = std::string(command) + ": " + e;
  return r;
}

// QEMU's block nodes (query-named-block-nodes, flat) and the edges between them
// (x-debug-query-block-graph), read one after the other.
struct BlockGraph {
  json::Value named;
  json::Value graph;
};

std::optional<BlockGraph> read_graph(const QmpCall& qmp, std::string* error) {
  json::Value flat = json::Value::object();
  flat["flat"] = true;
  std::optional<json::Value> named = call(qmp, "query-named-block-nodes", flat, error);
  if (!named) return std::nullopt;
  std::optional<json::Value> graph =
      call(qmp, "x-debug-query-block-graph", json::Value::object(), error);
  if (!graph) return std::nullopt;
  return BlockGraph{std::move(*named), std::move(*graph)};
}

json::Value reopen_args(const TargetNodes& n, const std::string& file) {
  json::Value o = n.reopen_options;
  o["file"] = file;
  json::Value args = json::Value::object();
  args["options"] = json::Value::array({o});
  return args;
}

}  // namespace

std::variant<TargetNodes, std::string> find_target_nodes(const json::Value& named_nodes,
                                                         const json::Value& graph,
                                                         const std::string& target_path,
                                                         const FormatNodeOptions& given) {
  if (!named_nodes.is_array()) return std::string("query-named-block-nodes: not a list");
  std::vector<const json::Value*> formats;
  for (const json::Value& n : named_nodes) {
    if (!n.is_object() || json::string_member(n, "file") != target_path) continue;
    const std::string drv = json::string_member(n, "drv");
    if (drv == "file" || drv == "host_device" || drv == "mirror_top" || drv == "commit_top" ||
        drv == "throttle")
      continue;
    formats.push_back(&n);
  }
  if (formats.empty()) return "no format node of " + target_path + " in QEMU";
  if (formats.size() > 1) return "more than one format node of " + target_path + " in QEMU";
  const json::Value& fmt = *formats.front();
  const std::string name = json::string_member(fmt, "node-name");
  const std::string drv = json::string_member(fmt, "drv");
  if (!known_format(drv)) return "the format node " + name + " of " + target_path + " is " + drv;
  const std::map<std::string, std::string> kids = children_of(graph, name);
  for (const auto& [role, child] : kids)
    if (role != "file" && role != "backing")
      return "the format node " + name + " has a '" + role + "' child";
  auto file = kids.find("file");
  if (file == kids.end()) return "the format node " + name + " has no file child";
  const json::Value* fnode = find_named(named_nodes, file->second);
  if (!fnode || json::string_member(*fnode, "file") != target_path)
    return "the file child " + file->second + " of " + name + " is not " + target_path;
  const std::string fdrv = json::string_member(*fnode, "drv");
  if (fdrv != "file" && fdrv != "host_device")
    return "the file child " + file->second + " of " + name + " is " + fdrv;
  return TargetNodes{name, file->second, reopen_options(fmt, kids, given)};
}

json::Value throttle_limits(std::uint64_t bytes_per_s) {
  json::Value l = json::Value::object();
  l["bps-write"] = bytes_per_s;
  return l;
}

std::variant<TargetThrottle, std::string> insert_target_throttle(const QmpCall& qmp,
                                                                 const std::string& target_path,
                                                                 const FormatNodeOptions& given,
                                                                 const std::string& tag,
                                                                 std::uint64_t bytes_per_s) {
  std::string error;
  const std::optional<BlockGraph> g = read_graph(qmp, &error);
  if (!g) return error;
  const json::Value* named = &g->named;
  const json::Value* graph = &g->graph;
  auto found = find_target_nodes(*named, *graph, target_path, given);
  if (auto* e = std::get_if<std::string>(&found)) return *e;
  TargetThrottle t{std::get<TargetNodes>(std::move(found)), "qcommit-tg-" + tag,
                   "qcommit-tf-" + tag, bytes_per_s};

  json::Value group = json::Value::object();
  group["qom-type"] = "throttle-group";
  group["id"] = t.group_id;
  group["limits"] = throttle_limits(bytes_per_s);
  if (!call(qmp, "object-add", group, &error)) return error;
  json::Value del_group = json::Value::object();
  del_group["id"] = t.group_id;

  json::Value filter = json::Value::object();
  filter["driver"] = "throttle";
  filter["node-name"] = t.filter_node;
  filter["throttle-group"] = t.group_id;
  filter["file"] = t.nodes.file_node;
  if (!call(qmp, "blockdev-add", filter, &error)) {
    std::string ignored;
    (void)call(qmp, "object-del", del_group, &ignored);
    return error;
  }
  if (!call(qmp, "blockdev-reopen", reopen_args(t.nodes, t.filter_node), &error)) {
    std::string ignored;
    json::Value del_node = json::Value::object();
    del_node["node-name"] = t.filter_node;
    (void)call(qmp, "blockdev-del", del_node, &ignored);
    (void)call(qmp, "object-del", del_group, &ignored);
    return error;
  }
  return t;
}

std::optional<std::string> set_target_throttle(const QmpCall& qmp, TargetThrottle& t,
                                               std::uint64_t bytes_per_s) {
  json::Value args = json::Value::object();
  args["path"] = t.group_id;
  args["property"] = "limits";
  args["value"] = throttle_limits(bytes_per_s);
  std::string error;
  if (!call(qmp, "qom-set", args, &error)) return error;
  t.bytes_per_s = bytes_per_s;
  return std::nullopt;
}

std::optional<std::string> remove_target_throttle(const QmpCall& qmp, const TargetThrottle& t,
                                                  const FormatNodeOptions& given) {
  std::string error;
  const std::optional<BlockGraph> g = read_graph(qmp, &error);
  if (!g) return error;
  const json::Value* named = &g->named;
  const json::Value* graph = &g->graph;
  // The node as it is now (the pivot may have made it the guest's active layer; libvirt may have
  // reopened it read-only after a cancelled job, with its own file node, leaving the filter
  // without a parent): reopened only while the filter is still its file child.
  const json::Value* fmt = find_named(*named, t.nodes.format_node);
  const std::map<std::string, std::string> kids =
      fmt ? children_of(*graph, t.nodes.format_node) : std::map<std::string, std::string>{};
  if (auto f = kids.find("file"); fmt && f != kids.end() && f->second == t.filter_node) {
    TargetNodes now{t.nodes.format_node, t.nodes.file_node, reopen_options(*fmt, kids, given)};
    if (!call(qmp, "blockdev-reopen", reopen_args(now, t.nodes.file_node), &error)) return error;
  }
  json::Value del_node = json::Value::object();
  del_node["node-name"] = t.filter_node;
  if (!call(qmp, "blockdev-del", del_node, &error)) return error;
  json::Value del_group = json::Value::object();
  del_group["id"] = t.group_id;
  if (!call(qmp, "object-del", del_group, &error)) return error;
  return std::nullopt;
}

namespace {

constexpr std::string_view kFilterPrefix = "qcommit-tf-";
constexpr std::string_view kGroupPrefix = "qcommit-tg-";

// The process a qcommit name (PREFIX + PID-N) was made by, when it has that prefix.
std::optional<long> maker_of(const std::string& name, std::string_view prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
  if (pid <= 0) return std::nullopt;
  return pid;
}

// Takes one orphaned filter `name` (tag PID-N) out of its parent's file edge and deletes it with
// its group; the line to log.
std::string remove_orphan_filter(
    const QmpCall& qmp, const BlockGraph& g, const std::string& name, long pid,
    const std::function<std::optional<FormatNodeOptions>(const std::string&)>& options_for) {
  const std::string tag = name.substr(kFilterPrefix.size());
  const std::string group = std::string(kGroupPrefix) + tag;
  const std::string by = " (left by process " + std::to_string(pid) + ")";
  std::string error;
  const std::optional<std::string> parent = parent_of(g.graph, name, "file");
  if (parent) {
    // The parent's own filename names its child (the filter) now: the image's path is the
    // filter's child's.
    const std::map<std::string, std::string> own = children_of(g.graph, name);
    const json::Value* fmt = find_named(g.named, *parent);
    auto child = own.find("file");
    const json::Value* storage = child == own.end() ? nullptr : find_named(g.named, child->second);
    const std::optional<FormatNodeOptions> given =
        fmt && storage ? options_for(json::string_member(*storage, "file")) : std::nullopt;
    if (!fmt || child == own.end() || !given)
      return name + by + " under " + *parent + ": its options are not known, left in";
    // What the filter holds goes first, unmetered: the reopen drains the node, and with it the
    // guest's disk, until the filter has let out everything queued at its last rate (in the
    // lab, 1.8 s without a probe completion before this).
    json::Value unlimited = json::Value::object();
    unlimited["path"] = group;
    unlimited["property"] = "limits";
    unlimited["value"] = throttle_limits(0);
    std::string ignored;
    (void)call(qmp, "qom-set", unlimited, &ignored);
    const TargetNodes now{*parent, child->second,
                          reopen_options(*fmt, children_of(g.graph, *parent), *given)};
    if (!call(qmp, "blockdev-reopen", reopen_args(now, child->second), &error))
      return name + ": " + error;
  }
  json::Value del_node = json::Value::object();
  del_node["node-name"] = name;
  json::Value del_group = json::Value::object();
  del_group["id"] = group;
  if (!call(qmp, "blockdev-del", del_node, &error) || !call(qmp, "object-del", del_group, &error))
    return name + ": " + error;
  return "removed " + name + by + (parent ? " from under " + *parent : "");
}

// Deletes the throttle groups of gone processes that no filter uses (a process that died between
// object-add and blockdev-add); one line each.  A group still in use stays (QEMU refuses).
std::vector<std::string> remove_lone_groups(const QmpCall& qmp, const BlockGraph& g,
                                            const std::function<bool(long)>& alive) {
  std::vector<std::string> out;
  std::string error;
  const std::optional<json::Value> objects =
      call(qmp, "qom-list", json::Value{{"path", "/objects"}}, &error);
  if (!objects) return {"qom-list /objects: " + error};
  if (!objects->is_array()) return {"qom-list /objects: not a list"};
  for (const json::Value& o : *objects) {
    const std::string id = json::string_member(o, "name");
    const std::optional<long> pid = maker_of(id, kGroupPrefix);
    if (json::string_member(o, "type") != "child<throttle-group>" || !pid || alive(*pid)) continue;
    const std::string filter = std::string(kFilterPrefix) + id.substr(kGroupPrefix.size());
    if (find_named(g.named, filter)) continue;  // its filter is there: removed with it or left
    if (!call(qmp, "object-del", json::Value{{"id", id}}, &error)) {
      out.push_back(id + ": " + error);
      continue;
    }
    out.push_back("removed the lone throttle group " + id + " (left by process " +
                  std::to_string(*pid) + ")");
  }
  return out;
}

}  // namespace

std::vector<std::string> remove_orphan_throttles(
    const QmpCall& qmp, const std::function<bool(long)>& alive,
    const std::function<std::optional<FormatNodeOptions>(const std::string&)>& options_for) {
  std::string error;
  const std::optional<BlockGraph> g = read_graph(qmp, &error);
  if (!g) return {error};
  if (!g->named.is_array()) return {"query-named-block-nodes: not a list"};
  std::vector<std::string> out;
  for (const json::Value& n : g->named) {
    const std::string name = json::string_member(n, "node-name");
    const std::optional<long> pid = maker_of(name, kFilterPrefix);
    if (json::string_member(n, "drv") != "throttle" || !pid || alive(*pid)) continue;
    out.push_back(remove_orphan_filter(qmp, *g, name, *pid, options_for));
  }
  // A filter removed above took its group along; one left in keeps it.
  for (std::string& line : remove_lone_groups(qmp, *g, alive)) out.push_back(std::move(line));
  return out;
}

}  // namespace qcommit::plugin
