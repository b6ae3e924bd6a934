// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/live/live.h"

#include <algorithm>
#include <utility>

namespace qcommit::plugin {

const char* to_string(LiveStrategy s) {
  return s == LiveStrategy::Direct ? "direct" : "two-phase";
}

std::string LiveStep::describe() const {
  switch (kind) {
    case Kind::CreateOverlay: return "create external overlay " + top;
    case Kind::Commit: return "commit " + top + " into " + base + " (non-active, governed)";
    case Kind::ActiveCommit: return "active commit " + top + " into " + base + " (governed)";
    case Kind::Pivot: return "pivot to " + base;
    case Kind::RemoveOverlay: return "remove " + top;
  }
  return "?";
}

std::string fresh_overlay_path(const std::string& top, const std::string& stamp,
                               const std::string& overlay_dir) {
  const auto slash = top.rfind('/');
  const std::string dir = !overlay_dir.empty()         ? overlay_dir
                          : slash == std::string::npos ? "."
                                                       : top.substr(0, slash);
  std::string name = slash == std::string::npos ? top : top.substr(slash + 1);
  if (const auto dot = name.rfind('.'); dot != std::string::npos && dot > 0) name.resize(dot);
  return dir + "/" + name + ".qcommit-" + stamp + ".qcow2";
}

std::vector<LiveStep> plan_live(const LiveRequest& req, const DiskInfo& disk,
                                const std::string& fresh) {
  using K = LiveStep::Kind;
  if (disk.backing_chain.empty())
    throw BlockJobError(req.domain + " " + req.disk + ": " + disk.source +
                        " has no backing file: nothing to merge");
  if (disk.mirror)
    throw BlockJobError(req.domain + " " + req.disk + ": a block job already runs on this disk");
  std::vector<std::string> chain{disk.source};
  chain.insert(chain.end(), disk.backing_chain.begin(), disk.backing_chain.end());
  const std::string top = req.top.empty() ? disk.source : req.top;
  const std::string base = req.base.empty() ? disk.backing_chain.back() : req.base;
  const auto ti = std::find(chain.begin(), chain.end(), top);
  const auto bi = std::find(chain.begin(), chain.end(), base);
  if (ti == chain.end())
    throw BlockJobError(req.domain + " " + req.disk + ": --top " + top + " is not in the chain");
  if (bi == chain.end())
    throw BlockJobError(req.domain + " " + req.disk + ": --base " + base + " is not in the chain");
  if (bi <= ti)
    throw BlockJobError(req.domain + " " + req.disk + ": --base " + base + " is not below --top " +
                        top);
  const bool active = ti == chain.begin();
  std::vector<LiveStep> steps;
  if (!active) {
    steps.push_back({K::Commit, top, base});
    return steps;
  }
  if (req.strategy == LiveStrategy::TwoPhase) {
    steps.push_back({K::CreateOverlay, fresh, ""});
    steps.push_back({K::Commit, top, base});
    steps.push_back({K::ActiveCommit, fresh, base});
  } else {
    steps.push_back({K::ActiveCommit, top, base});
  }
  if (req.pivot) {
    steps.push_back({K::Pivot, "", base});
    if (req.strategy == LiveStrategy::TwoPhase) steps.push_back({K::RemoveOverlay, fresh, ""});
  }
  return steps;
}

ForeignJobWait::ForeignJobWait(Hypervisor& hv, std::string domain, std::string disk,
                               Duration limit)
    : hv_(hv), domain_(std::move(domain)), disk_(std::move(disk)), limit_(limit) {}

ForeignJobWait::State ForeignJobWait::poll(TimePoint now) {
  std::optional<JobInfo> j = hv_.job_info(domain_, disk_);
  if (!j) return State::kClear;
  job_ = j;
  if (!since_) since_ = now;
  return now - *since_ >= limit_ ? State::kTimedOut : State::kWaiting;
}

std::string ForeignJobWait::describe_job() const {
  std::string s = std::string("the ") + (job_ ? to_string(job_->type) : "unknown") +
                  " block job on " + domain_ + " " + disk_;
  if (job_ && job_->end > 0)
    s += " (" + std::to_string(static_cast<unsigned>(100.0 * static_cast<double>(job_->cur) /
                                                     static_cast<double>(job_->end))) +
         "% done)";
  return s;
}

LiveMerge::LiveMerge(BlockJobControl& ctl, Hypervisor& hv, std::vector<LiveStep> steps,
                     LiveRequest req)
    : ctl_(ctl), hv_(hv), steps_(std::move(steps)), req_(std::move(req)) {}

bool LiveMerge::chain_contains(const std::string& path) {
  std::optional<DomainInfo> d = ctl_.domain(req_.domain);
  if (!d) throw BlockJobError(req_.domain + ": domain is gone");
  for (const auto& disk : d->disks) {
    if (disk.target != req_.disk) continue;
    if (disk.source == path) return true;
    return std::find(disk.backing_chain.begin(), disk.backing_chain.end(), path) !=
           disk.backing_chain.end();
  }
  throw BlockJobError(req_.domain + ": disk " + req_.disk + " is gone");
}

void LiveMerge::finish_step(TimePoint) {
  ++index_;
  started_ = false;
  next_try_.reset();
}

bool LiveMerge::step(TimePoint now) {
  using K = LiveStep::Kind;
  if (error_ || done() || left_ready_) return false;
  if (next_try_ && now < *next_try_) return true;
  const LiveStep& s = steps_[index_];
  try {
    switch (s.kind) {
      case K::CreateOverlay:
        ctl_.create_overlay(req_.domain, req_.disk, s.top);
        finish_step(now);
        break;
      case K::RemoveOverlay:
        ctl_.remove_file(s.top);
        finish_step(now);
        break;
      case K::Commit:
      case K::ActiveCommit: {
        const bool active = s.kind == K::ActiveCommit;
        if (!started_) {
          ctl_.start_commit(req_.domain, req_.disk, s.base, s.top, req_.initial_speed_bytes_per_s,
                            active);
          started_ = true;
          last_info_.reset();
          break;
        }
        std::optional<JobInfo> info = hv_.job_info(req_.domain, req_.disk);
        if (info) {
          last_info_ = info;
          // libvirt reports cur == end for a mirror only once it is ready.
          if (active && info->end > 0 && info->cur == info->end) {
            finish_step(now);
            if (!req_.pivot) left_ready_ = true;
          }
          break;
        }
        // The job is gone: an active commit must not end before its pivot; a commit succeeded
        // when TOP left the chain.
        if (active) {
          error_ = "active commit of " + s.top + " ended without reaching ready";
        } else if (chain_contains(s.top)) {
          error_ = "commit of " + s.top + " into " + s.base + " ended and " + s.top +
                   " is still in the chain (job failed or was cancelled)";
        } else {
          finish_step(now);
        }
        break;
      }
      case K::Pivot:
        if (pivot_gate_ && !pivot_gate_(now)) {
          next_try_ = now + kPivotGateRecheck;
        } else if (ctl_.pivot(req_.domain, req_.disk)) {
          finish_step(now);
        } else {
          next_try_ = now + kPivotRetry;
        }
        break;
    }
  } catch (const BlockJobError& e) {
    error_ = e.what();
  }
  return !(error_ || done() || left_ready_);
}

}  // namespace qcommit::plugin
