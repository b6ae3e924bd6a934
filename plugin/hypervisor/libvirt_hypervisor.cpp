// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/hypervisor/libvirt_hypervisor.h"

#include <fcntl.h>
#include <libvirt/libvirt-qemu.h>
#include <libvirt/virterror.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>

#include "plugin/policy/config.h"
#include "plugin/hypervisor/libvirt_handles.h"
#include "plugin/host/mono_clock.h"
#include "plugin/hypervisor/overlay_file.h"
#include "plugin/host/xml.h"

namespace qcommit::plugin {
namespace {

using lv::CString;
using lv::Domain;
using lv::Pool;
using lv::Vol;

void silent_error(void*, virErrorPtr) {}

JobType job_type(int t) {
  switch (t) {
    case VIR_DOMAIN_BLOCK_JOB_TYPE_PULL:
      return JobType::Pull;
    case VIR_DOMAIN_BLOCK_JOB_TYPE_COPY:
      return JobType::Copy;
    case VIR_DOMAIN_BLOCK_JOB_TYPE_COMMIT:
      return JobType::Commit;
    case VIR_DOMAIN_BLOCK_JOB_TYPE_ACTIVE_COMMIT:
      return JobType::ActiveCommit;
    case VIR_DOMAIN_BLOCK_JOB_TYPE_BACKUP:
      return JobType::Backup;
    default:
      return JobType::Unknown;
  }
}

void on_block_job(virConnectPtr, virDomainPtr dom, const char* disk, int type, int status,
                  void* opaque) {
  JobEvent e;
  switch (status) {
    case VIR_DOMAIN_BLOCK_JOB_COMPLETED:
      e.kind = JobEventKind::Completed;
      break;
    case VIR_DOMAIN_BLOCK_JOB_FAILED:
      e.kind = JobEventKind::Failed;
      break;
    case VIR_DOMAIN_BLOCK_JOB_CANCELED:
      e.kind = JobEventKind::Canceled;
      break;
    case VIR_DOMAIN_BLOCK_JOB_READY:
      e.kind = JobEventKind::Ready;
      break;
    default:
      return;
  }
  const char* name = virDomainGetName(dom);
  e.domain = name ? name : "";
  e.disk = disk ? disk : "";
  e.type = job_type(type);
  static_cast<LibvirtHypervisor*>(opaque)->deliver(e);
}

// QEMU's JOB_STATUS_CHANGE through libvirt's monitor event passthrough: `details` is the event's
// data ({"id": ..., "status": ...}), `seconds`/`micros` QEMU's timestamp (host realtime).
void on_qemu_event(virConnectPtr, virDomainPtr dom, const char* event, long long seconds,
                   unsigned int micros, const char* details, void* opaque) {
  JobEvent e;
  e.kind = JobEventKind::StatusChange;
  const char* name = virDomainGetName(dom);
  e.domain = name ? name : "";
  e.detail = std::string(event ? event : "") + " " + (details ? details : "");
  if (details) {
    const std::optional<json::Value> data =
        json::parse<json::Value>(details, json::kQmpLimits, nullptr);
    const std::string status = data ? json::string_member(*data, "status") : std::string();
    e.started = status == "created" || status == "running";
  }
  if (seconds > 0) e.at = mono_of_realtime_us(seconds * 1000000 + micros);
  static_cast<LibvirtHypervisor*>(opaque)->deliver(e);
}

void on_close(virConnectPtr, int, void* opaque) {
  static_cast<LibvirtHypervisor*>(opaque)->mark_closed();
}

// --- domain XML disks ---------------------------------------------------------------------
// A <source>'s path: file= for files, dev= for block devices ("" for network and volume disks).
std::string source_path(xmlNodePtr source) {
  std::string p = xml::attr(source, "file");
  return p.empty() ? xml::attr(source, "dev") : p;
}

// The iothread of a <driver>: its iothread= (virtio-blk, virtio-scsi controllers), or the first of
// its <iothreads> mapping (virtio-blk with several); "" when it names none.
std::string driver_iothread(xmlNodePtr driver) {
  std::string id = xml::attr(driver, "iothread");
  return id.empty() ? xml::attr(xml::child(xml::child(driver, "iothreads"), "iothread"), "id") : id;
}

// The iothread serving a disk ("" when QEMU's main loop does): the disk's own, or for a disk on
// a SCSI bus that of the controller its <address> names (index 0 when it names none).
std::string disk_iothread(xmlDocPtr doc, xmlNodePtr disk, xmlNodePtr driver) {
  if (std::string id = driver_iothread(driver); !id.empty()) return id;
  if (xml::attr(xml::child(disk, "target"), "bus") != "scsi") return {};
  std::string index = xml::attr(xml::child(disk, "address"), "controller");
  if (index.empty()) index = "0";
  for (xmlNodePtr c : xml::select(doc, "/domain/devices/controller[@type='scsi']"))
    if (xml::attr(c, "index") == index) return driver_iothread(xml::child(c, "driver"));
  return {};
}

// Whether the disk's format nodes were opened with nothing beyond what QEMU reports back and
// <driver discard>: a <driver> with only the usual attributes and no elements, a <source> (and
// every <backingStore>'s) without slices, encryption or reservations.
bool format_options_known(xmlDocPtr doc, xmlNodePtr disk, xmlNodePtr driver) {
  static const std::set<std::string> plain = {
      "name",     "type",         "cache",         "io",          "discard", "detect_zeroes",
      "iothread", "error_policy", "rerror_policy", "copy_on_read"};
  if (driver) {
    for (xmlAttrPtr a = driver->properties; a; a = a->next)
      if (!plain.count(reinterpret_cast<const char*>(a->name))) return false;
    if (!xml::children(driver).empty()) return false;
  }
  return xml::select(doc,
                     "descendant::source/slices | descendant::encryption | "
                     "descendant::source/reservations",
                     disk)
      .empty();
}

DiskInfo parse_disk(xmlDocPtr doc, xmlNodePtr disk) {
  DiskInfo d;
  const xmlNodePtr driver = xml::child(disk, "driver");
  d.cache = xml::attr(driver, "cache");
  d.format = xml::attr(driver, "type");
  d.io = xml::attr(driver, "io");
  d.discard = xml::attr(driver, "discard");
  d.format_options_known = format_options_known(doc, disk, driver);
  d.iothread = disk_iothread(doc, disk, driver);
  d.target = xml::attr(xml::child(disk, "target"), "dev");
  d.source = source_path(xml::child(disk, "source"));
  // The chain nests one <backingStore> in the next, top to bottom (a mirror's own chain is not
  // the disk's).
  for (xmlNodePtr s :
       xml::select(doc, "backingStore/descendant-or-self::backingStore/source", disk))
    if (std::string p = source_path(s); !p.empty()) d.backing_chain.push_back(p);
  if (const xmlNodePtr mirror = xml::child(disk, "mirror")) {
    std::string p = source_path(xml::child(mirror, "source"));
    if (p.empty()) p = xml::attr(mirror, "file");  // old-style <mirror file=...>
    if (!p.empty()) d.mirror = p;
  }
  return d;
}

std::string pool_target_path(const std::string& text) {
  const xml::Doc doc = xml::parse(text);
  return xml::text(xml::first(doc.get(), "/pool/target/path"));
}

PoolInfo pool_info(virStoragePoolPtr p) {
  PoolInfo info;
  const char* name = virStoragePoolGetName(p);
  info.name = name ? name : "";
  char uuid[VIR_UUID_STRING_BUFLEN];
  if (virStoragePoolGetUUIDString(p, uuid) == 0) info.uuid = uuid;
  CString xml(virStoragePoolGetXMLDesc(p, 0));
  if (xml) info.target_path = pool_target_path(xml.get());
  return info;
}

}  // namespace

std::string disk_only_snapshot_xml(const std::vector<DiskInfo>& disks, const std::string& disk,
                                   const std::string& overlay_path) {
  const xml::Doc doc = xml::new_document("domainsnapshot");
  const xmlNodePtr list = xml::add_child(xml::root(doc.get()), "disks");
  for (const auto& dk : disks) {
    const xmlNodePtr d = xml::add_child(list, "disk");
    xml::set_attr(d, "name", dk.target);
    if (dk.target != disk) {
      xml::set_attr(d, "snapshot", "no");
      continue;
    }
    xml::set_attr(d, "snapshot", "external");
    xml::set_attr(d, "type", "file");
    xml::set_attr(xml::add_child(d, "driver"), "type", "qcow2");
    xml::set_attr(xml::add_child(d, "source"), "file", overlay_path);
  }
  return xml::dump_element(xml::root(doc.get()));
}

namespace {

// Every <disk device='disk'> of the definition, in order (source "" when it has no local path).
std::vector<DiskInfo> defined_disks(xmlDocPtr doc) {
  std::vector<DiskInfo> disks;
  for (xmlNodePtr n : xml::select(doc, "/domain/devices/disk[not(@device) or @device='disk']"))
    disks.push_back(parse_disk(doc, n));
  return disks;
}

// The disks with a target and a local path, each with its filesystem's device where it can be
// read from cached attributes (cached_storage_device).
std::vector<DiskInfo> local_disks(const std::vector<DiskInfo>& defined) {
  std::vector<DiskInfo> disks;
  for (DiskInfo d : defined) {
    if (d.target.empty() || d.source.empty()) continue;
    d.device = cached_storage_device(d.source);
    disks.push_back(std::move(d));
  }
  return disks;
}

}  // namespace

DomainInfo parse_domain_xml(const std::string& text) {
  const xml::Doc doc = xml::parse(text);
  DomainInfo info;
  info.defined_disks = defined_disks(doc.get());
  info.disks = local_disks(info.defined_disks);
  info.iothreads = xml::first(doc.get(), "/domain/iothreads") != nullptr;
  return info;
}

std::vector<DiskInfo> parse_domain_disks(const std::string& text) {
  return parse_domain_xml(text).disks;
}

LibvirtHypervisor::LibvirtHypervisor(std::string uri, Access access)
    : uri_(std::move(uri)), access_(access) {
  virSetErrorFunc(nullptr, silent_error);
}

LibvirtHypervisor::~LibvirtHypervisor() {
  disconnect();
}

void LibvirtHypervisor::disconnect() {
  if (!conn_) return;
  if (block_job_cb_ >= 0) virConnectDomainEventDeregisterAny(conn_, block_job_cb_);
  if (qemu_cb_ >= 0) virConnectDomainQemuMonitorEventDeregister(conn_, qemu_cb_);
  virConnectUnregisterCloseCallback(conn_, on_close);
  virConnectClose(conn_);
  conn_ = nullptr;
  block_job_cb_ = qemu_cb_ = -1;
}

bool LibvirtHypervisor::connect() {
  disconnect();
  closed_ = false;
  conn_ = access_ == Access::kReadOnly ? virConnectOpenReadOnly(uri_.c_str())
                                       : virConnectOpen(uri_.c_str());
  if (!conn_) {
    virErrorPtr e = virGetLastError();
    last_error_ = e && e->message ? e->message : "cannot connect";
    return false;
  }
  unsigned long version = 0;  // the qemu driver's: QEMU's
  qemu_version_ = virConnectGetVersion(conn_, &version) == 0 && version > 0
                      ? std::optional<std::uint64_t>(version)
                      : std::nullopt;
  virConnectRegisterCloseCallback(conn_, on_close, this, nullptr);
  if (access_ == Access::kReadOnly) return true;
  virConnectSetKeepAlive(conn_, 5, 3);
  block_job_cb_ =
      virConnectDomainEventRegisterAny(conn_, nullptr, VIR_DOMAIN_EVENT_ID_BLOCK_JOB_2,
                                       VIR_DOMAIN_EVENT_CALLBACK(on_block_job), this, nullptr);
  // No taint: unlike virDomainQemuMonitorCommand, libvirt's qemu driver only checks the ACL and
  // registers the callback (qemuConnectDomainQemuMonitorEventRegister).
  qemu_cb_ = virConnectDomainQemuMonitorEventRegister(conn_, nullptr, "JOB_STATUS_CHANGE",
                                                      on_qemu_event, this, nullptr, 0);
  job_events_error_.clear();
  if (qemu_cb_ < 0) {
    virErrorPtr e = virGetLastError();
    job_events_error_ = e && e->message ? e->message : "registration refused";
  }
  return true;
}

bool LibvirtHypervisor::connected() const {
  return conn_ && !closed_ && virConnectIsAlive(conn_) == 1;
}

void LibvirtHypervisor::throw_disconnected() {
  throw HypervisorDisconnected(uri_ + ": connection to libvirtd lost");
}

void LibvirtHypervisor::check_alive() {
  if (!connected()) throw_disconnected();
}

std::vector<DomainInfo> LibvirtHypervisor::running_domains() {
  check_alive();
  virDomainPtr* list = nullptr;
  const int n = virConnectListAllDomains(conn_, &list, VIR_CONNECT_LIST_DOMAINS_ACTIVE);
  if (n < 0) {
    check_alive();
    return {};
  }
  std::vector<Domain> doms = lv::take_list<Domain>(list, n);
  std::vector<DomainInfo> out;
  for (auto& d : doms) {
    if (auto info = describe(d.get())) out.push_back(std::move(*info));
  }
  return out;
}

std::optional<DomainInfo> LibvirtHypervisor::describe(virDomainPtr d) {
  const char* name = virDomainGetName(d);
  if (!name) return std::nullopt;
  CString xml(virDomainGetXMLDesc(d, 0));
  if (!xml) return std::nullopt;  // domain went away
  DomainInfo info = parse_domain_xml(xml.get());
  info.name = name;
  char uuid[VIR_UUID_STRING_BUFLEN];
  if (virDomainGetUUIDString(d, uuid) == 0) info.uuid = uuid;
  CString meta(virDomainGetMetadata(d, VIR_DOMAIN_METADATA_ELEMENT, kMetadataNamespace, 0));
  if (meta) info.policy_xml = meta.get();
  return info;
}

void LibvirtHypervisor::throw_job_error(const std::string& what) {
  // Before check_alive: its call into libvirt resets the last error.
  virErrorPtr e = virGetLastError();
  const std::string message = e && e->message ? e->message : "failed";
  check_alive();
  throw BlockJobError(what + ": " + message);
}

std::optional<DomainInfo> LibvirtHypervisor::domain(const std::string& name) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, name.c_str()));
  if (!d) {
    check_alive();
    return std::nullopt;
  }
  return describe(d.get());
}

