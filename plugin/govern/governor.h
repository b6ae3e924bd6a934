// SPDX-License-Identifier: GPL-2.0-or-later
// The daemon's policy: which block jobs to govern and at what speed, and how much of their
// target's page cache to push to storage.  Knows nothing of libvirt: it talks to a Hypervisor
// and to TargetFiles, and `now` is always a parameter.
//
// Per tick (every GovernorOptions::tick) and governed job:
//  * foreground signals: for every running domain's disk on the same storage as the job's
//    target (same libvirt pool, else same st_dev, else the same path), the block-stats deltas
//    block stats become latency samples and suspected stalls as throttle/io_stats.h describes
//    (the offline merge reads its co-tenants' stats through the same code);
//  * backlog = pages of the target under writeback + dirty pages beyond one pace interval's
//    production at the current speed (the pacer below pushes fresh dirty pages every `pace`, so
//    only dirty pages it could not push count as queued); drained = Δcur − backlog growth,
//    smoothed (QEMU reports progress in bursts) by a credit released at ≤ 2 × the paced rate;
//  * throttle::Controller decides; the job speed becomes the decision's rate, or the minimum
//    speed (never 0: 0 is "unlimited" in QEMU) while paused or while the queued bytes (under
//    writeback, plus dirty beyond kDirtyAllowanceBytes) exceed the window;
//  * every `pace` the WritebackPlanner starts writeback of the target's dirty pages within the
//    last window;
//  * a job whose target is far dirtier than its window allows (escape.h: adopted late, after a
//    restart, or QEMU did not take its speed) has escaped: said once, held at the minimum speed
//    until the pacer has written its target out to the window (a mirror that is never ready
//    cannot be pivoted); from then on, until it ends, its storage's dirty pages are bounded in
//    the kernel (bdi_limit.h, GovernorOptions::bdi_state_path), so that it cannot escape again;
//    not before, as a limit far below what is already dirty would block every writer of that
//    storage, the guests' own writes included, until all of it is written back;
//  * shared-queue probe (policy `probe`, throttle/probe.h): a 4 KiB write + fdatasync of a file
//    beside the target, started when its ProbeSchedule says, at every step; its latencies and the
//    age of the one running go to the controller (TickInput::probe_latencies/probe_outstanding),
//    so a job holds back for guests on other hosts sharing the storage.  A probe that fails
//    kMaxProbeFailures times in a row is given up.  A probe the policy asks for but that cannot
//    be had (no file can be created beside the target, the target is a block device) or that
//    was given up leaves the job running without it: JobStatus::probe is kOff with the reason.
// Without cachestat(2) (Linux < 6.5) the page-cache reading is host-wide: the backlog is at most
// what the job copied since the start of the last completed fdatasync of its target, which
// `pace` runs while the job copies (at most one per kFallbackSyncGap) instead of the planner;
// cache=none/directsync jobs have no backlog there.
// Discovery: JOB_STATUS_CHANGE events trigger a scan of the domain at the next step; BLOCK_JOB_2
// completed/failed/canceled release the state; every `poll` all disks of all running domains
// are polled (adopts jobs running before start and after reconnects).
// Races (the event loop dispatches an event only after the calls in flight returned, so a poll or
// tick can see a job's end, or the next job on the same disk, before the event of the first):
//  * a job is adopted once: a disk's job whose query fails (JobQuery::kUnknown) is kept as it is,
//    not released and adopted again when the query works once more;
//  * a job listed on a governed disk that cannot be the governed one (another type, or its
//    progress went back) replaces it: the governed one is released, the new one adopted;
//  * an end event for a job released already (a tick saw it gone first) gives that release its
//    reason; one for a disk whose next job the daemon already governs leaves that job alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plugin/policy/config.h"
#include "plugin/hypervisor/hypervisor.h"
#include "plugin/govern/bdi_limit.h"
#include "plugin/govern/escape.h"
#include "plugin/govern/job_pacing.h"
#include "plugin/govern/speed_check.h"
#include "plugin/govern/target_pacer.h"
#include "plugin/govern/target_throttle.h"
#include "plugin/govern/writeback.h"
#include "throttle/backoff.h"
#include "throttle/chunk_gate.h"
#include "throttle/controller.h"
#include "throttle/io_stats.h"

