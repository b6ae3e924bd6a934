// SPDX-License-Identifier: GPL-2.0-or-later
// What qcommitd needs from the hypervisor, without libvirt types.  One adapter implements it with
// the libvirt C API (plugin/libvirt_hypervisor.*), one over a QEMU's QMP socket
// (plugin/qmp_hypervisor.*); tests use a scripted fake.
//
// Every call may fail because the connection is gone: calls then throw HypervisorDisconnected and
// the caller reconnects (connect()) and re-adopts.  Per-object failures (domain vanished, no job
// on that disk) are ordinary results (std::nullopt / false), not exceptions.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "plugin/host/json.h"
#include "throttle/io_stats.h"

namespace qcommit::plugin {

// The device of the storage holding `path` (a disk's source): the block device itself for a
// block device node (an LV, a partition: every node in /dev shares devtmpfs's device), else the
// device of its filesystem.  From cached attributes only (AT_STATX_DONT_SYNC, as the /proc walk
// reads them): a disk on an NFS export that stopped answering must not hold the daemon's loop,
// `qcommit live` or doctor in a getattr.  nullopt when the path cannot be looked up.
// The one rule for both: a block device node is its own storage (`rdev`); any other file is on
// its filesystem's device (`dev`).
[[nodiscard]] inline std::uint64_t storage_device_of(mode_t mode, dev_t dev, dev_t rdev) {
  return static_cast<std::uint64_t>(S_ISBLK(mode) ? rdev : dev);
}
[[nodiscard]] inline std::optional<std::uint64_t> cached_storage_device(const std::string& path) {
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), AT_STATX_DONT_SYNC, STATX_TYPE, &sx) != 0)
    return std::nullopt;
  return storage_device_of(sx.stx_mode, makedev(sx.stx_dev_major, sx.stx_dev_minor),
                           makedev(sx.stx_rdev_major, sx.stx_rdev_minor));
}

struct HypervisorDisconnected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct DiskInfo {
  std::string target;                      // "vda"
  std::string source;                      // active layer path
  std::vector<std::string> backing_chain;  // backing files, top to bottom (may be empty)
  std::optional<std::string> mirror;       // <mirror> source path while a copy/active commit runs
  std::optional<std::uint64_t> device;     // cached_storage_device(source), when stat works
  std::string cache;                       // <driver cache=...> ("" when not given: writeback)
  std::string format;                      // <driver type=...> of the active layer ("" unknown)
  std::string io{};                        // <driver io=...> ("" when not given: threads)
  bool io_known = true;                    // false: the adapter cannot tell `io` (QMP, see there)
  std::string iothread{};                  // iothread id serving it ("": QEMU's main loop)
  std::string discard{};                   // <driver discard=...> ("" when not given: ignore)
  // Whether every option QEMU's format nodes of this disk were opened with is known from what
  // QEMU reports plus `discard` (plugin/target_throttle.h reopens the target's node with them):
  // libvirt, when <driver> and <source> carry nothing beyond the usual (no metadata_cache, slices,
  // encryption, ...).
  bool format_options_known = false;
};

struct DomainInfo {
  std::string name;
  std::string uuid;
  std::vector<DiskInfo> disks;
  // The <qcommit:policy .../> element of the domain metadata, as libvirt returns it.
  std::optional<std::string> policy_xml;
  // What `qcommit doctor` reads (both adapters fill them in domain()): whether the definition has
  // <iothreads> (QMP: whether QEMU has an iothread), and every device='disk' disk in the
  // definition's order, also those `disks` leaves out for having no local path (network and
  // pool-volume disks); each with its iothread and io mode.
  bool iothreads = false;
  std::vector<DiskInfo> defined_disks{};
};

struct PoolInfo {
  std::string name;
  std::string uuid;
  std::string target_path;  // directory of dir/fs/netfs pools; may be empty
};

// Cumulative counters of virDomainBlockStatsFlags (times in ns).
using BlockStats = throttle::IoCounters;

enum class JobType { Unknown, Pull, Copy, Commit, ActiveCommit, Backup };
[[nodiscard]] const char* to_string(JobType t);

struct JobInfo {
  JobType type = JobType::Unknown;
  std::uint64_t cur = 0;
  std::uint64_t end = 0;
  std::uint64_t bandwidth_bytes_per_s = 0;  // 0 = unlimited
};

