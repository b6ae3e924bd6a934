// SPDX-License-Identifier: GPL-2.0-or-later
// Parsers of QEMU's QMP answers (query-block, query-named-block-nodes, query-iothreads,
// query-block-jobs, query-blockstats), one per answer, and the names qcommit gives what it
// finds there.
#include <algorithm>
#include <cstring>

#include "plugin/hypervisor/qmp_hypervisor.h"

namespace qcommit::plugin {

JobType job_type_of(const std::string& qmp_type, bool ready, std::optional<bool> active) {
  if (qmp_type == "commit") {
    if (active) return *active ? JobType::ActiveCommit : JobType::Commit;
    return ready ? JobType::ActiveCommit : JobType::Commit;
  }
  if (qmp_type == "mirror") return JobType::Copy;
  if (qmp_type == "stream") return JobType::Pull;
  if (qmp_type == "backup") return JobType::Backup;
  return JobType::Unknown;
}

std::string qdev_id(const std::string& qdev) {
  static const std::string kPeripheral = "/machine/peripheral/";
  if (qdev.empty()) return "";
  if (qdev[0] != '/') return qdev;
  if (qdev.rfind(kPeripheral, 0) != 0) return "";
  const std::string rest = qdev.substr(kPeripheral.size());
  return rest.substr(0, rest.find('/'));
}

bool QmpDisk::matches(const std::string& name) const {
  if (name.empty()) return false;
  return name == info.target || name == device || name == qdev || name == qdev_id(qdev) ||
         name == root_node || name == info.source;
}

std::vector<QmpDisk> parse_query_block(const json::Value& ret) {
  std::vector<QmpDisk> out;
  if (!ret.is_array()) return out;
  for (const auto& e : ret) {
    const json::Value* ins = json::member(e, "inserted");
    if (!ins || !ins->is_object()) continue;  // empty drive
    QmpDisk d;
    d.device = json::string_member(e, "device");
    d.qdev = json::string_member(e, "qdev");
    d.root_node = json::string_member(*ins, "node-name");
    const json::Value* img = json::member(*ins, "image");
    if (img && img->is_object()) {
      d.info.source = json::string_member(*img, "filename");
      d.formats.push_back(json::string_member(*img, "format"));
      d.virtual_size = json::uint64_member(*img, "virtual-size");
      for (const json::Value* b = json::member(*img, "backing-image"); b && b->is_object();
           b = json::member(*b, "backing-image")) {
        d.info.backing_chain.push_back(json::string_member(*b, "filename"));
        d.formats.push_back(json::string_member(*b, "format"));
      }
    } else {
      d.info.source = json::string_member(*ins, "file");
      d.formats.push_back(json::string_member(*ins, "drv"));
    }
    if (d.info.source.empty()) continue;
    d.info.format = d.formats.front();
    // libvirt's cache modes from the node's flags: none = direct + writeback, directsync = direct.
    if (const json::Value* c = json::member(*ins, "cache"); c && c->is_object()) {
      if (json::bool_member(*c, "direct", false))
        d.info.cache = json::bool_member(*c, "writeback", true) ? "none" : "directsync";
    }
    if (!d.device.empty())
      d.info.target = d.device;
    else if (!qdev_id(d.qdev).empty())
      d.info.target = qdev_id(d.qdev);
    else if (!d.qdev.empty())
      d.info.target = d.qdev;
    else
      d.info.target = d.root_node;
    if (d.info.target.empty()) continue;
    d.info.device = cached_storage_device(d.info.source);
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<QmpNode> parse_named_block_nodes(const json::Value& ret) {
  std::vector<QmpNode> out;
  if (!ret.is_array()) return out;
  for (const auto& e : ret) {
    QmpNode n{json::string_member(e, "node-name"), json::string_member(e, "file"), json::string_member(e, "drv")};
    if (!n.node_name.empty()) out.push_back(std::move(n));
  }
  return out;
}

std::vector<std::string> parse_iothreads(const json::Value& ret) {
  std::vector<std::string> ids;
  if (!ret.is_array()) return ids;
  for (const auto& e : ret)
    if (const std::string& id = json::string_member(e, "id"); !id.empty()) ids.push_back(id);
  return ids;
}

std::string iothread_of_property(const json::Value& value) {
  if (value.is_array())  // iothread-vq-mapping: [{"iothread": "iot1", "vqs": [...]}, ...]
    return value.empty() ? "" : json::string_member(value.front(), "iothread");
  if (!value.is_string()) return "";
  const std::string& path = value.get_ref<const std::string&>();  // a link: the QOM path
  return path.substr(path.rfind('/') + 1);
}

std::string node_of(const std::vector<QmpNode>& nodes, const std::string& filename,
                    const std::string& format) {
  std::string found;
  for (const auto& n : nodes) {
    if (n.file != filename || n.drv != format) continue;
    if (!found.empty()) return "";  // ambiguous
    found = n.node_name;
  }
  return found;
}

std::vector<QmpJob> parse_block_jobs(const json::Value& ret) {
  std::vector<QmpJob> out;
  if (!ret.is_array()) return out;
  for (const auto& e : ret) {
    QmpJob j;
    j.id = json::string_member(e, "device");
    if (j.id.empty()) continue;
    j.type = json::string_member(e, "type");
    j.status = json::string_member(e, "status");
    j.len = json::uint64_member(e, "len");
    j.offset = json::uint64_member(e, "offset");
    j.speed = json::uint64_member(e, "speed");
    j.ready = json::bool_member(e, "ready", false);
    j.auto_dismiss = json::bool_member(e, "auto-dismiss", true);
    j.error = json::string_member(e, "error");
    out.push_back(std::move(j));
  }
  return out;
}

std::optional<BlockStats> parse_blockstats(const json::Value& ret, const QmpDisk& disk) {
  if (!ret.is_array()) return std::nullopt;
  for (const auto& e : ret) {
    const std::string& dev = json::string_member(e, "device");
    const std::string& qdev = json::string_member(e, "qdev");
    const bool match = !disk.device.empty() ? dev == disk.device
                       : !disk.qdev.empty()
                           ? qdev == disk.qdev
                           : dev.empty() && json::string_member(e, "node-name") == disk.root_node;
    if (!match) continue;
    const json::Value* st = json::member(e, "stats");
    if (!st || !st->is_object()) return std::nullopt;
    BlockStats s;
    s.wr_reqs = json::int64_member(*st, "wr_operations");
    s.wr_total_times_ns = json::int64_member(*st, "wr_total_time_ns");
    s.flush_reqs = json::int64_member(*st, "flush_operations");
    s.flush_total_times_ns = json::int64_member(*st, "flush_total_time_ns");
    if (json::member(*st, "wr_bytes")) s.wr_bytes = json::int64_member(*st, "wr_bytes");
    return s;
  }
  return std::nullopt;
}

JobInfo to_job_info(const QmpJob& j, std::optional<bool> active) {
  JobInfo info;
  info.type = job_type_of(j.type, j.ready, active);
  info.bandwidth_bytes_per_s = j.speed;
  if (j.ready) {
    // Ready: libvirt reports cur == end (LiveMerge and the governor rely on it), also when QEMU
    // says 0/0 (nothing was left to copy).
    info.end = std::max<std::uint64_t>(j.len, 1);
    info.cur = info.end;
  } else {
    info.end = j.len;
    info.cur = std::min(j.offset, j.len);
    // A mirror that copied everything is not ready until QEMU says so.
    if ((info.type == JobType::ActiveCommit || info.type == JobType::Copy) && info.end > 0 &&
        info.cur == info.end)
      info.cur = info.end - 1;
  }
  return info;
}

std::string qcommit_job_id(const std::string& target) {
  std::string id = "qcommit-";
  for (char c : target) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    id += ok ? c : '_';
  }
  return id;
}

std::string name_from_socket(const std::string& path) {
  const auto slash = path.rfind('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (const auto dot = name.rfind('.'); dot != std::string::npos && dot > 0) name.resize(dot);
  return name.empty() ? path : name;
}

}  // namespace qcommit::plugin