std::optional<DomainInfo> LibvirtHypervisor::running_domain(const std::string& name) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, name.c_str()));
  if (!d || virDomainIsActive(d.get()) != 1) {
    check_alive();
    return std::nullopt;
  }
  return describe(d.get());
}

void LibvirtHypervisor::start_commit(const std::string& domain, const std::string& disk,
                                     const std::string& base, const std::string& top,
                                     std::uint64_t bandwidth_bytes_per_s, bool active) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) throw_job_error(domain);
  unsigned int flags = VIR_DOMAIN_BLOCK_COMMIT_BANDWIDTH_BYTES;
  if (active) flags |= VIR_DOMAIN_BLOCK_COMMIT_ACTIVE;
  if (virDomainBlockCommit(d.get(), disk.c_str(), base.c_str(), top.c_str(), bandwidth_bytes_per_s,
                           flags) < 0)
    throw_job_error(domain + " " + disk + ": block commit of " + top + " into " + base);
}

void LibvirtHypervisor::create_overlay(const std::string& domain, const std::string& disk,
                                       const std::string& overlay_path) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) throw_job_error(domain);
  std::optional<DomainInfo> info = describe(d.get());
  if (!info) throw_job_error(domain);
  const std::string what = domain + " " + disk + ": external overlay " + overlay_path;
  refuse_existing_overlay(what, overlay_path);
  // Our own overlay with lazy refcounts (see create_fresh_overlay) when qemu-img can make it;
  // otherwise libvirt creates a plain one.
  unsigned int reuse = 0;
  virDomainBlockInfo bi{};
  for (const auto& dk : info->disks) {
    if (dk.target != disk || dk.format.empty()) continue;
    if (virDomainGetBlockInfo(d.get(), disk.c_str(), &bi, 0) < 0 || bi.capacity == 0) {
      check_alive();
      break;
    }
    if (create_fresh_overlay(overlay_path, dk.source, dk.format, bi.capacity).empty())
      reuse = VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT;
  }
  const std::string xml = disk_only_snapshot_xml(info->disks, disk, overlay_path);
  virDomainSnapshotPtr snap = virDomainSnapshotCreateXML(
      d.get(), xml.c_str(),
      VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY | VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA |
          VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC | reuse);
  if (!snap) {
    if (reuse) ::unlink(overlay_path.c_str());  // ours, and libvirt did not take it
    throw_job_error(what);
  }
  lv::Snapshot release(snap);
}

