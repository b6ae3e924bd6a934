// SPDX-License-Identifier: GPL-2.0-or-later
// What the Governor keeps of one governed job (Governor::Job) and the steps its files share.
// Private to plugin/govern/governor*.cpp: the Governor is split by concern over
//   governor.cpp            the step: events, reconnect, poll and tick, pacing, escapes, stop
//   governor_discovery.cpp  finding jobs, holding them at once, adopting and releasing them
//   governor_filter.cpp     the throttle filter under a cache=none mirror's target
//   governor_status.cpp     what status() shows
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "plugin/govern/governor.h"

namespace qcommit::plugin {

// The job types the Governor paces.
[[nodiscard]] bool governed(JobType t);

// Chunk gate (direct_chunks jobs): the gate, the rate it spaces the chunks for and whether it may
// open.
struct Governor::GateState {
  explicit GateState(const throttle::ChunkGateConfig& cfg) : gate(cfg) {}
  throttle::ChunkGate gate;
  double rate = 0;
  bool allowed = true;
};

// What status() shows over time: guests' latencies and the job's bytes left.
struct Governor::History {
  std::deque<std::pair<TimePoint, Duration>> latencies;
  std::deque<std::pair<TimePoint, std::uint64_t>> left;
};

struct Governor::Job {
  Job(DiskKey k, const Policy& p, JobType t, const std::string& cache, PacedJob paced,
      TargetPacer target_pacer)
      : key(std::move(k)),
        type(t),
        policy(p),
        cache_mode(cache),
        direct_io(direct_cache(cache)),
        pacing(std::move(paced), controller_config(p, t, cache)),
        pacer(std::move(target_pacer)) {}
  // cache=none/directsync: the job's writes bypass the page cache.
  static bool direct_cache(const std::string& cache) {
    return cache == "none" || cache == "directsync";
  }
  // QEMU's commit and stream jobs write 512 KiB at a time (COMMIT_BUFFER_SIZE, STREAM_CHUNK);
  // with cache=none/directsync those writes reach the storage as they are.
  static bool direct_chunks(JobType t, const std::string& cache) {
    return direct_cache(cache) && (t == JobType::Commit || t == JobType::Pull);
  }
  static throttle::ControllerConfig controller_config(const Policy& p, JobType t,
                                                      const std::string& cache) {
    throttle::ControllerConfig c = p.controller_config();
    if (direct_chunks(t, cache)) c.copy_request_bytes = kQemuChunkBytes;
    // A mirror's requests reach the storage as they are, with or without a throttle filter
    // (which admits whole requests): no rate makes one of them shorter.
    if (direct_cache(cache) && mirror_job(t)) {
      c.copy_request_bytes = kQemuMirrorRequestBytes;
      c.copy_requests_in_flight = kQemuMirrorRequestsInFlight;
    }
    return c;
  }
  // Identity and policy.
  std::uint64_t id = 0;
  DiskKey key;
  JobType type = JobType::Unknown;
  std::string target;
  std::string storage;
  std::string pool;
  Policy policy;
  std::string cache_mode;  // the disk's <driver cache=...>
  std::string policy_error;
  bool direct_io;  // direct_cache(): its writes bypass the page cache
  // Control: its pacing (the controller and its last decision), the job as of the last tick,
  // the speed set.
  JobPacing pacing;
  JobInfo info{};
  bool has_info = false;
  bool ready = false;
  bool seen_in_poll = true;
  std::uint64_t speed_set = 0;  // as QEMU was read to have it; gated: the paced rate
  SpeedCheck check;             // its discovery, the speed asked for and read back, time to govern
  // The target's page cache and how it is pushed to storage.
  std::unique_ptr<TargetFile> file;
  TargetPacer pacer;
  std::optional<GateState> gate;
  // The throttle filter under the target, while it is in; why not, when it applies but is not.
  std::optional<TargetThrottle> throttle;
  FormatNodeOptions throttle_options;
  std::string throttle_off;
  // Held at the floor until its requests in flight are done, so that the reopen that puts the
  // filter in (which drains the target and with it the guest's disk) waits for nothing.
  std::optional<TimePoint> throttle_pending_since;
  History history;
  // The shared-queue probe: its file, schedule, latencies since the last tick, failures in a row,
  // and what status() shows.
  std::unique_ptr<ProbeFile> probe_file;
  std::optional<throttle::ProbeSchedule> probe;
  std::vector<Duration> probe_samples;
  std::uint32_t probe_failures = 0;
  std::deque<std::pair<TimePoint, Duration>> probe_history;
  std::optional<Duration> probe_last;
  bool probe_wanted = false;  // the policy asks for a probe on this job's storage
  std::string probe_local;    // probe=auto and the storage is not shared: why no probe is wanted
  // Its bytes at storage as last read (Governor::own_queue_bytes), for the other jobs on it.
  std::optional<std::uint64_t> own_queue;
  std::string probe_off;  // why there is none although wanted
  // Escaped governance (escape.h), and its storage's kernel dirty limit (JobStatus::bdi_limit).
  EscapeState escape;
  std::string bdi_limit;
};

}  // namespace qcommit::plugin
