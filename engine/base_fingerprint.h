// SPDX-License-Identifier: GPL-2.0-or-later
// What binds a merge's checkpoint to the BASE it was written for. The checkpoint says the copy
// committed every window below guest offset `done`; a re-run may skip those windows only if BASE
// is still the file, and in the state, that those commits left. A BASE replaced by another file of
// the same name (another inode), rolled back to an internal snapshot or restored from a backup (its
// L1 entries for the committed range differ) does not match, and the re-run copies everything
// again instead of resuming.
//
// The fingerprint covers what an interrupted later window cannot change: the file's identity,
// the virtual size (grown before the copy), the L1 table's position and size, and the L1 entries
// of the guest range below `done` (windows go in guest order, so a later window only touches
// entries from `done` on; where it does touch the entry `done` falls in, e.g. copying an L2 table
// shared with an internal snapshot, the fingerprint differs and the re-run starts over: slower,
// never wrong). A raw BASE has no metadata: its identity alone.
#pragma once

#include <cstdint>
#include <string>

#include "qcow2/chain.h"

namespace qcommit::engine {

// The fingerprint of `base` (a layer of an open chain: as its tables are in memory, which after a
// commit is what is on disk) for a checkpoint at guest offset `done`.
[[nodiscard]] std::string base_fingerprint(const qcow2::Layer& base, uint64_t done);

}  // namespace qcommit::engine