bool LibvirtHypervisor::pivot(const std::string& domain, const std::string& disk) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) throw_job_error(domain);
  if (virDomainBlockJobAbort(d.get(), disk.c_str(), VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT) == 0)
    return true;
  // The error is read before check_alive, whose call into libvirt resets it: read after it, a
  // job not ready for the pivot yet (libvirt has not taken QEMU's ready event in, though the
  // job's figures already say ready) was a failure ("pivot: failed") instead of a retry.
  virErrorPtr e = virGetLastError();
  if (!e || e->code != VIR_ERR_BLOCK_COPY_ACTIVE) throw_job_error(domain + " " + disk + ": pivot");
  check_alive();
  return false;  // not ready yet
}

void LibvirtHypervisor::remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    throw BlockJobError(path + ": cannot remove: " + std::strerror(errno));
}

std::vector<PoolInfo> LibvirtHypervisor::pools() {
  check_alive();
  virStoragePoolPtr* list = nullptr;
  const int n = virConnectListAllStoragePools(conn_, &list, VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE);
  if (n < 0) {
    check_alive();
    return {};
  }
  std::vector<Pool> pools = lv::take_list<Pool>(list, n);
  std::vector<PoolInfo> out;
  for (auto& p : pools) out.push_back(pool_info(p.get()));
  return out;
}

