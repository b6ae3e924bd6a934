// SPDX-License-Identifier: GPL-2.0-or-later
// Hypervisor + BlockJobControl for ONE QEMU process reached over its QMP socket, for QEMUs that
// libvirt does not manage (Proxmox VE: /var/run/qemu-server/ID.qmp).  Glue only: no policy (the
// governor paces, plugin/live.cpp orders the jobs).
//
// The "domain" is the QEMU process: its name comes from query-name, else from the socket's file
// name ("100" for /var/run/qemu-server/100.qmp).  A disk is a block backend from query-block,
// named by its drive id (-drive id=...), else by its device id (-device ...,id=...), else by its
// root node name; its chain is the filenames of inserted.image (top to bottom).
//
// Block jobs: block-commit with top-node/base-node (the filename arguments are deprecated), found
// from query-named-block-nodes; job id "qcommit-<disk>"; blockdev-snapshot-sync for the overlay;
// block-job-complete once query-block-jobs says ready, then the pivot is done when the job has
// gone and the disk's active layer is BASE.  QEMU reports an active commit as type "commit": jobs
// we started are typed by us, others are ActiveCommit once ready.
//
// Events: JOB_STATUS_CHANGE → StatusChange; BLOCK_JOB_READY → Ready; BLOCK_JOB_COMPLETED →
// Completed, or Failed when it carries an error; BLOCK_JOB_CANCELLED → Canceled; BLOCK_JOB_ERROR
// → StatusChange (with on-error=report a BLOCK_JOB_COMPLETED with the error follows; with
// stop/ignore the job lives on).  Events are delivered by pump().
//
// Iothreads (domain(), not the per-tick running_domains()): DomainInfo::iothreads when
// query-iothreads lists one; each disk's DiskInfo::iothread from its device's QOM properties
// (qom-get): the "iothread" link or the first of "iothread-vq-mapping" (virtio-blk), else, for a
// device without them (a SCSI disk), the "iothread" link of the controller its bus belongs to.
// Each disk's io mode (DiskInfo::io) from the command line of the process on the socket's other
// end (SO_PEERCRED, /proc/PID/cmdline; plugin/qemu_cmdline.h), since QMP does not report it;
// io_known is false for a disk the command line does not name.  Every disk is also in
// defined_disks.
//
// QEMU serves one client per QMP socket: while qcommit holds it, other clients (e.g. Proxmox's
// `qm` commands) wait for their greeting.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plugin/hypervisor/hypervisor.h"
#include "plugin/host/json.h"
#include "plugin/hypervisor/block_job_control.h"
#include "plugin/hypervisor/qmp_client.h"

namespace qcommit::plugin {

// One block backend of query-block.
struct QmpDisk {
  DiskInfo info;                     // target, source, backing_chain, device (st_dev)
  std::string device;                // BlockBackend name (-drive id); "" for -blockdev + -device
  std::string qdev;                  // qdev id or QOM path of the attached device; may be empty
  std::string root_node;             // node name of the active layer
  std::vector<std::string> formats;  // format of each layer, active layer first
  std::uint64_t virtual_size = 0;    // of the active layer (0: unknown)
  // The QMP `device` argument that names this disk's root: the BlockBackend name when it has
  // one, else the root node name.
  [[nodiscard]] const std::string& qmp_device() const {
    return device.empty() ? root_node : device;
  }
  // Whether `name` selects this disk: target, drive id, qdev id or path, root node, active layer.
  [[nodiscard]] bool matches(const std::string& name) const;
};

struct QmpNode {
  std::string node_name, file, drv;
};

struct QmpJob {
  std::string id;      // job id ("device" of BlockJobInfo)
  std::string type;    // "commit", "mirror", "stream", "backup"
  std::string status;  // JobStatus: "running", "ready", "concluded", ...
  std::uint64_t len = 0, offset = 0, speed = 0;
  bool ready = false;
  bool auto_dismiss = true;
  std::string error;
};

// Parsers of the commands' "return" values (pure, exposed for tests).  Malformed entries are
// skipped.
[[nodiscard]] std::vector<QmpDisk> parse_query_block(const json::Value& ret);
[[nodiscard]] std::vector<QmpNode> parse_named_block_nodes(const json::Value& ret);
[[nodiscard]] std::vector<QmpJob> parse_block_jobs(const json::Value& ret);
// The guest-side (BlockBackend) counters of `disk` in a query-blockstats answer.
[[nodiscard]] std::optional<BlockStats> parse_blockstats(const json::Value& ret,
                                                         const QmpDisk& disk);
// The ids of query-iothreads' answer.
[[nodiscard]] std::vector<std::string> parse_iothreads(const json::Value& ret);
// The iothread id a qom-get of a device's "iothread" link or "iothread-vq-mapping" names
// ("/objects/iot1" → "iot1"; the first mapping's iothread), "" when it names none.
[[nodiscard]] std::string iothread_of_property(const json::Value& value);
// "/machine/peripheral/ID/virtio-backend" → "ID"; a plain id stays as is; other paths → "".
[[nodiscard]] std::string qdev_id(const std::string& qdev);
// Node name of the format node of `filename` (driver `format`), "" when there is none.
[[nodiscard]] std::string node_of(const std::vector<QmpNode>& nodes, const std::string& filename,
                                  const std::string& format);
// JobInfo in libvirt's convention: cur == end only once a mirror is ready.  `active`: whether we
// know the job is an active commit (nullopt: a job we did not start).
[[nodiscard]] JobInfo to_job_info(const QmpJob& j, std::optional<bool> active);
// The job id qcommit uses for a disk: "qcommit-" + the target with characters outside
// [A-Za-z0-9._-] replaced by '_'.
[[nodiscard]] std::string qcommit_job_id(const std::string& target);
// The domain name when query-name gives none: the socket's file name without its extension.
[[nodiscard]] std::string name_from_socket(const std::string& path);
// The JobType of a QMP job type ("commit": active when `active` says so or, for a job we did not
// start, once it is ready; "mirror", "stream", "backup").
[[nodiscard]] JobType job_type_of(const std::string& qmp_type, bool ready,
                                  std::optional<bool> active);

class QmpHypervisor final : public Hypervisor, public BlockJobControl {
 public:
  // `name`: the domain name to use; empty = query-name, else the socket's file name.
  explicit QmpHypervisor(std::string socket_path, std::string name = "", QmpOptions opt = {});
  QmpHypervisor(const QmpHypervisor&) = delete;
  QmpHypervisor& operator=(const QmpHypervisor&) = delete;

