// SPDX-License-Identifier: GPL-2.0-or-later
// Scripted Hypervisor and TargetFiles for the governor tests.
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plugin/hypervisor/hypervisor.h"
#include "plugin/govern/writeback.h"

namespace qcommit::plugin::test {

struct SpeedCall {
  std::string domain, disk;
  std::uint64_t speed;
  throttle::TimePoint at{};  // FakeHypervisor::clock when the call was made
};

class FakeHypervisor final : public Hypervisor {
 public:
  // --- script ---
  bool daemon_up = true;  // libvirtd reachable
  std::vector<DomainInfo> domains;
  std::vector<PoolInfo> pool_list;
  std::map<std::string, PoolInfo> volumes;  // path → pool
  std::map<std::pair<std::string, std::string>, BlockStats> stats;
  std::map<std::pair<std::string, std::string>, JobInfo> jobs;
  std::vector<SpeedCall> speed_calls;
  // Reads the test's clock for SpeedCall::at; empty: calls are not stamped.
  std::function<throttle::TimePoint()> clock;
  // This many speed calls from now on succeed but leave the job's speed as it was (a speed QEMU
  // did not take).
  int speed_calls_ignored = 0;
  // Called once per domain described (running_domains, domain): a test makes libvirt's
  // per-domain calls (its XML, its metadata) slow by advancing its clock.
  std::function<void()> on_describe;
  // Called at each speed call before it is taken: a test makes the call slow the same way.
  std::function<void()> on_set_speed;
  // Disks whose job query fails while the connection stays up (libvirt's domain lock timing out,
  // a domain in transition): query_job says kUnknown, job_info nothing.
  std::set<std::pair<std::string, std::string>> unknown_jobs;
  int job_queries = 0;
  std::optional<std::uint64_t> version = 7002000;  // QEMU 7.2, Debian 12's
  int connects = 0;
  // QMP commands (qmp_command): answered by `qmp` when set, else refused; every one is logged.
  std::function<std::optional<json::Value>(std::string_view, const json::Value&, std::string*)> qmp;
  std::vector<std::pair<std::string, json::Value>> qmp_log;

  void libvirtd_stops() {
    daemon_up = false;
    connected_ = false;
  }
  // The connection breaks while libvirtd stays up (it restarted): connect() works again.
  void connection_drops() { connected_ = false; }
  void emit(const JobEvent& e) {
    if (sink_ && connected_) sink_(e);
  }
  [[nodiscard]] std::uint64_t speed(const std::string& dom, const std::string& disk) const {
    auto it = jobs.find({dom, disk});
    return it == jobs.end() ? 0 : it->second.bandwidth_bytes_per_s;
  }

  // --- Hypervisor ---
  bool connect() override {
    ++connects;
    connected_ = daemon_up;
    return connected_;
  }
  bool connected() const override { return connected_; }
  std::optional<std::uint64_t> qemu_version() const override { return version; }
  std::vector<DomainInfo> running_domains() override {
    check();
    if (on_describe)
      for (std::size_t i = 0; i < domains.size(); ++i) on_describe();
    return domains;
  }
  std::optional<DomainInfo> running_domain(const std::string& name) override {
    check();
    for (const DomainInfo& d : domains)
      if (d.name == name) {
        if (on_describe) on_describe();
        return d;
      }
    return std::nullopt;
  }
  std::vector<PoolInfo> pools() override {
    check();
    return pool_list;
  }
  std::optional<PoolInfo> pool_of_volume(const std::string& path) override {
    check();
    auto it = volumes.find(path);
    if (it == volumes.end()) return std::nullopt;
    return it->second;
  }
  std::optional<BlockStats> block_stats(const std::string& d, const std::string& k) override {
    check();
    auto it = stats.find({d, k});
    if (it == stats.end()) return std::nullopt;
    return it->second;
  }
  std::optional<JobInfo> job_info(const std::string& d, const std::string& k) override {
    check();
    ++job_queries;
    if (unknown_jobs.count({d, k})) return std::nullopt;
    auto it = jobs.find({d, k});
    if (it == jobs.end()) return std::nullopt;
    return it->second;
  }
  JobQuery query_job(const std::string& d, const std::string& k) override {
    check();
    if (unknown_jobs.count({d, k})) {
      ++job_queries;
      return JobQuery{JobQuery::State::kUnknown, {}};
    }
    std::optional<JobInfo> j = job_info(d, k);
    return j ? JobQuery{JobQuery::State::kRunning, *j} : JobQuery{};
  }
  bool set_job_speed(const std::string& d, const std::string& k, std::uint64_t bps) override {
    check();
    if (on_set_speed) on_set_speed();
    speed_calls.push_back({d, k, bps, clock ? clock() : throttle::TimePoint{}});
    auto it = jobs.find({d, k});
    if (it == jobs.end()) return false;
    if (speed_calls_ignored > 0) {
      --speed_calls_ignored;
      return true;
    }
    it->second.bandwidth_bytes_per_s = bps;
    return true;
  }
  void set_event_sink(EventSink sink) override { sink_ = std::move(sink); }
  std::optional<json::Value> qmp_command(const std::string& domain, std::string_view command,
                                         const json::Value& args, std::string* error) override {
    check();
    (void)domain;
    qmp_log.emplace_back(std::string(command), args);
    if (!qmp) return Hypervisor::qmp_command(domain, command, args, error);
    return qmp(command, args, error);
  }