std::optional<PoolInfo> LibvirtHypervisor::pool_of_volume(const std::string& path) {
  check_alive();
  Vol vol(virStorageVolLookupByPath(conn_, path.c_str()));
  if (!vol) {
    check_alive();
    return std::nullopt;
  }
  Pool pool(virStoragePoolLookupByVolume(vol.get()));
  if (!pool) return std::nullopt;
  return pool_info(pool.get());
}

std::optional<BlockStats> LibvirtHypervisor::block_stats(const std::string& domain,
                                                         const std::string& disk) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) {
    check_alive();
    return std::nullopt;
  }
  int n = 0;
  if (virDomainBlockStatsFlags(d.get(), disk.c_str(), nullptr, &n, 0) < 0 || n <= 0) {
    check_alive();
    return std::nullopt;
  }
  std::vector<virTypedParameter> params(static_cast<size_t>(n));
  if (virDomainBlockStatsFlags(d.get(), disk.c_str(), params.data(), &n, 0) < 0) {
    check_alive();
    return std::nullopt;
  }
  BlockStats s;
  for (int i = 0; i < n; ++i) {
    const virTypedParameter& p = params[static_cast<size_t>(i)];
    std::int64_t v = 0;
    if (p.type == VIR_TYPED_PARAM_LLONG)
      v = p.value.l;
    else if (p.type == VIR_TYPED_PARAM_ULLONG)
      v = static_cast<std::int64_t>(p.value.ul);
    else
      continue;
    const std::string f = p.field;
    if (f == VIR_DOMAIN_BLOCK_STATS_WRITE_REQ)
      s.wr_reqs = v;
    else if (f == VIR_DOMAIN_BLOCK_STATS_WRITE_TOTAL_TIMES)
      s.wr_total_times_ns = v;
    else if (f == VIR_DOMAIN_BLOCK_STATS_FLUSH_REQ)
      s.flush_reqs = v;
    else if (f == VIR_DOMAIN_BLOCK_STATS_FLUSH_TOTAL_TIMES)
      s.flush_total_times_ns = v;
    else if (f == VIR_DOMAIN_BLOCK_STATS_WRITE_BYTES)
      s.wr_bytes = v;
  }
  return s;
}

