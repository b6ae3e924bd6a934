// SPDX-License-Identifier: GPL-2.0-or-later
// QmpHypervisor: the Hypervisor interface over one QEMU's QMP socket (the answers' parsers are
// qmp_parse.cpp's).
#include "plugin/hypervisor/qmp_hypervisor.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "plugin/host/mono_clock.h"
#include "plugin/hypervisor/overlay_file.h"
#include "plugin/hypervisor/qemu_cmdline.h"

namespace qcommit::plugin {
namespace {

bool finished(const QmpJob& j) {
  return j.status == "concluded" || j.status == "null";
}

}  // namespace

// --- QmpHypervisor -----------------------------------------------------------------------------

QmpHypervisor::QmpHypervisor(std::string socket_path, std::string name, QmpOptions opt)
    : path_(std::move(socket_path)),
      name_(std::move(name)),
      name_given_(!name_.empty()),
      opt_(opt) {}

bool QmpHypervisor::connect() {
  client_.reset();
  try {
    client_ = std::make_unique<QmpClient>(QmpClient::connect(path_, opt_));
  } catch (const QmpError& e) {
    last_error_ = e.what();
    return false;
  }
  if (!name_given_) {
    try {
      const json::Value r = call("query-name");
      name_ = json::string_member(r, "name");
    } catch (const QmpCommandError&) {
      name_.clear();
    } catch (const HypervisorDisconnected&) {
      return false;
    }
    if (name_.empty()) name_ = name_from_socket(path_);
  }
  qemu_version_.reset();
  try {
    const json::Value r = call("query-version");
    if (const json::Value* q = json::member(r, "qemu"))
      qemu_version_ = json::uint64_member(*q, "major") * 1000000 + json::uint64_member(*q, "minor") * 1000 +
                      json::uint64_member(*q, "micro");
  } catch (const QmpCommandError&) {
  } catch (const HypervisorDisconnected&) {
    return false;
  }
  return true;
}

bool QmpHypervisor::connected() const {
  return client_ && client_->is_open();
}

json::Value QmpHypervisor::call(const char* command, const json::Value& args) {
  if (!connected()) throw HypervisorDisconnected(path_ + ": not connected to QEMU");
  try {
    json::Value r = client_->execute(command, args);
    absorb_events();
    return r;
  } catch (const QmpError& e) {
    last_error_ = e.what();
    client_.reset();
    throw HypervisorDisconnected(e.what());
  } catch (const QmpCommandError&) {
    absorb_events();
    throw;
  }
}

void QmpHypervisor::absorb_events() {
  if (!client_) return;
  for (const auto& e : client_->take_queued_events()) note_event(e);
}

void QmpHypervisor::note_event(const QmpEvent& e) {
  JobEvent je;
  je.domain = name_;
  const std::string& id =
      e.name == "JOB_STATUS_CHANGE" ? json::string_member(e.data, "id") : json::string_member(e.data, "device");
  if (auto it = job_disk_.find(id); it != job_disk_.end()) {
    je.disk = it->second;
  } else {
    for (const auto& d : disks_cache_)
      if (!d.device.empty() && d.device == id) je.disk = d.info.target;
  }
  std::optional<bool> active;
  if (auto it = jobs_.find(je.disk); it != jobs_.end() && it->second.id == id)
    active = it->second.active;
  je.type = job_type_of(json::string_member(e.data, "type"), e.name == "BLOCK_JOB_READY", active);
  if (e.timestamp_us > 0) je.at = mono_of_realtime_us(e.timestamp_us);
  if (e.name == "JOB_STATUS_CHANGE") {
    je.kind = JobEventKind::StatusChange;
    const std::string& status = json::string_member(e.data, "status");
    je.detail = id + " " + status;
    je.started = status == "created" || status == "running";
  } else if (e.name == "BLOCK_JOB_READY") {
    je.kind = JobEventKind::Ready;
    je.detail = id;
  } else if (e.name == "BLOCK_JOB_COMPLETED") {
    const std::string& err = json::string_member(e.data, "error");
    je.kind = err.empty() ? JobEventKind::Completed : JobEventKind::Failed;
    je.detail = err.empty() ? id : id + ": " + err;
    if (!err.empty()) last_job_error_ = "job " + id + " failed: " + err;
  } else if (e.name == "BLOCK_JOB_CANCELLED") {
    je.kind = JobEventKind::Canceled;
    je.detail = id;
    last_job_error_ = "job " + id + " was cancelled";
  } else if (e.name == "BLOCK_JOB_ERROR") {
    je.kind = JobEventKind::StatusChange;
    je.detail =
        id + " error " + json::string_member(e.data, "operation") + " " + json::string_member(e.data, "action");
    last_job_error_ = "job " + id + ": I/O error on " + json::string_member(e.data, "operation") +
                      " (action " + json::string_member(e.data, "action") + ")";
  } else {
    return;
  }
  pending_.push_back(std::move(je));
}

void QmpHypervisor::pump(std::chrono::milliseconds wait) {
  if (connected()) {
    try {
      for (const auto& e : client_->take_events(wait)) note_event(e);
    } catch (const QmpError& e) {
      last_error_ = e.what();
      client_.reset();
    }
  } else {
    std::this_thread::sleep_for(wait);
  }
  std::vector<JobEvent> events;
  events.swap(pending_);
  if (sink_)
    for (const auto& e : events) sink_(e);
}

std::vector<QmpDisk> QmpHypervisor::disks() {
  try {
    disks_cache_ = parse_query_block(call("query-block"));
  } catch (const QmpCommandError&) {
    disks_cache_.clear();
  }
  return disks_cache_;
}

std::optional<QmpDisk> QmpHypervisor::find_disk(const std::string& name, bool cached) {
  if (cached)
    for (const auto& d : disks_cache_)
      if (d.info.target == name) return d;
  for (auto& d : disks())
    if (d.matches(name)) return d;
  return std::nullopt;
}

QmpDisk QmpHypervisor::require_disk(const std::string& domain, const std::string& disk) {
  if (!ours(domain))
    throw BlockJobError(domain + ": not the QEMU on " + path_ + " (" + name_ + ")");
  std::optional<QmpDisk> d = find_disk(disk, false);
  if (!d) throw BlockJobError(domain + ": no disk '" + disk + "' in query-block of " + path_);
  return *d;
}

std::optional<QmpJob> QmpHypervisor::job_of(const std::string& target, const QmpDisk* disk) {
  std::vector<QmpJob> list;
  try {
    list = parse_block_jobs(call("query-block-jobs"));
  } catch (const QmpCommandError&) {
    return std::nullopt;
  }
  const auto our = jobs_.find(target);
  const QmpJob* found = nullptr;
  for (const auto& j : list) {
    const bool mine = our != jobs_.end() && j.id == our->second.id;
    const bool default_id = disk && !disk->device.empty() && j.id == disk->device;
    const auto seen = job_disk_.find(j.id);
    if (mine || default_id || (seen != job_disk_.end() && seen->second == target)) {
      found = &j;
      if (mine) break;
    }
  }
  if (!found) return std::nullopt;
  job_disk_[found->id] = target;
  if (finished(*found)) {
    // Only a job started with auto-dismiss=false stays concluded; ours never do, but a job
    // that has ended is gone for the Hypervisor interface either way.
    if (!found->auto_dismiss && our != jobs_.end() && found->id == our->second.id) {
      try {
        (void)call("job-dismiss", json::Value::object({{"id", found->id}}));
      } catch (const QmpCommandError&) {
      }
    }
    return std::nullopt;
  }
  return *found;
}

std::vector<DomainInfo> QmpHypervisor::running_domains() {
  DomainInfo dom;
  dom.name = name_;
  std::vector<QmpDisk> ds = disks();
  std::vector<QmpJob> list;
  try {
    list = parse_block_jobs(call("query-block-jobs"));
  } catch (const QmpCommandError&) {
  }
  for (auto& d : ds) {
    const auto our = jobs_.find(d.info.target);
    for (const auto& j : list) {
      if (finished(j)) continue;
      if (our != jobs_.end() && j.id == our->second.id) {
        if (our->second.active) d.info.mirror = our->second.base;
      } else if (!d.device.empty() && j.id == d.device && (j.type == "mirror" || j.ready)) {
        d.info.mirror = "";  // a mirror we did not start: its target is unknown
      }
    }
    dom.disks.push_back(d.info);
  }
  return {dom};
}

std::optional<json::Value> QmpHypervisor::qom_get(const std::string& path, const char* property) {
  try {
    return call("qom-get", json::Value::object({{"path", path}, {"property", property}}));
  } catch (const QmpCommandError&) {
    return std::nullopt;
  }
}

std::string QmpHypervisor::device_iothread(const std::string& qdev) {
  if (qdev.empty()) return "";
  const std::string path = qdev[0] == '/' ? qdev : "/machine/peripheral/" + qdev;
  const std::optional<json::Value> link = qom_get(path, "iothread");
  const std::optional<json::Value> mapping = qom_get(path, "iothread-vq-mapping");
  if (link || mapping) {
    const std::string id = link ? iothread_of_property(*link) : "";
    return id.empty() && mapping ? iothread_of_property(*mapping) : id;
  }
  // A device on a controller's bus: the bus is a child of the controller's QOM object.
  const std::optional<json::Value> bus = qom_get(path, "parent_bus");
  if (!bus || !bus->is_string()) return "";
  const std::string& bus_path = bus->get_ref<const std::string&>();
  const auto slash = bus_path.rfind('/');
  if (slash == std::string::npos || slash == 0) return "";
  const std::optional<json::Value> controller = qom_get(bus_path.substr(0, slash), "iothread");
  return controller ? iothread_of_property(*controller) : "";
}

void QmpHypervisor::add_iothreads(DomainInfo& dom) {
  try {
    dom.iothreads = !parse_iothreads(call("query-iothreads")).empty();
  } catch (const QmpCommandError&) {
    dom.iothreads = false;
  }
  for (DiskInfo& info : dom.disks)
    if (const QmpDisk* d = cached_disk(info.target)) info.iothread = device_iothread(d->qdev);
}

void QmpHypervisor::add_io_modes(DomainInfo& dom) {
  const std::optional<pid_t> pid = client_ ? client_->peer_pid() : std::nullopt;
  const QemuCommandLine cl = pid ? parse_qemu_command_line(read_cmdline(*pid)) : QemuCommandLine{};
  for (DiskInfo& info : dom.disks) {
    const QmpDisk* d = cached_disk(info.target);
    const std::optional<std::string> aio =
        d ? aio_of(cl, DiskNames{d->device, qdev_id(d->qdev), d->root_node}) : std::nullopt;
    info.io = aio.value_or("");
    info.io_known = aio.has_value();
  }
}

const QmpDisk* QmpHypervisor::cached_disk(const std::string& target) const {
  for (const QmpDisk& d : disks_cache_)
    if (d.info.target == target) return &d;
  return nullptr;
}

std::optional<DomainInfo> QmpHypervisor::domain(const std::string& name) {
  if (!ours(name)) return std::nullopt;
  DomainInfo d = running_domains().front();
  add_iothreads(d);
  add_io_modes(d);
  d.defined_disks = d.disks;
  return d;
}

std::optional<std::string> QmpHypervisor::resolve_disk(const std::string& name) {
  std::optional<QmpDisk> d = find_disk(name, false);
  if (!d) return std::nullopt;
  return d->info.target;
}

std::optional<BlockStats> QmpHypervisor::block_stats(const std::string& domain,
                                                     const std::string& disk) {
  if (!ours(domain)) return std::nullopt;
  std::optional<QmpDisk> d = find_disk(disk, true);
  if (!d) return std::nullopt;
  try {
    return parse_blockstats(call("query-blockstats"), *d);
  } catch (const QmpCommandError&) {
    return std::nullopt;
  }
}

std::optional<JobInfo> QmpHypervisor::job_info(const std::string& domain, const std::string& disk) {
  if (!ours(domain)) return std::nullopt;
  std::optional<QmpDisk> d = find_disk(disk, true);
  const std::string target = d ? d->info.target : disk;
  std::optional<QmpJob> j = job_of(target, d ? &*d : nullptr);
  if (!j) return std::nullopt;
  std::optional<bool> active;
  if (auto it = jobs_.find(target); it != jobs_.end() && it->second.id == j->id)
    active = it->second.active;
  return to_job_info(*j, active);
}

bool QmpHypervisor::set_job_speed(const std::string& domain, const std::string& disk,
                                  std::uint64_t bytes_per_s) {
  if (bytes_per_s == 0 || !ours(domain)) return false;  // 0 would mean unlimited
  std::optional<QmpDisk> d = find_disk(disk, true);
  const std::string target = d ? d->info.target : disk;
  std::optional<QmpJob> j = job_of(target, d ? &*d : nullptr);
  if (!j) return false;
  try {
    (void)call("block-job-set-speed",
               json::Value::object({{"device", j->id}, {"speed", bytes_per_s}}));
  } catch (const QmpCommandError&) {
    return false;
  }
  return true;
}

void QmpHypervisor::start_commit(const std::string& domain, const std::string& disk,
                                 const std::string& base, const std::string& top,
                                 std::uint64_t bandwidth_bytes_per_s, bool active) {
  const QmpDisk d = require_disk(domain, disk);
  const std::string what = domain + " " + disk + ": block commit of " + top + " into " + base;
  std::vector<std::string> chain{d.info.source};
  chain.insert(chain.end(), d.info.backing_chain.begin(), d.info.backing_chain.end());
  const auto ti = std::find(chain.begin(), chain.end(), top);
  const auto bi = std::find(chain.begin(), chain.end(), base);
  if (ti == chain.end()) throw BlockJobError(what + ": " + top + " is not in the disk's chain");
  if (bi == chain.end()) throw BlockJobError(what + ": " + base + " is not in the disk's chain");
  if (bi <= ti) throw BlockJobError(what + ": " + base + " is not below " + top);
  if ((ti == chain.begin()) != active)
    throw BlockJobError(what + ": " + top + (active ? " is not" : " is") + " the active layer");
  std::vector<QmpNode> nodes;
  try {
    nodes = parse_named_block_nodes(
        call("query-named-block-nodes", json::Value::object({{"flat", true}})));
  } catch (const QmpCommandError& e) {
    throw BlockJobError(what + ": " + e.description);
  }
  const auto ti_n = static_cast<std::size_t>(ti - chain.begin());
  const auto bi_n = static_cast<std::size_t>(bi - chain.begin());
  const std::string top_node = ti_n == 0 ? d.root_node : node_of(nodes, top, d.formats.at(ti_n));
  const std::string base_node = node_of(nodes, base, d.formats.at(bi_n));
  if (top_node.empty()) throw BlockJobError(what + ": no unique block node for " + top);
  if (base_node.empty()) throw BlockJobError(what + ": no unique block node for " + base);
  const std::string id = qcommit_job_id(d.info.target);
  json::Value args = json::Value::object({{"job-id", id},
                                          {"device", d.qmp_device()},
                                          {"top-node", top_node},
                                          {"base-node", base_node}});
  if (bandwidth_bytes_per_s > 0) args["speed"] = bandwidth_bytes_per_s;
  // Known before the command: its JOB_STATUS_CHANGE events arrive ahead of the reply.
  jobs_[d.info.target] = OurJob{id, active, top, base, false};
  job_disk_[id] = d.info.target;
  try {
    (void)call("block-commit", args);
  } catch (const QmpCommandError& e) {
    jobs_.erase(d.info.target);
    throw BlockJobError(what + ": " + e.description);
  }
}

void QmpHypervisor::create_overlay(const std::string& domain, const std::string& disk,
                                   const std::string& overlay_path) {
  const QmpDisk d = require_disk(domain, disk);
  const std::string what = domain + " " + disk + ": external overlay " + overlay_path;
  refuse_existing_overlay(what, overlay_path);
  // Node names: at most 31 characters, a letter first.
  const std::string node =
      "qcommit-" + std::to_string(::getpid()) + "-" + std::to_string(++overlay_counter_);
  // Our own overlay with lazy refcounts (see create_fresh_overlay) when qemu-img can make it
  // (mode existing); else QEMU creates a plain one.
  const bool ours =
      !d.info.format.empty() && d.virtual_size > 0 &&
      create_fresh_overlay(overlay_path, d.info.source, d.info.format, d.virtual_size).empty();
  json::Value args = json::Value::object({{"snapshot-file", overlay_path},
                                          {"snapshot-node-name", node},
                                          {"format", "qcow2"},
                                          {"mode", ours ? "existing" : "absolute-paths"}});
  if (!d.device.empty())
    args["device"] = d.device;
  else
    args["node-name"] = d.root_node;
  try {
    (void)call("blockdev-snapshot-sync", args);
  } catch (const QmpCommandError& e) {
    if (ours) ::unlink(overlay_path.c_str());
    throw BlockJobError(what + ": " + e.description);
  }
}

bool QmpHypervisor::pivot(const std::string& domain, const std::string& disk) {
  QmpDisk d = require_disk(domain, disk);
  const std::string what = domain + " " + disk + ": pivot";
  auto it = jobs_.find(d.info.target);
  if (it == jobs_.end() || !it->second.active)
    throw BlockJobError(what + ": no active commit started by qcommit on this disk");
  OurJob& o = it->second;
  std::optional<QmpJob> j = job_of(d.info.target, &d);
  if (!o.complete_sent) {
    if (!j)
      throw BlockJobError(what + ": the active commit of " + o.top + " ended before the pivot" +
                          (last_job_error_.empty() ? "" : " (" + last_job_error_ + ")"));
    if (!j->ready) return false;
    try {
      (void)call("block-job-complete", json::Value::object({{"device", j->id}}));
    } catch (const QmpCommandError& e) {
      std::optional<QmpJob> again = job_of(d.info.target, &d);
      if (again && !again->ready) return false;  // left ready again (guest writes): retry
      throw BlockJobError(what + ": " + e.description);
    }
    o.complete_sent = true;
    j = job_of(d.info.target, &d);
  }
  if (j) return false;  // completing
  d = require_disk(domain, disk);
  if (d.info.source != o.base)
    throw BlockJobError(what + " to " + o.base + " failed: the active layer is " + d.info.source +
                        (last_job_error_.empty() ? "" : " (" + last_job_error_ + ")"));
  jobs_.erase(it);
  return true;
}

void QmpHypervisor::remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    throw BlockJobError(path + ": cannot remove: " + std::strerror(errno));
}

}  // namespace qcommit::plugin