namespace qcommit::plugin {

inline constexpr Duration kLatencyHistory = std::chrono::seconds(10);  // p99 over this
inline constexpr Duration kEtaHistory = std::chrono::seconds(5);
inline constexpr std::size_t kMaxReleasedHistory = 32;
inline constexpr std::size_t kMaxLatencySamples = 100000;
inline constexpr double kSpeedChangeFraction = 0.02;  // re-set the speed when off by > 2 %
// Storage counts as idle (nobody to protect, TickInput::foreground_idle) once no guest disk on it
// has completed any I/O for this long: several ticks, so that a guest writing now and then (a
// probe every 100 ms, a log every few hundred ms) never makes its quiet ticks look idle.
inline constexpr Duration kIdleStorageAfter = std::chrono::seconds(1);
// QEMU's commit (non-active) and stream jobs copy this much per request.
inline constexpr std::uint64_t kQemuChunkBytes = 512 * 1024;
// Chunk gate (throttle/chunk_gate.h) for those jobs when their chunks reach the storage as they
// are (cache=none/directsync): the speed that opens the gate (wakes the job for one chunk) and,
// as a fraction of the paced rate, the speed that keeps it closed.  QEMU 7.2 sleeps after a chunk
// until the job's average since the start of its rate-limit slice is down to the speed: below
// the rate it achieves, it sleeps until the next opening.  If the daemon dies with the gate
// closed the job sleeps up to about (1 / fraction - 1) x its time so far, then goes on at that
// speed (lab, tests/lab/gate_kill_experiment.sh: 3.8 s after 10 s, 15.6 s after 25 s); open, it
// goes on unthrottled.
// Only for QEMU before 8.1 (Hypervisor::qemu_version): from 8.1 the job also sleeps before every
// 512 KiB step it skips as unallocated, so a closed gate would cost one period per skipped step.
inline constexpr std::uint64_t kChunkGateOpenSpeedBytesPerS = 1ull << 40;
inline constexpr double kChunkGateClosedRateFraction = 0.5;
inline constexpr std::uint64_t kChunkGateBeforeQemuVersion = 8001000;
inline constexpr std::uint32_t kMaxProbeFailures = 3;
// A job waiting for its throttle filter is held at the floor until a tick sees no progress (its
// requests in flight are done), at most this long.
inline constexpr Duration kThrottleQuietWait = std::chrono::seconds(2);
// Only from QEMU 8.1 (Hypervisor::qemu_version), whose rate limit obeys low speeds and so made a
// cache=none active commit crawl chasing a p99 its bursts make unreachable (lab, QEMU 10.0.13,
// qcow2 base, 1.5 GiB: 114.6 s without the filter, 59.5 s with it, max 113 -> 90 ms).  On QEMU
// 7.2 putting the filter in froze the guest for 0.4-0.8 s (blockdev-reopen; the storage never
// had more than one of the job's requests ahead of a guest's), which the bursts it spreads do
// not cost there (lab, raw base, 1.5 GiB: gap 0.83 s with it, 0.16 s without; 40.3 / 46.0 s).
inline constexpr std::uint64_t kThrottleFilterFromQemuVersion = 8001000;
// QEMU's mirror (active commit) writes its copy in requests of this size (MAX_IO_BYTES): one of
// them ahead of a guest's request is a delay no rate avoids (ControllerConfig::copy_request_bytes).
inline constexpr std::uint64_t kQemuMirrorRequestBytes = 1024 * 1024;
// ... and keeps up to this many of them in flight (MAX_IN_FLIGHT): a guest's request may find
// them all ahead of it (ControllerConfig::copy_requests_in_flight).  The commit and stream jobs
// keep one.
inline constexpr std::uint32_t kQemuMirrorRequestsInFlight = 16;
// The throttle filter shapes the job's bursts; the job's speed, set as for any job, keeps its
// average.  The filter lets a burst out at this multiple of the speed (at least
// kMinThrottleRateBytesPerS), and follows the speed only when it is off by more than
// kThrottleRateHysteresis either way.
// Pacing by the filter instead (its rate the controller's, the job 4x faster so its requests
// wait in the filter) was tried and froze the guest: a qcow2 BASE writes its metadata through the
// filter too, behind up to 16 MiB of the job's queued copy, while holding the image's lock that
// the guest's reads through the overlay need (lab, QEMU 10.0.13, qcow2 base, 1.5 GiB,
// 2026-12-03: one gap of 11.6 s when a pause set the filter to 1 MiB/s; p99 122.0 ms against
// 127.7 ms this way, and as many of the job's requests at the storage at once, 3-4 at p99).
inline constexpr double kThrottleRateFactor = 1.5;
inline constexpr std::uint64_t kMinThrottleRateBytesPerS = 4ull * 1024 * 1024;
inline constexpr double kThrottleRateHysteresis = 1.5;

struct GovernorOptions {
  Duration tick = std::chrono::milliseconds(100);
  Duration poll = std::chrono::milliseconds(500);
  // Writeback pacing runs this often.  Must be well below the latency budget: the pacer keeps at
  // most one window under writeback, so it can push at most window / pace per second, and with
  // window = budget × drain a pace equal to the budget would pin the drain estimate where it is.
  // Storage idles from the moment a window's writeback completes until the next pace sees it:
  // with a 10 ms per-request budget at 50 MB/s (a 0.5 MB window) a 5 ms pace kept the lab's
  // storage 47 % busy and the job at 22 MB/s; 2 ms: 75 % busy, 35 MB/s.
  Duration pace = std::chrono::milliseconds(2);
  // A whole-file page-cache reading (cachestat over the target) costs CPU in proportion to the
  // target's cached pages: every 5 ms on a 2.5 GiB base with 1.5 GiB cached it took 67 % of a
  // core in the lab, and that CPU showed up as guest latency that paused the job.  The tick
  // reads the whole file; the pacer re-reads it only when the last reading is older than this.
  // In between it re-reads just the ranges it started writeback on (IssuedRanges), so it sees
  // its writeback complete without waiting for the next whole-file reading.
  Duration page_cache_refresh = std::chrono::milliseconds(100);
  // The kernel's flusher writes back, in one go, every dirty page of an inode that has stayed
  // dirty longer than vm.dirty_expire_centisecs (30 s), then again every
  // dirty_writeback_centisecs (5 s) while it stays dirty.  A paced job keeps its target dirty
  // without a break, so from 30 s on the flusher queued up to one dirty allowance (16 MiB:
  // 230 ms at 50 MB/s) ahead of the guests every 5 s (lab, 1.5 GiB active commit).  Every
  // `settle_every` the governor holds the job at the floor until the target has no dirty pages
  // and fdatasyncs it (the inode is clean, its expiry clock restarts); a hold that does not
  // reach that within `settle_max_hold` is abandoned and retried an interval later.  Where the
  // target's dirty count is only an upper bound (a kernel without cachestat: its memory cgroup,
  // which the guests' own cached writes inflate), "no dirty pages" is a sweep of the whole
  // target by the pacer that found nothing to write back.
  // Zero disables.  The daemon sets it from the host's dirty_expire (a third of it, <= 10 s).
  Duration settle_every = std::chrono::seconds(10);
  Duration settle_max_hold = std::chrono::seconds(2);
  Duration reconnect_min = std::chrono::milliseconds(500);
  Duration reconnect_max = std::chrono::seconds(5);
  std::uint64_t min_speed_bytes_per_s = kMinJobSpeedBytesPerS;
  // Space QEMU's 512 KiB commit/stream chunks with the chunk gate (cache=none/directsync).
  bool chunk_gate = true;
  // Meter an active commit into a cache=none/directsync target with a throttle filter node under
  // the target (plugin/target_throttle.h) instead of the job's speed, where the hypervisor takes
  // QMP commands and the target's node options are known.  The job's own speed is then its
  // policy's ceiling: the filter alone paces it.
  bool target_throttle = true;
  // Where the governor says what it did outside a job's figures (filters a dead process left in
  // QEMU, removed or not); empty: not said.
  std::function<void(const std::string&)> notice;
  throttle::ChunkGateConfig chunk_gate_config{kQemuChunkBytes, std::chrono::milliseconds(2)};
  WritebackConfig writeback;
  // When set, only the job on this domain's disk target is governed (`qcommit live` runs a
  // governor in-process for the job it started); the other disks still give foreground signals.
  std::optional<std::pair<std::string, std::string>> only_disk;
  // A cap on every governed job's speed whatever its policy says (`qcommit live --max-rate`):
  // the policy's ceiling (and a higher floor) come down to it.  At least min_speed_bytes_per_s.
  std::optional<double> max_rate_bytes_per_s;
  // A clock the hosts sharing a storage keep in sync (NTP-disciplined CLOCK_REALTIME, as time
  // since the epoch), read at every tick: the controllers' periodic slowdowns are slotted on it
  // (TickInput::wall_clock), so that the merges of every host drain the storage's queue together.
  // Empty: slowdowns are slotted on the governor's own clock.
  std::function<std::optional<Duration>()> wall_clock;
  // The governor's own clock read within a step, for the stamps of a job's time to govern (a
  // step's hypervisor calls and file work take time).  Empty: the step's `now`.
  std::function<TimePoint()> clock;
  // A job that escaped governance (escape.h) gets its target storage's dirty pages bounded in
  // the kernel once its target is back within its window, until it ends (bdi_limit.h): sysfs is at `sysfs_root`, and what the limits
  // changed is recorded in `bdi_state_path` (the daemon's runtime directory) and restored by the
  // next Governor with that path should this process die.  Empty path: no kernel limits.
  // bdi_limits false: none set, but a record left by a process that died is still restored.
  std::string bdi_state_path;
  bool bdi_limits = true;
  std::string sysfs_root = "/sys";
  [[nodiscard]] std::optional<std::string> validate() const;
};

// settle_every for a host whose vm.dirty_expire_centisecs is `expire`: a third of it, within
// [1 s, 10 s]; 10 s when unknown or 0 (expiry off).
[[nodiscard]] Duration settle_interval_for(std::optional<std::chrono::milliseconds> expire);

// The shared-queue probe of a job: disabled by its policy (probe=off), not wanted on this storage
// (probe=auto, the default, and the target's filesystem is local to this host), on, or off
// although the policy asks for it.  JobStatus::probe_off_reason says why for kLocal and kOff.
enum class ProbeState { kDisabled, kLocal, kOn, kOff };
// "disabled", "local", "on", "off".
[[nodiscard]] const char* to_string(ProbeState s);

struct JobStatus {
  std::uint64_t id = 0;  // adoption number (1, 2, ...): one per job adopted, kept while governed
  std::string domain;
  std::string disk;
  JobType type = JobType::Unknown;
  std::string target;
  std::string storage;  // pool name, "dev:N" or "path:..."
  std::string pool;     // empty when the storage is not a libvirt pool
  Duration budget{};
  std::uint64_t speed_bytes_per_s = 0;  // QEMU's speed as read back after our last call
  std::uint64_t speed_wanted_bytes_per_s = 0;  // the speed asked for last
  // From the job's discovery (QEMU's event, or the poll that listed it) to the first speed read
  // back from QEMU as set; nullopt until then.  late_adoption: it had copied more than
  // kLateAdoptionBytes by then (copied_before_governed_bytes).
  std::optional<Duration> time_to_govern;
  FoundBy found_by = FoundBy::kPoll;
  // Each step of the time to govern, from the job's discovery (nullopt: not reached).
  std::optional<Duration> scan_began_after;   // the scan that listed it began
  std::optional<Duration> job_listed_after;   // libvirt listed the job on its disk
  std::optional<Duration> speed_taken_after;  // the hypervisor took the first speed call
  std::uint64_t copied_before_governed_bytes = 0;
  bool late_adoption = false;
  std::uint64_t window_bytes = 0;
  std::uint64_t backlog_bytes = 0;
  // The last decision's delay per storage request: measured (the guests', the probe's) and
  // charged to the job (less where the guests' own requests explain the rest, throttle::
  // Decision::own_queue_bounded); the job's own bytes at storage (nullopt: unknown; the
  // controller was told those of every job of this host on its storage) and the rate the
  // charge divides bytes by (throttle::Decision::own_queue_rate_bytes_per_s).
  std::optional<Duration> delay_measured;
  std::optional<Duration> delay_charged;
  std::optional<std::uint64_t> own_queue_bytes;
  double own_queue_rate_bytes_per_s = 0;
  std::optional<Duration> latency_p99;  // guests on the same storage, last kLatencyHistory
  std::uint64_t bytes_left = 0;
  // From how fast bytes_left shrank over kEtaHistory (a mirror's grows with the guests' writes);
  // nullopt while it does not shrink.
  std::optional<double> eta_s;
  // A mirror not ready yet (job_pacing.h, kConvergeWindow): whether its bytes left shrank over
  // the last window (nullopt: not a mirror, ready, or not a whole window seen yet), the rate the
  // guests' writes add to them, and the converge floor once on (0: off).
  std::optional<bool> converging;
  double added_bytes_per_s = 0;
  double converge_floor_bytes_per_s = 0;
  std::string phase;
  bool ready = false;
  bool settling = false;      // held at the floor until the target is clean (not logged)
  std::uint32_t settles = 0;  // times the target was made clean (GovernorOptions::settle_every)
  // Holds that did not make it clean in time (each the next one may take longer: target_pacer.h).
  std::uint32_t settles_given_up = 0;
  ProbeState probe = ProbeState::kDisabled;  // the shared-queue probe
  std::string probe_off_reason;  // kOff, kLocal: why, naming the file or target (and the error)
  std::optional<Duration> probe_period;  // the shared-queue probe's period; nullopt: no probe
  std::optional<Duration> probe_p99;     // its latency (write + fdatasync), last kLatencyHistory
  std::optional<Duration> probe_last;    // the latency of the last probe that completed
  std::string policy_error;              // bad domain metadata (the pool/default policy applies)
  // The throttle filter under the target (GovernorOptions::target_throttle): "on", "off: why",
  // or "" where it does not apply (not an active commit into a cache=none target).
  std::string target_throttle;
  // Floor-limited (throttle::kFloorLimitedDrainShare): which of QEMU's requests set the floor the
  // job runs at, that floor at the storage's measured rate against the budget, the share of the
  // storage the job keeps, and what would do better; "" where no floor applies.
  std::string floor;
  // The job escaped governance (escape.h): its target held escaped_bytes dirty or under
  // writeback at the most, escape_cost of storage at the drain rate known to the job; held at
  // the floor until its target is within the window (escape_held); the kernel's dirty limit on
  // its storage: "on: ...", "off: why", or "" (not escaped, or no limits configured).
  bool escaped = false;
  std::uint64_t escaped_bytes = 0;
  std::optional<Duration> escape_cost;
  bool escape_held = false;
  std::string bdi_limit;
};

// Reasons a job is released for: libvirt's end events, and ends the daemon saw without one.
inline constexpr const char* kEndCompleted = "completed";
inline constexpr const char* kEndCanceled = "canceled";
inline constexpr const char* kEndFailed = "failed";
inline constexpr const char* kEndPivotFailed = "failed after ready (pivot failed)";
inline constexpr const char* kEndNotListed = "no longer listed";
inline constexpr const char* kEndWhileDisconnected = "ended while disconnected";
// An end event may reach the daemon this long after a poll or tick saw the job gone.
inline constexpr Duration kLateEndEvent = std::chrono::seconds(10);

struct ReleasedJob {
  std::uint64_t id = 0;  // JobStatus::id
  std::string domain;
  std::string disk;
  JobType type = JobType::Unknown;
  std::string reason;
  TimePoint at{};
  bool from_event = false;  // the reason is libvirt's end event (else the daemon saw it gone)
  bool ready = false;       // the job had become ready (a mirror that failed then: the pivot)
};

// How a released job ended, in one word: "pivoted" (an active commit or copy completed: libvirt
// completes them only by pivoting), "completed", "canceled", "failed", "pivot-failed", or "ended"
// (the daemon saw it gone without libvirt's word on how).
[[nodiscard]] const char* end_state(const ReleasedJob& r);

struct GovernorStatus {
  bool connected = false;
  std::vector<JobStatus> jobs;
  std::deque<ReleasedJob> released;
};

class Governor {
 public:
  Governor(Hypervisor& hv, TargetFiles& files, DaemonConfig cfg, GovernorOptions opt = {});