  [[nodiscard]] bool connect() override;
  [[nodiscard]] bool connected() const override;
  [[nodiscard]] std::optional<std::uint64_t> qemu_version() const override { return qemu_version_; }
  [[nodiscard]] std::vector<DomainInfo> running_domains() override;
  [[nodiscard]] std::vector<PoolInfo> pools() override { return {}; }
  [[nodiscard]] std::optional<PoolInfo> pool_of_volume(const std::string&) override {
    return std::nullopt;
  }
  [[nodiscard]] std::optional<BlockStats> block_stats(const std::string& domain,
                                                      const std::string& disk) override;
  [[nodiscard]] std::optional<JobInfo> job_info(const std::string& domain,
                                                const std::string& disk) override;
  [[nodiscard]] bool set_job_speed(const std::string& domain, const std::string& disk,
                                   std::uint64_t bytes_per_s) override;
  void set_event_sink(EventSink sink) override { sink_ = std::move(sink); }

  // BlockJobControl (`qcommit live --qmp`).
  [[nodiscard]] std::optional<DomainInfo> domain(const std::string& name) override;
  void start_commit(const std::string& domain, const std::string& disk, const std::string& base,
                    const std::string& top, std::uint64_t bandwidth_bytes_per_s,
                    bool active) override;
  void create_overlay(const std::string& domain, const std::string& disk,
                      const std::string& overlay_path) override;
  [[nodiscard]] bool pivot(const std::string& domain, const std::string& disk) override;
  void remove_file(const std::string& path) override;

  // Waits up to `wait` for QMP events and hands them to the sink.  When disconnected it only
  // sleeps `wait`.
  void pump(std::chrono::milliseconds wait);

  // The target of the disk that `name` selects (target, drive id, device id, node, path).
  [[nodiscard]] std::optional<std::string> resolve_disk(const std::string& name);
  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] const std::string& socket_path() const { return path_; }
  [[nodiscard]] const std::string& last_error() const { return last_error_; }
  // The last job failure QEMU reported by event (error text of BLOCK_JOB_COMPLETED,
  // BLOCK_JOB_ERROR, cancellation), "" when none.
  [[nodiscard]] const std::string& last_job_error() const { return last_job_error_; }

 private:
  struct OurJob {
    std::string id;
    bool active = false;
    std::string top, base;
    bool complete_sent = false;
  };

  [[nodiscard]] json::Value call(const char* command, const json::Value& args = json::Value());
  [[nodiscard]] std::vector<QmpDisk> disks();
  // `cached`: look up the target in the last query-block answer first (per-tick calls).
  [[nodiscard]] std::optional<QmpDisk> find_disk(const std::string& name, bool cached);
  [[nodiscard]] QmpDisk require_disk(const std::string& domain, const std::string& disk);
  [[nodiscard]] std::optional<QmpJob> job_of(const std::string& target, const QmpDisk* disk);
  // qom-get of `property` of the object at `path`; empty when QEMU refuses (no such property).
  [[nodiscard]] std::optional<json::Value> qom_get(const std::string& path, const char* property);
  // The iothread serving the device query-block names `qdev` ("" for QEMU's main loop).
  [[nodiscard]] std::string device_iothread(const std::string& qdev);
  void add_iothreads(DomainInfo& dom);
  void add_io_modes(DomainInfo& dom);
  [[nodiscard]] const QmpDisk* cached_disk(const std::string& target) const;
  void absorb_events();
  void note_event(const QmpEvent& e);
  [[nodiscard]] bool ours(const std::string& domain) const { return domain == name_; }

  std::string path_;
  std::string name_;
  bool name_given_ = false;
  QmpOptions opt_;
  std::unique_ptr<QmpClient> client_;
  EventSink sink_;
  std::vector<JobEvent> pending_;
  std::vector<QmpDisk> disks_cache_;             // last query-block answer
  std::map<std::string, OurJob> jobs_;           // by disk target
  std::map<std::string, std::string> job_disk_;  // job id → disk target (ours and seen)
  std::string last_error_;
  std::optional<std::uint64_t> qemu_version_;  // query-version at connect
  std::string last_job_error_;
  unsigned overlay_counter_ = 0;
};

}  // namespace qcommit::plugin
