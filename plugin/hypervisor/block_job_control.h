// SPDX-License-Identifier: GPL-2.0-or-later
// What a hypervisor adapter offers the live flow (plugin/live) besides governing: start a commit,
// make an overlay, pivot, remove a file.  Implemented by the libvirt and QMP adapters.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "plugin/hypervisor/hypervisor.h"

namespace qcommit::plugin {

struct BlockJobError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class BlockJobControl {
 public:
  virtual ~BlockJobControl() = default;
  [[nodiscard]] virtual std::optional<DomainInfo> domain(const std::string& name) = 0;
  // virDomainBlockCommit(base, top, bandwidth bytes/s, ACTIVE when `active`).
  virtual void start_commit(const std::string& domain, const std::string& disk,
                            const std::string& base, const std::string& top,
                            std::uint64_t bandwidth_bytes_per_s, bool active) = 0;
  // External disk-only snapshot of one disk to `overlay_path` (qcow2), no snapshot metadata.
  virtual void create_overlay(const std::string& domain, const std::string& disk,
                              const std::string& overlay_path) = 0;
  // Pivot a ready active commit.  false: not ready yet (try again later).
  [[nodiscard]] virtual bool pivot(const std::string& domain, const std::string& disk) = 0;
  virtual void remove_file(const std::string& path) = 0;
};

}  // namespace qcommit::plugin
