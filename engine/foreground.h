// SPDX-License-Identifier: GPL-2.0-or-later
// Foreground signals from outside the merge: the I/O counters of the other users of BASE's
// storage (co-tenants: the running guests with a disk there).  The engine knows no hypervisor;
// the CLI implements ForegroundSource with libvirt's block stats (cli/cotenants.*), tests with a
// script.  The counters become latency samples and suspected stalls through
// throttle::IoCounterSampler, the same code qcommitd's governor uses for its guests.
#pragma once

#include <string>
#include <vector>

#include "throttle/io_stats.h"

namespace qcommit::engine {

struct ForegroundDisk {
  std::string id;  // stable per disk while it exists, e.g. "vm1/vda"
  throttle::IoCounters counters;
};

class ForegroundSource {
 public:
  virtual ~ForegroundSource() = default;
  // The cumulative counters of every foreground disk now.  Called on the BudgetGovernor's own
  // sampling thread (never on the copy's), so it may block; it must not throw.  A disk missing
  // from an answer has gone away: its history is dropped and it starts afresh if it comes back.
  [[nodiscard]] virtual std::vector<ForegroundDisk> sample() = 0;
};

}  // namespace qcommit::engine