// What the hypervisor could tell of a disk's block job: one runs, none runs, or nothing is known
// (the query failed while the connection stayed up: a domain job holding libvirt's lock past its
// timeout, a domain in transition).  An unknown answer is no evidence that a job ended.
struct JobQuery {
  enum class State { kRunning, kNone, kUnknown };
  State state = State::kNone;
  JobInfo info;  // when kRunning
};

enum class JobEventKind {
  StatusChange,  // QEMU JOB_STATUS_CHANGE (created, running, ...): look at the domain now
  Completed,
  Failed,
  Canceled,
  Ready,
};
[[nodiscard]] const char* to_string(JobEventKind k);

struct JobEvent {
  JobEventKind kind = JobEventKind::StatusChange;
  std::string domain;  // domain name
  std::string disk;    // disk target or path; may be empty for StatusChange
  JobType type = JobType::Unknown;
  std::string detail;  // e.g. QEMU status or job id
  // StatusChange to "created" or "running": a job may have just started (the governor holds it
  // at once, and counts its time to govern from `at`).
  bool started = false;
  // When QEMU emitted the event (its timestamp, on the governor's monotonic clock), when known.
  std::optional<throttle::TimePoint> at{};
};

class Hypervisor {
 public:
  virtual ~Hypervisor() = default;

  // (Re)connect and (re)register event callbacks.  false when the hypervisor is unreachable.
  [[nodiscard]] virtual bool connect() = 0;
  [[nodiscard]] virtual bool connected() const = 0;
  // The QEMU version of the connection, major * 1000000 + minor * 1000 + micro, when known.
  [[nodiscard]] virtual std::optional<std::uint64_t> qemu_version() const = 0;

  // Running domains with their disks.
  [[nodiscard]] virtual std::vector<DomainInfo> running_domains() = 0;
  // One domain, with what the per-tick running_domains() may leave out (defined_disks,
  // iothreads, each disk's iothread and io: what `qcommit doctor` reads); nullopt when there is
  // no domain of that name (the libvirt adapter also describes a shut-off one: an offline merge
  // reads its policy).  By default the running_domains() entry.
  [[nodiscard]] virtual std::optional<DomainInfo> domain(const std::string& name) {
    return running_domain(name);
  }
  // The running_domains() entry of one domain, looked up alone; nullopt when it does not run.
  [[nodiscard]] virtual std::optional<DomainInfo> running_domain(const std::string& name) {
    for (DomainInfo& d : running_domains())
      if (d.name == name) return std::move(d);
    return std::nullopt;
  }
  [[nodiscard]] virtual std::vector<PoolInfo> pools() = 0;
  // Pool holding a volume with this path (virStorageVolLookupByPath), when known.
  [[nodiscard]] virtual std::optional<PoolInfo> pool_of_volume(const std::string& path) = 0;

  [[nodiscard]] virtual std::optional<BlockStats> block_stats(const std::string& domain,
                                                              const std::string& disk) = 0;
  [[nodiscard]] virtual std::optional<JobInfo> job_info(const std::string& domain,
                                                        const std::string& disk) = 0;
  // job_info with "unknown" told apart from "no job"; by default a failed query reads as none.
  [[nodiscard]] virtual JobQuery query_job(const std::string& domain, const std::string& disk) {
    std::optional<JobInfo> j = job_info(domain, disk);
    return j ? JobQuery{JobQuery::State::kRunning, *j} : JobQuery{};
  }
  // Never called with 0 (0 means unlimited in QEMU).
  [[nodiscard]] virtual bool set_job_speed(const std::string& domain, const std::string& disk,
                                           std::uint64_t bytes_per_s) = 0;

  // One QMP command to the domain's QEMU: its "return", or nullopt with *error set to one line
  // (QEMU's error, or why it could not be sent).  By default not available.
  [[nodiscard]] virtual std::optional<json::Value> qmp_command(const std::string& domain,
                                                               std::string_view command,
                                                               const json::Value& args,
                                                               std::string* error) {
    (void)domain;
    (void)command;
    (void)args;
    *error = "QMP commands are not available through this connection";
    return std::nullopt;
  }

  // Events are delivered by the implementation's event loop on the thread that runs it.
  using EventSink = std::function<void(const JobEvent&)>;
  virtual void set_event_sink(EventSink sink) = 0;
};

}  // namespace qcommit::plugin