std::optional<JobInfo> LibvirtHypervisor::job_info(const std::string& domain,
                                                   const std::string& disk) {
  JobQuery q = query_job(domain, disk);
  if (q.state != JobQuery::State::kRunning) return std::nullopt;
  return q.info;
}

JobQuery LibvirtHypervisor::query_job(const std::string& domain, const std::string& disk) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) {
    check_alive();
    return {};  // no such domain (it stopped): no job
  }
  virDomainBlockJobInfo info{};
  const int rc = virDomainGetBlockJobInfo(d.get(), disk.c_str(), &info,
                                          VIR_DOMAIN_BLOCK_JOB_INFO_BANDWIDTH_BYTES);
  if (rc < 0) {
    // A domain that is no longer running has no jobs; any other failure tells nothing.  (The
    // error is read first: check_alive's call into libvirt resets it.)
    virErrorPtr e = virGetLastError();
    const bool gone = e && (e->code == VIR_ERR_NO_DOMAIN || e->code == VIR_ERR_OPERATION_INVALID);
    check_alive();
    return JobQuery{gone ? JobQuery::State::kNone : JobQuery::State::kUnknown, {}};
  }
  if (rc == 0) return {};
  JobQuery q;
  q.state = JobQuery::State::kRunning;
  q.info.type = job_type(info.type);
  q.info.cur = info.cur;
  q.info.end = info.end;
  q.info.bandwidth_bytes_per_s = info.bandwidth;
  return q;
}

