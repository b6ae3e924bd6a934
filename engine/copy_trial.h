// SPDX-License-Identifier: GPL-2.0-or-later
// A rehearsal of the merge's copy, for `qcommit plan --measure`: the first bytes of TOP's file
// copied the way engine::merge copies them (CopyPool: TOP's pages spliced into O_DIRECT writes
// where the filesystem allows it, else copy_file_range into buffered writes with writeback
// started per request; the device's request size; kDefaultIoThreads requests and
// kDefaultInflightBytes in flight; the new space fallocated first; an fdatasync at the end, as
// each window's commit has), paced by the merge's own governor when the merge would have a
// budget, into a scratch file beside BASE that is unlinked as soon as it is created.
//
// What it cannot rehearse: the rest of TOP's data (how much of it is in the page cache), BASE's
// metadata updates (small next to the data), co-tenants that get busier later, and the
// governor's periodic slowdowns (200 ms every 10 s). estimate_copy_time turns the rehearsal into
// an ETA with a range.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/merge.h"

namespace qcommit::engine {

inline constexpr uint64_t kTrialMaxBytes = 256ull << 20;
inline constexpr auto kTrialMaxTime = std::chrono::seconds(3);  // of requests issued
// The scratch file takes at most this share of the free space of BASE's filesystem.
inline constexpr uint64_t kTrialFreeSpaceShare = 4;

struct CopyTrialOptions {
  std::string source;                 // TOP's file: its first bytes are read as the merge reads TOP
  std::string dir;                    // BASE's directory: the scratch file is created there
  uint64_t bytes = kTrialMaxBytes;    // at most this much (less where TOP or the space is smaller)
  Duration max_time = kTrialMaxTime;  // no request issued after this
  uint64_t grain = 64 * 1024;         // BASE's cluster size: device requests are whole clusters
  std::shared_ptr<CopyGovernor> governor;  // the merge's (null: unthrottled)
  double ceiling_bytes_per_s = 0;          // the governor's highest rate (0: none)
};

struct CopyTrial {
  uint64_t bytes = 0;  // copied and made durable
  double seconds = 0;  // from the first request to the end of the fdatasync
  bool direct_io = false;
  uint64_t request_bytes = 0;  // bytes per device request (splice piece)
  bool governed = false;       // paced by a governor (its rate ramps up)
  double ceiling_bytes_per_s = 0;
  // Completed bytes over time: (seconds since the first request, bytes completed so far), one
  // entry per completed request, in order.
  std::vector<std::pair<double, uint64_t>> completions;
};

// Runs the rehearsal.  Throws qcow2::Error naming the file when the scratch file cannot be
// created or written, or TOP cannot be read.
[[nodiscard]] CopyTrial run_copy_trial(const CopyTrialOptions& opt);

// An ETA from a rehearsal.  A rehearsal that copied all of `data_bytes` is the ETA.  Else the
// rehearsed bytes take what they took, and the rest:
//  * unthrottled: goes at the rate of the rehearsal's second half; the range at the rates of
//    the slower and the faster half of that half;
//  * governed: starts at the rate the rehearsal ended at and keeps growing as it grew during
//    its second half (the controller's additive increase), up to the ceiling; the range from
//    growing at least at the controller's additive increase (kAdditiveIncreaseBytesPerS2) from
//    the faster half's rate (when it still grew; else the faster half's rate), to no growth at
//    the slower half's rate.
struct CopyEstimate {
  double seconds = 0;
  double low_seconds = 0, high_seconds = 0;
  double rate_bytes_per_s = 0;  // the mean rate the rest is estimated at (0: nothing left)
};
[[nodiscard]] CopyEstimate estimate_copy_time(uint64_t data_bytes, const CopyTrial& trial);

}  // namespace qcommit::engine
