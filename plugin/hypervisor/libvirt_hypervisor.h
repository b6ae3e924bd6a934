// SPDX-License-Identifier: GPL-2.0-or-later
// Hypervisor implemented with the libvirt C API.  Glue only: no policy.  Needs a libvirt event
// loop implementation registered (virEventRegisterDefaultImpl: plugin/host/event_loop.h) before
// connect().
#pragma once

#include <libvirt/libvirt.h>

#include <string>

#include "plugin/hypervisor/hypervisor.h"
#include "plugin/hypervisor/block_job_control.h"

namespace qcommit::plugin {

class LibvirtHypervisor final : public Hypervisor, public BlockJobControl {
 public:
  // kReadOnly (`qcommit doctor`): a read-only connection, as an unprivileged user may open, with
  // no event callbacks and no keepalive (so no event loop is needed); only reads work.
  enum class Access { kReadWrite, kReadOnly };
  explicit LibvirtHypervisor(std::string uri, Access access = Access::kReadWrite);
  ~LibvirtHypervisor() override;
  LibvirtHypervisor(const LibvirtHypervisor&) = delete;
  LibvirtHypervisor& operator=(const LibvirtHypervisor&) = delete;

  [[nodiscard]] bool connect() override;
  [[nodiscard]] bool connected() const override;
  [[nodiscard]] std::optional<std::uint64_t> qemu_version() const override { return qemu_version_; }
  [[nodiscard]] std::vector<DomainInfo> running_domains() override;
  [[nodiscard]] std::optional<DomainInfo> running_domain(const std::string& name) override;
  [[nodiscard]] std::vector<PoolInfo> pools() override;
  [[nodiscard]] std::optional<PoolInfo> pool_of_volume(const std::string& path) override;
  [[nodiscard]] std::optional<BlockStats> block_stats(const std::string& domain,
                                                      const std::string& disk) override;
  [[nodiscard]] std::optional<JobInfo> job_info(const std::string& domain,
                                                const std::string& disk) override;
  [[nodiscard]] JobQuery query_job(const std::string& domain, const std::string& disk) override;
  [[nodiscard]] bool set_job_speed(const std::string& domain, const std::string& disk,
                                   std::uint64_t bytes_per_s) override;
  void set_event_sink(EventSink sink) override { sink_ = std::move(sink); }
  [[nodiscard]] std::optional<json::Value> qmp_command(const std::string& domain,
                                                       std::string_view command,
                                                       const json::Value& args,
                                                       std::string* error) override;

  // BlockJobControl (`qcommit live`).
  [[nodiscard]] std::optional<DomainInfo> domain(const std::string& name) override;
  void start_commit(const std::string& domain, const std::string& disk, const std::string& base,
                    const std::string& top, std::uint64_t bandwidth_bytes_per_s,
                    bool active) override;
  void create_overlay(const std::string& domain, const std::string& disk,
                      const std::string& overlay_path) override;
  [[nodiscard]] bool pivot(const std::string& domain, const std::string& disk) override;
  void remove_file(const std::string& path) override;

  // Used by the C callbacks.
  void deliver(const JobEvent& e) {
    if (sink_) sink_(e);
  }
  void mark_closed() { closed_ = true; }

  [[nodiscard]] const std::string& last_error() const { return last_error_; }
  // Why QEMU's job events (JOB_STATUS_CHANGE, through virConnectDomainQemuMonitorEventRegister)
  // could not be had on this connection; "" when they are registered.  Without them new jobs are
  // found by the governor's poll only.
  [[nodiscard]] const std::string& job_events_error() const { return job_events_error_; }

 private:
  void disconnect();
  [[noreturn]] void throw_disconnected();
  void check_alive();  // throws HypervisorDisconnected when the connection is dead
  [[noreturn]] void throw_job_error(const std::string& what);
  [[nodiscard]] std::optional<DomainInfo> describe(virDomainPtr d);

  std::string uri_;
  Access access_;
  virConnectPtr conn_ = nullptr;
  bool closed_ = false;
  int block_job_cb_ = -1;
  int qemu_cb_ = -1;
  EventSink sink_;
  std::string last_error_;
  std::string job_events_error_;
  std::optional<std::uint64_t> qemu_version_;  // virConnectGetVersion at connect
};

// What a domain XML says of the domain's disks (`disks`, `defined_disks`) and of `iothreads`;
// the name, the UUID and the policy come from calls of their own (exposed for tests).
[[nodiscard]] DomainInfo parse_domain_xml(const std::string& xml);

// parse_domain_xml(xml).disks (exposed for tests).
[[nodiscard]] std::vector<DiskInfo> parse_domain_disks(const std::string& xml);

// The <domainsnapshot> of a disk-only snapshot: an external qcow2 overlay at `overlay_path` for
// the disk whose target is `disk`, none for the other `disks` (exposed for tests).
[[nodiscard]] std::string disk_only_snapshot_xml(const std::vector<DiskInfo>& disks,
                                                 const std::string& disk,
                                                 const std::string& overlay_path);

}  // namespace qcommit::plugin