bool LibvirtHypervisor::set_job_speed(const std::string& domain, const std::string& disk,
                                      std::uint64_t bytes_per_s) {
  if (bytes_per_s == 0) return false;  // 0 would mean unlimited
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) {
    check_alive();
    return false;
  }
  if (virDomainBlockJobSetSpeed(d.get(), disk.c_str(), bytes_per_s,
                                VIR_DOMAIN_BLOCK_JOB_SPEED_BANDWIDTH_BYTES) < 0) {
    check_alive();
    return false;
  }
  return true;
}

// Through libvirt's QEMU monitor passthrough (libvirt-qemu): libvirt marks the domain tainted
// ("custom-monitor") in its log the first time.
std::optional<json::Value> LibvirtHypervisor::qmp_command(const std::string& domain,
                                                          std::string_view command,
                                                          const json::Value& args,
                                                          std::string* error) {
  check_alive();
  Domain d(virDomainLookupByName(conn_, domain.c_str()));
  if (!d) {
    check_alive();
    *error = "no running domain " + domain;
    return std::nullopt;
  }
  json::Value cmd = json::Value::object();
  cmd["execute"] = std::string(command);
  cmd["arguments"] = args;
  char* reply = nullptr;
  if (virDomainQemuMonitorCommand(d.get(), json::dump(cmd).c_str(), &reply, 0) < 0) {
    const virErrorPtr e = virGetLastError();  // before check_alive, which resets it
    *error = e && e->message ? e->message : "libvirt refused the monitor command";
    check_alive();
    return std::nullopt;
  }
  const std::string text = reply ? reply : "";
  std::free(reply);
  const std::optional<json::Value> r = json::parse<json::Value>(text, json::kQmpLimits, error);
  if (!r) return std::nullopt;
  if (const json::Value* ret = json::member(*r, "return")) return *ret;
  const json::Value* err = json::member(*r, "error");
  *error = err ? json::string_member(*err, "desc") : "no return in QEMU's reply";
  if (error->empty()) *error = "QEMU refused the command";
  return std::nullopt;
}

}  // namespace qcommit::plugin