  // Restores the kernel dirty limits a process that died left recorded at
  // GovernorOptions::bdi_state_path.  Called by the daemon once it owns its control socket, so
  // that a second qcommitd started by mistake never undoes the running one's limits.
  void restore_recorded_limits();
  ~Governor();
  Governor(const Governor&) = delete;
  Governor& operator=(const Governor&) = delete;

  // Does what is due at `now` (events, reconnect, poll, tick); returns when to call again.
  [[nodiscard]] TimePoint step(TimePoint now);

  // News from the libvirt hook (a domain started, stopped, was reconnected or released): the
  // next step() looks at that domain at once instead of at the next poll — a new co-tenant's
  // stats count from its start, a stopped domain's jobs and stats are dropped.
  void domain_event(const std::string& domain, const std::string& event);

  // An active commit about to pivot: QEMU's last step before the switch flushes the target while
  // the guest's requests wait (mirror drains, then fdatasync), so whatever the target still has
  // dirty then is a freeze of the guest.  The first call holds the job at the floor and settles
  // the target (as settle_every does); true once that settle is done (the job stays held until
  // it ends), when it could not be done within the hold's limit (settle_max_hold, longer after
  // holds given up: target_pacer.h), or when there is nothing to settle (no such job, no target
  // file, settling off).
  [[nodiscard]] bool settled_for_pivot(const std::string& domain, const std::string& disk,
                                       TimePoint now);