 private:
  void check() const {
    if (!connected_) throw HypervisorDisconnected("fake: libvirtd is down");
  }
  bool connected_ = false;
  EventSink sink_;
};

// A target file whose page cache the test scripts: `dirty` bytes not yet under writeback,
// `writeback` bytes queued at storage.  start_writeback moves dirty bytes of the range.
struct FakeFileState {
  std::uint64_t size = 1ull << 30;
  std::uint64_t device = 7;
  std::uint64_t dirty = 0;
  std::uint64_t writeback = 0;  // total; `queue` holds where (what start_writeback issued)
  std::uint64_t writeback_started = 0;
  std::uint64_t range_readings = 0;               // page_cache_in calls
  std::uint64_t whole_readings = 0;               // page_cache calls
  std::uint64_t dirty_probes = 0;                 // dirty_in calls
  std::vector<ByteRange> dropped;                 // drop_cached calls
  std::vector<std::uint64_t> settled_with_dirty;  // dirty bytes at each start_settle
  bool settle_busy = false;                       // a test can hold a settle "in progress"
  bool ranges_readable = true;  // false: page_cache_in fails (no per-range cachestat)
  // A kernel without cachestat(2): whole-file readings are host-wide (per_file false, plus
  // `other_dirty` bytes of other writers), ranges cannot be read, and a settle is a real
  // fdatasync: it starts writeback of every dirty byte and lasts until none is left.
  bool host_wide = false;
  std::uint64_t other_dirty = 0;
  bool sync_running = false;
  // A kernel without cachestat(2) read through QEMU's memory cgroup: whole-file readings are an
  // upper bound (dirty_upper_bound), `cgroup_other_dirty` bytes above the file's (the guests'
  // cached writes); per-range readings stay exact.
  bool memcg_bound = false;
  std::uint64_t cgroup_other_dirty = 0;
  // Where the dirty bytes are: spread evenly over the file (default), or all in [0, dirty).
  bool dirty_at_front = false;
  // The dirty bytes' layout keeps still while the pacer issues a plan's ranges one after the
  // other: ranges whose writeback started since `dirty` was last set from outside (a test, the
  // world's copy) hold none of them, and the rest lie as `layout_dirty` lay then.
  std::uint64_t layout_dirty = 0;
  std::uint64_t dirty_left_by_writeback = ~std::uint64_t{0};
  std::vector<ByteRange> issued_since_layout;
  // The kernel's flusher takes every dirty byte right after each whole-file reading (the reading
  // is stale at once).
  bool flusher_after_reading = false;
  // Writeback queued at storage, oldest first: a range and its bytes still under writeback.
  std::deque<std::pair<ByteRange, std::uint64_t>> queue;
  // Busy periods of the writeback (TargetFile::take_service_samples), as the world times them.
  std::vector<throttle::CopySample> service;

