// qcommit doctor: what on this host makes snapshot merges stall guests, and what to change.
// Each finding carries its reason. Reads only: libvirt definitions, /proc, /sys, versions.
#include <unistd.h>

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
#include "plugin/libvirt_hypervisor.h"
#include "plugin/process.h"
#include "plugin/writeback.h"

namespace qcommit::cli {

using plugin::ProcessResult;
using plugin::run_process;

namespace {

inline constexpr double kAssumedSharedStorageBytesPerS = 100e6;  // a sync NFS export, per the users

struct Finding {
  std::string level;  // "ok", "warn", "info"
  std::string subject;
  std::string text;
  std::string reason;
};

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

// A disk no iothread serves: its I/O and a block job on it run in QEMU's main loop.
Finding main_loop_finding(const plugin::DomainInfo& dom, const std::string& subject) {
  return {"info", subject, "no iothread: the disk shares QEMU's main loop",
          std::string(dom.iothreads ? "the domain has <iothreads> but none serves this disk"
                                    : "the domain has no <iothreads>") +
              "; block jobs and the guest's I/O then wait on each other. An iothread for the "
              "disk (<driver iothread='N'/> on a virtio disk or on its virtio-scsi controller) "
              "keeps the guest's requests moving while a job runs"};
}

// Each disk's cache and io modes, and whether an iothread serves it.
void check_domain(const plugin::DomainInfo& dom, std::vector<Finding>& out) {
  for (const plugin::DiskInfo& d : dom.defined_disks) {
    const std::string& cache = d.cache;
    const std::string& io = d.io;
    const std::string subject = "domain " + dom.name + " disk " + d.target;
    if (cache.empty() || cache == "writeback" || cache == "default")
      out.push_back(
          {"warn", subject, "cache mode is writeback (libvirt's default when none is set)",
           "a commit job then copies into the host page cache at read speed and the guest's "
           "flush waits behind the whole backlog: multi-second stalls. Use cache='none' "
           "(io='native'), or run qcommitd, which paces the writeback of the job's target"});
    else if (cache == "none" || cache == "directsync")
      out.push_back({"ok", subject, "cache=" + cache + " (O_DIRECT)",
                     "the queue ahead of the guest is what the job has in flight, which a speed "
                     "limit governs"});
    else
      out.push_back({"info", subject, "cache=" + cache, "not a mode qcommit has measured"});
    if ((cache == "none" || cache == "directsync") && io != "native" && io != "io_uring")
      out.push_back(
          {"info", subject, "io mode is '" + (io.empty() ? std::string("threads") : io) + "'",
           "with O_DIRECT, io='native' keeps requests in flight without a thread per request"});
    if (d.iothread.empty())
      out.push_back(main_loop_finding(dom, subject));
    else
      out.push_back({"ok", subject, "iothread " + d.iothread,
                     "the guest's I/O on it and a block job on it run outside QEMU's main loop"});
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

// QEMU version caveats.
void check_qemu_version(std::vector<Finding>& f) {
  ProcessResult q = run_process({"qemu-system-x86_64", "--version"});
  int major = 0, minor = 0;
  if (q.exit_code != 0 ||
      std::sscanf(q.output.c_str(), "QEMU emulator version %d.%d", &major, &minor) != 2)
    return;
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

// `domain`, or every running domain, read through the libvirt adapter on a read-only connection.
void check_domains(const std::string& uri, const std::string& domain, std::vector<Finding>& f) {
  plugin::LibvirtHypervisor hv(uri, plugin::LibvirtHypervisor::Access::kReadOnly);
  if (!hv.connect()) {
    f.push_back({"info", "libvirt", "cannot connect to " + uri, "domain checks skipped"});
    return;
  }
  if (domain.empty()) {
    for (const plugin::DomainInfo& d : hv.running_domains()) check_domain(d, f);
    return;
  }
  const std::optional<plugin::DomainInfo> d = hv.domain(domain);
  if (!d) throw std::runtime_error("domain " + domain + ": not found");
  check_domain(*d, f);
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

}  // namespace

int cmd_doctor(const Args& args) {
  po::options_description opts("options");
  std::string domain, output = "human", uri = defaults::kUri, socket_path = defaults::kSocketPath;
  opts.add_options()("domain", po::value(&domain),
                     "only this domain (default: every running domain)")(
      "connect,c", po::value(&uri), "libvirt connection URI")("uri", po::value(&uri),
                                                              "the same as --connect")(
      "socket", po::value(&socket_path), "qcommitd's socket")("output", po::value(&output),
                                                              "human or json");
  po::positional_options_description pos;
  pos.add("domain", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm, "qcommit doctor [DOMAIN] [--output=json]",
             "Reads the host's settings and the domains' definitions and says what makes merges\n"
             "stall guests here, each finding with its reason. Writes nothing.\n"
             "examples:\n  qcommit doctor\n  qcommit doctor vm1 --output=json | jq '.findings[] | "
             "select(.level==\"warn\")'\n"))
    return kExitOk;
  const Output out = parse_output(output);
  std::vector<Finding> f;
  check_dirty_limit(f);
  check_page_cache_source(f);
  check_nfs_mounts(f);
  check_qemu_version(f);
  check_qcommitd(socket_path, f);
  check_domains(uri, domain, f);
  print_findings(f, out);
  return kExitOk;
}

}  // namespace qcommit::cli