  // Graceful stop: every governed job gets a finishing speed (max(floor, last rate)).
  void release_all();

  [[nodiscard]] GovernorStatus status(TimePoint now) const;
  [[nodiscard]] std::size_t job_count() const { return jobs_.size(); }

 private:
  struct DiskKey {
    std::string domain, disk;
    auto operator<=>(const DiskKey&) const = default;
  };
  struct GateState;
  struct History;
  struct Job;
  struct StorageSignals {
    std::map<std::string, throttle::ForegroundSignals> signals;  // per storage key
    std::set<std::string> not_idle;
  };

  void handle_events(TimePoint now);
  void job_ended(const JobEvent& e, TimePoint now);
  [[nodiscard]] ReleasedJob* late_end(const std::string& domain, const std::string& disk,
                                      TimePoint now);
  // The job the hypervisor lists on j's disk is j (same type, progress not gone back).
  [[nodiscard]] static bool same_job(const Job& j, const JobInfo& listed);
  [[nodiscard]] static std::string gone_reason(const Job& j);
  // A job found on a disk by poll(): held at its first speed before adopt() gathers the rest.
  struct Found {
    const DomainInfo* dom = nullptr;
    DiskInfo disk;
    JobInfo info;
    SpeedCheck check;
  };
  void poll(TimePoint now, const std::set<std::string>* only_domains);
  [[nodiscard]] std::vector<DomainInfo> scanned_domains(const std::set<std::string>& names);
  // The governed jobs of the domains polled (into `listed`); each new one held at once.
  // `scan_began`: when the poll began (clock_now()), the first step of a time to govern of a
  // job an event announced (a job the poll found counts from its listing).
  [[nodiscard]] std::vector<Found> find_jobs(const std::vector<DomainInfo>& doms,
                                             const std::set<std::string>* only_domains,
                                             std::set<DiskKey>& listed, TimePoint now,
                                             TimePoint scan_began);
  [[nodiscard]] SpeedCheck discovery_of(const std::string& domain,
                                        const GovernStages& stages) const;
  // `stages`: the scan's beginning and the job's listing (GovernStages), for the time to govern.
  [[nodiscard]] SpeedCheck hold_found_job(const DomainInfo& dom, const DiskInfo& disk,
                                          const JobInfo& info, GovernStages stages);
  // What a job starts at: the floor while a throttle filter waits to go in, a gate's closed
  // speed, else its initial speed (`initial`).
  [[nodiscard]] std::uint64_t start_speed(const DiskInfo& disk, JobType type,
                                          double initial) const;
  [[nodiscard]] bool throttle_filter_wanted(const DiskInfo& disk, JobType type) const;
  [[nodiscard]] bool gate_wanted(const DiskInfo& disk, JobType type) const;
  void adopt(Found& f, TimePoint now);
  void release(const DiskKey& k, const std::string& reason, TimePoint now, bool from_event = false);
  void tick(TimePoint now);
  [[nodiscard]] StorageSignals read_foreground(TimePoint now);
  void tick_job(Job& j, const JobInfo& info, const throttle::ForegroundSignals& s,
                bool storage_idle, TimePoint now);
  [[nodiscard]] std::optional<std::uint64_t> local_copies_queue(const Job& j) const;
  void apply_speed(Job& j, const JobInfo& info, JobSpeed js);
  void record_tick(Job& j, const throttle::ForegroundSignals& s, const JobInfo& info,
                   std::uint64_t backlog, TimePoint now);
  void pace_gates(TimePoint now);    // open and close the chunk gates
  void pace(TimePoint now);          // writeback pacing of the other jobs
  void drive_probes(TimePoint now);  // collect and start the shared-queue probes
  // probe=auto: "" when the storage of `target` can be shared with other hosts, else why the
  // probe is not wanted there (naming the target and its filesystem).
  [[nodiscard]] std::string unshared_storage(const std::string& target);
  [[nodiscard]] std::string storage_key(const std::string& path, std::optional<std::uint64_t> dev,
                                        std::optional<PoolInfo>* pool_out);
  [[nodiscard]] std::optional<PoolInfo> resolve_pool(const std::string& path);
  void set_speed(Job& j, std::uint64_t speed);
  // The job's speed as QEMU has it right after a call asking for `wanted`, into `check` (and
  // `*speed_set`); a mismatch is said through opt_.notice.
  void read_back(const DiskKey& k, std::uint64_t wanted, bool accepted, SpeedCheck& check,
                 std::uint64_t* speed_set);
  void notice_all(const std::vector<std::string>& lines) const;  // through opt_.notice, if set
  [[nodiscard]] TimePoint clock_now() const { return opt_.clock ? opt_.clock() : step_now_; }
  void set_gate_speed(Job& j, bool open);  // the chunk gate's open or closed speed
  // The throttle filter under a job's target: in, its rate after the job's speed, out (ready,
  // end, stop); and those a dead qcommit process left in QEMU.
  [[nodiscard]] QmpCall qmp_for(const std::string& domain);
  void insert_target_throttle(Job& j);
  void follow_target_throttle(Job& j);
  [[nodiscard]] std::uint64_t throttle_rate_for(std::uint64_t speed) const;
  void remove_target_throttle(Job& j);
  void sweep_orphan_throttles(const std::vector<DomainInfo>& doms);
  void lost_connection(TimePoint now);
  // Escaped jobs (escape.h): this tick's exact reading of the target; true while the job is
  // held at the floor for it.  Its storage's kernel dirty limit once it is back within its
  // window, off at its release.
  [[nodiscard]] bool track_escape(Job& j, const std::optional<PageCacheState>& pc,
                                  const throttle::Decision& d, TimePoint now);
  void limit_target_bdi(Job& j, std::uint64_t window_bytes);
  void release_target_bdi(std::uint64_t id);