  // Storage completes `n` bytes of writeback, oldest first.  Writeback not in `queue` (set by a
  // test directly, like the kernel's flusher would) completes after it.
  void drain(std::uint64_t n) {
    n = std::min(n, writeback);
    writeback -= n;
    std::uint64_t queued = 0;
    for (const auto& q : queue) queued += q.second;
    // Drained bytes come out of the queue first, then out of unqueued writeback.
    while (n > 0 && !queue.empty()) {
      const std::uint64_t d = std::min(n, queue.front().second);
      queue.front().second -= d;
      n -= d;
      queued -= d;
      if (queue.front().second == 0) queue.pop_front();
    }
    // Never more queued than under writeback in total.
    while (queued > writeback && !queue.empty()) {
      const std::uint64_t d = std::min(queued - writeback, queue.front().second);
      queue.front().second -= d;
      queued -= d;
      if (queue.front().second == 0) queue.pop_front();
    }
  }
};

// A shared-queue probe on the targets' storage: each probe completes at once (by the next
// governor step) with `latency`, or fails while it is nullopt.
struct FakeProbeState {
  std::optional<std::chrono::nanoseconds> latency = std::chrono::milliseconds(2);
  int opened = 0;
  int started = 0;
};

class FakeTargetFiles final : public TargetFiles {
 public:
  std::map<std::string, std::shared_ptr<FakeFileState>> files;
  std::optional<std::string> commit_base_answer;  // what the host tells of a commit's base
  std::optional<std::vector<ByteRange>> commit_extents_answer;  // what a commit copies
  std::shared_ptr<FakeProbeState> probe;  // nullptr: no probe file can be opened
  std::string probe_refusal = "cannot create the probe file: Read-only file system";
  std::optional<StorageKind> kind = StorageKind{"ext4", false};  // every target's filesystem
  // Called at every open of a target or probe file and every extent read ("open", "probe",
  // "extents"): a test makes them slow by advancing its clock.
  std::function<void(const char* what)> on_io;

  std::optional<StorageKind> storage_kind(const std::string&) override { return kind; }

  ProbeOpening open_probe(const std::string& path) override {
    if (on_io) on_io("probe");
    if (!probe || files.find(path) == files.end()) return {nullptr, probe_refusal};
    ++probe->opened;
    return {std::make_unique<Probe>(probe), {}};
  }

  std::unique_ptr<TargetFile> open(const std::string& path) override {
    if (on_io) on_io("open");
    auto it = files.find(path);
    if (it == files.end()) return nullptr;
    return std::make_unique<File>(it->second);
  }
  std::optional<std::string> commit_base(const std::string&,
                                         const std::vector<std::string>&) override {
    return commit_base_answer;
  }
  std::optional<std::vector<ByteRange>> commit_extents(const std::vector<std::string>&) override {
    if (on_io) on_io("extents");
    return commit_extents_answer;
  }

 private:
  class Probe final : public ProbeFile {
   public:
    explicit Probe(std::shared_ptr<FakeProbeState> s) : s_(std::move(s)) {}
    bool start() override {
      ++s_->started;
      pending_ = true;
      return true;
    }
    bool busy() override { return false; }
    std::optional<std::chrono::nanoseconds> take() override {
      if (!pending_) return std::nullopt;
      pending_ = false;
      return s_->latency;
    }
    std::string failure() override {
      return s_->latency ? "" : "fdatasync of the probe file: Input/output error";
    }

   private:
    std::shared_ptr<FakeProbeState> s_;
    bool pending_ = false;
  };

