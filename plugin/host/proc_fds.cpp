// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/host/proc_fds.h"

#include "engine/proc_walk.h"

namespace qcommit::plugin {

// QEMU by its command name (engine::runs_qemu): other holders of an image open for writing
// (virtlockd, backup tools) are not the guest's.
std::optional<pid_t> writer_of(const std::string& path, const std::string& proc) {
  const engine::ProcSource src{proc};
  const auto holders = engine::holders_of(path, engine::Access::writing, engine::runs_qemu, src);
  if (holders.empty()) return std::nullopt;
  return holders.front().pid;
}

std::optional<std::string> lowest_written(pid_t pid, const std::vector<std::string>& chain,
                                          const std::string& proc) {
  const engine::ProcSource src{proc};
  const std::vector<engine::FileId> written = engine::open_files(pid, engine::Access::writing, src);
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    const auto id = engine::file_id(*it, src);
    if (!id) continue;
    for (const engine::FileId& w : written)
      if (w == *id) return *it;
  }
  return std::nullopt;
}

std::optional<std::string> commit_base_in_use(const std::string& active,
                                              const std::vector<std::string>& chain) {
  const auto pid = writer_of(active);
  if (!pid) return std::nullopt;
  return lowest_written(*pid, chain);
}

}  // namespace qcommit::plugin