  Hypervisor& hv_;
  TargetFiles& files_;
  DaemonConfig cfg_;
  GovernorOptions opt_;
  std::vector<JobEvent> pending_events_;
  std::set<std::string> scan_domains_;
  // Per domain: the earliest QEMU event since its last scan saying a job started (its time).
  std::map<std::string, TimePoint> job_started_events_;
  TimePoint step_now_{};
  bool connected_ = false;
  bool sweep_orphans_ = false;  // at the next full poll: filters a dead process left in QEMU
  bool was_ever_connected_ = false;
  throttle::Backoff reconnect_;
  std::optional<TimePoint> next_poll_;
  std::optional<TimePoint> next_tick_;
  std::optional<TimePoint> next_pace_;
  std::vector<DomainInfo> domains_;
  std::vector<PoolInfo> pools_;
  std::map<std::string, std::optional<PoolInfo>> pool_cache_;
  std::map<DiskKey, throttle::IoCounterSampler> guests_;
  std::map<DiskKey, std::unique_ptr<Job>> jobs_;
  std::deque<ReleasedJob> released_;
  std::uint64_t adopted_ = 0;  // jobs adopted so far (the last JobStatus::id)
  std::unique_ptr<BdiLimits> bdi_;  // GovernorOptions::bdi_state_path set
};

}  // namespace qcommit::plugin