  class File final : public TargetFile {
   public:
    explicit File(std::shared_ptr<FakeFileState> s) : s_(std::move(s)) {}
    std::uint64_t size() override { return s_->size; }
    std::optional<std::uint64_t> device() override { return s_->device; }
    std::optional<PageCacheState> page_cache() override {
      ++s_->whole_readings;
      PageCacheState st = s_->host_wide
                              ? PageCacheState{s_->dirty + s_->other_dirty, s_->writeback, false}
                              : PageCacheState{s_->dirty, s_->writeback, true};
      if (s_->memcg_bound) {
        st.dirty_bytes += s_->cgroup_other_dirty;
        st.dirty_upper_bound = true;
      }
      if (s_->flusher_after_reading) s_->dirty = 0;
      return st;
    }
    std::optional<PageCacheState> page_cache_in(const ByteRange& r) override {
      ++s_->range_readings;
      if (!s_->ranges_readable || s_->host_wide) return std::nullopt;
      std::uint64_t wb = 0;
      for (const auto& [q, bytes] : s_->queue) {
        const std::uint64_t lo = std::max(q.offset, r.offset);
        const std::uint64_t hi = std::min(q.offset + q.length, r.offset + r.length);
        if (hi > lo) wb += bytes * (hi - lo) / q.length;
      }
      return PageCacheState{dirty_share(r), wb, true};
    }
    // Dirty bytes are spread evenly over the file.
    std::uint64_t dirty_in(const ByteRange& r) override {
      ++s_->dirty_probes;
      return dirty_share(r);
    }
    std::uint64_t dirty_share(const ByteRange& r) const {
      if (s_->size == 0) return 0;
      follow_layout();
      // The part of r no writeback was started in since the layout was taken; at the front,
      // the part of that within [0, layout_dirty).
      const ByteRange in = s_->dirty_at_front
                               ? ByteRange{r.offset, r.offset >= s_->layout_dirty
                                                         ? 0
                                                         : std::min(r.length, s_->layout_dirty - r.offset)}
                               : r;
      std::uint64_t untouched = in.length;
      for (const ByteRange& i : s_->issued_since_layout) {
        const std::uint64_t lo = std::max(i.offset, in.offset);
        const std::uint64_t hi = std::min(i.offset + i.length, in.offset + in.length);
        if (hi > lo) untouched -= std::min(untouched, hi - lo);
      }
      if (s_->dirty_at_front) return std::min(s_->dirty, untouched);
      const double share = static_cast<double>(untouched) / static_cast<double>(s_->size);
      return std::min(s_->dirty, static_cast<std::uint64_t>(
                                     static_cast<double>(s_->layout_dirty) * share + 0.5));
    }
    // r joins the issued ranges, kept sorted and merged where they touch (a plan's pieces are
    // adjacent: the list stays short however many are issued).
    void add_issued(const ByteRange& r) const {
      std::vector<ByteRange>& v = s_->issued_since_layout;
      std::uint64_t lo = r.offset, hi = r.offset + r.length;
      std::vector<ByteRange> out;
      out.reserve(v.size() + 1);
      for (const ByteRange& i : v) {
        if (i.offset + i.length < lo || i.offset > hi) {
          out.push_back(i);
        } else {
          lo = std::min(lo, i.offset);
          hi = std::max(hi, i.offset + i.length);
        }
      }
      out.push_back({lo, hi - lo});
      std::sort(out.begin(), out.end(),
                [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
      v = std::move(out);
    }
    // A `dirty` set from outside since the last writeback started: the layout is taken anew.
    void follow_layout() const {
      if (s_->dirty == s_->dirty_left_by_writeback) return;
      s_->layout_dirty = s_->dirty;
      s_->issued_since_layout.clear();
      s_->dirty_left_by_writeback = s_->dirty;
    }
    void drop_cached(const ByteRange& r) override { s_->dropped.push_back(r); }
    bool start_settle() override {
      if (settling()) return false;
      s_->settled_with_dirty.push_back(s_->dirty);
      if (s_->host_wide) {
        s_->writeback += s_->dirty;
        s_->writeback_started += s_->dirty;
        s_->dirty = 0;
        s_->sync_running = true;
      }
      return true;
    }
    bool settling() override {
      if (s_->sync_running && s_->writeback == 0) s_->sync_running = false;
      return s_->settle_busy || s_->sync_running;
    }
    void start_writeback(const ByteRange& r) override {
      const std::uint64_t d = dirty_share(r);
      s_->dirty -= d;
      add_issued(r);
      s_->dirty_left_by_writeback = s_->dirty;
      s_->writeback += d;
      s_->writeback_started += d;
      if (d > 0) s_->queue.emplace_back(r, d);
    }
    std::vector<throttle::CopySample> take_service_samples() override {
      return std::exchange(s_->service, {});
    }

   private:
    std::shared_ptr<FakeFileState> s_;
  };
};

}  // namespace qcommit::plugin::test
