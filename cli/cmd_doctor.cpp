// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit doctor: what on this host makes snapshot merges stall guests, and what to change.
// Each finding carries its reason. Reads only: the domains through a hypervisor adapter (libvirt's
// definitions, or with --qmp one QEMU's monitor), /proc, /sys, versions.
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/daemon.h"
#include "cli/json.h"
#include "cli/options.h"
#include "cli/units.h"
#include "common/defaults.h"
#include "engine/mounts.h"
#include "engine/proc_walk.h"
#include "plugin/hypervisor/libvirt_hypervisor.h"
#include "plugin/host/process.h"
#include "plugin/hypervisor/qmp_hypervisor.h"
#include "plugin/govern/writeback.h"

namespace qcommit::cli {

using plugin::ProcessResult;
using plugin::run_process;

namespace {

inline constexpr double kAssumedSharedStorageBytesPerS = 100e6;  // a sync NFS export, per the users

struct Finding {
  std::string level;  // "ok", "warn", "info", or "skip" (a check that does not apply here)
  std::string subject;
  std::string text;
  std::string reason;
};

// How the findings name a disk's settings: in libvirt's domain XML, or as QEMU's own options
// (--qmp: a QEMU that libvirt does not manage).
struct Dialect {
  const char* writeback;        // a disk through the host page cache
  const char* direct_fix;       // the settings that open it with O_DIRECT instead
  const char* native_io;        // the io mode that keeps O_DIRECT requests in flight
  const char* no_iothreads;     // the domain has no iothread
  const char* other_iothreads;  // it has some, none for this disk
  const char* iothread_fix;     // how a disk gets one
};

constexpr Dialect kLibvirtXml{
    "cache mode is writeback (libvirt's default when none is set)",
    "cache='none' (io='native')",
    "io='native'",
    "the domain has no <iothreads>",
    "the domain has <iothreads> but none serves this disk",
    "<driver iothread='N'/> on a virtio disk or on its virtio-scsi controller"};

constexpr Dialect kQemuOptions{
    "cache mode is writeback (cache.direct=off)",
    "cache.direct=on (aio=native)",
    "aio=native",
    "QEMU has no iothread",
    "QEMU has iothreads but none serves this disk",
    "-object iothread,id=ID and iothread=ID on its virtio-blk device or on its virtio-scsi "
    "controller"};

uint64_t read_u64(const std::string& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  in >> v;
  return v;
}

uint64_t mem_total_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemTotal:") return kb * 1024;
  return 0;
}

// The disk's cache mode.
void check_cache(const plugin::DiskInfo& d, const std::string& subject, const Dialect& say,
                 std::vector<Finding>& out) {
  const std::string& cache = d.cache;
  if (cache.empty() || cache == "writeback" || cache == "default")
    out.push_back({"warn", subject, say.writeback,
                   std::string("a commit job then copies into the host page cache at read speed "
                               "and the guest's flush waits behind the whole backlog: "
                               "multi-second stalls. Use ") +
                       say.direct_fix +
                       ", or run qcommitd, which paces the writeback of the job's target"});
  else if (cache == "none" || cache == "directsync")
    out.push_back({"ok", subject, "cache=" + cache + " (O_DIRECT)",
                   "the queue ahead of the guest is what the job has in flight, which a speed "
                   "limit governs"});
  else
    out.push_back({"info", subject, "cache=" + cache, "not a mode qcommit has measured"});
}

// With O_DIRECT, the io mode: threads spends a thread per request.
void check_io(const plugin::DiskInfo& d, const std::string& subject, const Dialect& say,
              std::vector<Finding>& out) {
  if (d.cache != "none" && d.cache != "directsync") return;
  const std::string why = std::string("with O_DIRECT, ") + say.native_io +
                          " keeps requests in flight without a thread per request";
  if (!d.io_known)
    out.push_back({"skip", subject, "io mode not known",
                   "QMP does not report a disk's aio mode and QEMU's command line does not set "
                   "this disk (added later, or the command line unreadable); " +
                       why});
  else if (d.io != "native" && d.io != "io_uring")
    out.push_back({"info", subject,
                   "io mode is '" + (d.io.empty() ? std::string("threads") : d.io) + "'", why});
}

// Whether an iothread serves the disk: without one its I/O and a block job on it run in QEMU's
// main loop.
void check_iothread(const plugin::DomainInfo& dom, const plugin::DiskInfo& d,
                    const std::string& subject, const Dialect& say, std::vector<Finding>& out) {
  if (!d.iothread.empty()) {
    out.push_back({"ok", subject, "iothread " + d.iothread,
                   "the guest's I/O on it and a block job on it run outside QEMU's main loop"});
    return;
  }
  out.push_back({"info", subject, "no iothread: the disk shares QEMU's main loop",
                 std::string(dom.iothreads ? say.other_iothreads : say.no_iothreads) +
                     "; block jobs and the guest's I/O then wait on each other. An iothread for "
                     "the disk (" +
                     say.iothread_fix + ") keeps the guest's requests moving while a job runs"});
}

// Where the disk's layers lie: the filesystems a merge of it reads and writes.
void check_storage(const plugin::DiskInfo& d, const std::string& subject,
                   std::vector<Finding>& out) {
  if (d.source.empty() || d.source[0] != '/') {  // QMP: nbd://..., json:{...}
    out.push_back({"info", subject,
                   d.source.empty() ? "no local path (a network or pool-volume disk)"
                                    : "no local path: " + d.source,
                   "its files and their storage are not checked"});
    return;
  }
  std::vector<std::string> layers{d.source};
  layers.insert(layers.end(), d.backing_chain.begin(), d.backing_chain.end());
  std::vector<std::string> places, missing;
  bool nfs = false;
  for (const std::string& layer : layers) {
    const std::optional<engine::FileId> id =  // cached attributes only
        layer.empty() || layer[0] != '/' ? std::nullopt : engine::file_id(layer);
    if (!id) {
      missing.push_back(layer);
      continue;
    }
    std::string place = "block device " + layer;
    if (!id->block) {
      const std::optional<engine::MountEntry> m = engine::mount_of(id->dev, layer, engine::read_mounts());
      place = m ? m->type + " at " + m->point
                : "device " + std::to_string(major(id->dev)) + ":" + std::to_string(minor(id->dev));
      nfs = nfs || (m && m->type.rfind("nfs", 0) == 0);
    }
    if (std::find(places.begin(), places.end(), place) == places.end()) places.push_back(place);
  }
  std::string text = std::to_string(layers.size()) + (layers.size() == 1 ? " layer" : " layers");
  for (std::size_t i = 0; i < places.size(); ++i) text += (i ? " and " : ", on ") + places[i];
  if (!missing.empty()) {
    out.push_back({"info", subject, text + "; not found on this host: " + missing.front(),
                   "the hypervisor names a file this host does not see (a remote connection, "
                   "another mount namespace, or deleted while open): its storage is not checked"});
    return;
  }
  if (nfs)
    out.push_back({"info", subject, text,
                   "a merge of this disk copies over NFS, whose bandwidth the guests on that "
                   "mount share: qcommitd or qcommit live keep what it queues there within the "
                   "budget (see the NFS mount findings for the mount's options)"});
  else
    out.push_back({"ok", subject, text, "where a merge of this disk reads and writes"});
}

// Each disk's cache and io modes, whether an iothread serves it, and where its layers lie.
void check_domain(const plugin::DomainInfo& dom, const Dialect& say, std::vector<Finding>& out) {
  for (const plugin::DiskInfo& d : dom.defined_disks) {
    const std::string subject = "domain " + dom.name + " disk " + d.target;
    check_cache(d, subject, say, out);
    check_io(d, subject, say, out);
    check_iothread(dom, d, subject, say, out);
    check_storage(d, subject, out);
  }
}

// Host page cache limits against shared storage bandwidth.
void check_dirty_limit(std::vector<Finding>& f) {
  const uint64_t mem = mem_total_bytes();
  uint64_t dirty_bytes = read_u64("/proc/sys/vm/dirty_bytes");
  const uint64_t dirty_ratio = read_u64("/proc/sys/vm/dirty_ratio");
  if (!dirty_bytes) dirty_bytes = mem * dirty_ratio / 100;
  const double drain_s = double(dirty_bytes) / kAssumedSharedStorageBytesPerS;
  f.push_back(
      {drain_s > 1 ? "warn" : "ok", "host",
       "up to " + format_size(dirty_bytes) + " of dirty page cache allowed (vm.dirty_" +
           (read_u64("/proc/sys/vm/dirty_bytes") ? "bytes"
                                                 : "ratio=" + std::to_string(dirty_ratio)) +
           ")",
       "at 100 MB/s of shared storage that is " + std::to_string(int(drain_s)) +
           " s of writeback a guest's flush can wait behind; lowering vm.dirty_bytes bounds it "
           "host-wide, qcommit/qcommitd bound it per merge"});
}

// Kernel: per-file page cache counts for qcommitd's writeback pacing.
void check_page_cache_source(std::vector<Finding>& f) {
  if (!plugin::cachestat_available())
    f.push_back({"info", "kernel", "no cachestat(2) (added in Linux 6.5)",
                 "page cache source " +
                     plugin::describe_page_cache_source(plugin::PageCacheSource::kAuto) +
                     "; a kernel >= 6.5 (Debian 12: bookworm-backports) counts a merge's own "
                     "pages exactly"});
  else
    f.push_back({"ok", "kernel", "page cache source",
                 plugin::describe_page_cache_source(plugin::PageCacheSource::kAuto)});
}

void check_nfs_mounts(std::vector<Finding>& f) {
  std::ifstream mounts("/proc/mounts");
  std::string dev, mnt, type, mopts, rest;
  while (mounts >> dev >> mnt >> type >> mopts && std::getline(mounts, rest)) {
    if (type != "nfs" && type != "nfs4") continue;
    const std::string subject = "NFS mount " + mnt;
    if (mopts.find("nconnect=") == std::string::npos)
      f.push_back({"warn", subject, "no nconnect",
                   "one TCP connection serialises the copy and the guests' I/O; nconnect=8..16 "
                   "spreads them"});
    if (mopts.find("write=eager") == std::string::npos)
      f.push_back(
          {"info", subject, "write=eager not set",
           "with write=eager the client sends writes at once instead of piling dirty pages"});
    if (mopts.find(",sync") != std::string::npos || mopts.rfind("sync", 0) == 0)
      f.push_back({"info", subject, "mounted sync",
                   "every write waits for the server: queues ahead of guests drain slowly"});
  }
}

// The version of the QEMU binary libvirt starts by default, as Hypervisor::qemu_version() counts
// (major * 1000000 + minor * 1000 + micro).
std::optional<std::uint64_t> installed_qemu_version() {
  const ProcessResult q = run_process({"qemu-system-x86_64", "--version"});
  unsigned major = 0, minor = 0, micro = 0;
  if (q.exit_code != 0 ||
      std::sscanf(q.output.c_str(), "QEMU emulator version %u.%u.%u", &major, &minor, &micro) < 2)
    return std::nullopt;
  return std::uint64_t{major} * 1000000 + std::uint64_t{minor} * 1000 + micro;
}

// QEMU version caveats.
void check_qemu_version(std::optional<std::uint64_t> version, std::vector<Finding>& f) {
  if (!version) return;
  const std::uint64_t major = *version / 1000000, minor = *version / 1000 % 1000;
  if (major < 8 || (major == 8 && minor < 1))
    f.push_back(
        {"info", "QEMU " + std::to_string(major) + "." + std::to_string(minor),
         "lowering a block job's speed takes effect only after its current sleep (fixed in 8.1)",
         "and active commit keeps 16 x 1 MiB requests in flight whatever its speed: with "
         "cache=none that is a floor of 16 MiB / bandwidth of added latency"});
}

void check_qcommitd(const std::string& socket_path, std::vector<Finding>& f) {
  const bool daemon = qcommitd_answers(socket_path);
  f.push_back(
      {daemon ? "ok" : "warn", "qcommitd",
       daemon ? "running (socket " + socket_path + ")"
              : "not running (no socket at " + socket_path + ")",
       daemon
           ? "virsh blockcommit jobs are governed by their pool's budget"
           : "virsh blockcommit jobs run unthrottled: start qcommitd (systemctl start qcommitd)"});
}

// What --qmp leaves out: qcommitd governs the block jobs of libvirt's domains only.
Finding qcommitd_skipped() {
  return {"skip", "qcommitd", "not checked (--qmp)",
          "qcommitd governs the block jobs of libvirt's domains; a job on a QEMU that libvirt "
          "does not manage is paced only while qcommit live --qmp runs it"};
}

// `domain`, or every running domain, read through the hypervisor adapter.
void check_domains(plugin::Hypervisor& hv, const std::string& domain, const Dialect& say,
                   std::vector<Finding>& f) {
  if (domain.empty()) {
    for (const plugin::DomainInfo& running : hv.running_domains())
      if (const std::optional<plugin::DomainInfo> d = hv.domain(running.name))
        check_domain(*d, say, f);
    return;
  }
  const std::optional<plugin::DomainInfo> d = hv.domain(domain);
  if (!d) throw std::runtime_error("domain " + domain + ": not found");
  check_domain(*d, say, f);
}

void print_findings(const std::vector<Finding>& f, Output out) {
  if (out == Output::kJson) {
    json::Ordered findings = json::Ordered::array();
    for (const auto& x : f)
      findings.push_back(json::Ordered{
          {"level", x.level}, {"subject", x.subject}, {"finding", x.text}, {"reason", x.reason}});
    print_json(json::Ordered{{"findings", findings}});
    return;
  }
  for (const auto& x : f)
    std::printf("[%-4s] %s: %s\n       why: %s\n", x.level.c_str(), x.subject.c_str(),
                x.text.c_str(), x.reason.c_str());
}

struct DoctorArgs {
  std::string domain, output = "human", uri = defaults::kUri, socket_path = defaults::kSocketPath;
  std::string qmp;
};

// False when --help was asked for (and printed).
[[nodiscard]] bool parse_doctor_args(const Args& args, DoctorArgs& a) {
  po::options_description opts("options");
  opts.add_options()("domain", po::value(&a.domain),
                     "only this domain (default: every running domain)")(
      "connect,c", po::value(&a.uri), "libvirt connection URI")("uri", po::value(&a.uri),
                                                                "the same as --connect")(
      "qmp", po::value(&a.qmp),
      "instead of libvirt's domains, the QEMU on this QMP socket (one that libvirt does not "
      "manage, e.g. Proxmox VE's /var/run/qemu-server/ID.qmp): its disks, iothreads and QEMU "
      "version; qcommitd is not checked (it governs libvirt's domains only)")(
      "socket", po::value(&a.socket_path), "qcommitd's socket")("output", po::value(&a.output),
                                                                "human or json");
  po::positional_options_description pos;
  pos.add("domain", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm,
             "qcommit doctor [DOMAIN] [--output=json]\n"
             "       qcommit doctor --qmp SOCKET [--output=json]",
             "Reads the host's settings and the domains' definitions (with --qmp: one\n"
             "QEMU's, over its monitor) and says what makes merges stall guests here, each\n"
             "finding with its reason. Writes nothing.\n"
             "examples:\n  qcommit doctor\n  qcommit doctor vm1 --output=json | jq '.findings[] | "
             "select(.level==\"warn\")'\n"
             "  qcommit doctor --qmp /var/run/qemu-server/100.qmp\n"))
    return false;
  if (!a.qmp.empty()) {
    if (vm.count("connect") || vm.count("uri"))
      throw UsageError("--qmp and --connect exclude each other");
    if (!a.domain.empty())
      throw UsageError("--qmp SOCKET is one QEMU: no DOMAIN with it (see --help)");
  }
  return true;
}

}  // namespace

int cmd_doctor(const Args& args) {
  DoctorArgs a;
  if (!parse_doctor_args(args, a)) return kExitOk;
  const Output out = parse_output(a.output);
  std::vector<Finding> f;
  check_dirty_limit(f);
  check_page_cache_source(f);
  check_nfs_mounts(f);
  if (a.qmp.empty()) {
    check_qemu_version(installed_qemu_version(), f);
    check_qcommitd(a.socket_path, f);
    plugin::LibvirtHypervisor hv(a.uri, plugin::LibvirtHypervisor::Access::kReadOnly);
    if (hv.connect())
      check_domains(hv, a.domain, kLibvirtXml, f);
    else
      f.push_back({"info", "libvirt", "cannot connect to " + a.uri, "domain checks skipped"});
  } else {
    plugin::QmpHypervisor hv(a.qmp);
    if (!hv.connect()) throw std::runtime_error(hv.last_error());
    check_qemu_version(hv.qemu_version(), f);
    f.push_back(qcommitd_skipped());
    check_domains(hv, "", kQemuOptions, f);
  }
  print_findings(f, out);
  return kExitOk;
}

}  // namespace qcommit::cli
