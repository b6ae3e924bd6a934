// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/merge_progress.h"

#include <cstdio>
#include <string>

#include "cli/json.h"
#include "cli/units.h"
#include "cli/wait_event.h"

namespace qcommit::cli {
namespace {

constexpr int kBarWidth = 30;
constexpr auto kHeartbeatPoll = std::chrono::milliseconds(100);

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Seconds left at `rate`; nullopt when unknown.
std::optional<double> eta_s(const engine::Progress& p) {
  if (!(p.rate_bps > 0) || p.total_bytes < p.done_bytes) return std::nullopt;
  return double(p.total_bytes - p.done_bytes) / p.rate_bps;
}

double ms(std::chrono::nanoseconds d) { return std::chrono::duration<double, std::milli>(d).count(); }

json::Ordered progress_json(const engine::Progress& p, std::optional<std::chrono::nanoseconds> p99) {
  json::Ordered j{{"event", "progress"},       {"phase", p.phase},
                  {"done", p.done_bytes},      {"total", p.total_bytes},
                  {"rate", whole(p.rate_bps)}, {"elapsed", rounded(p.elapsed_s, 3)}};
  if (const auto eta = eta_s(p)) j["eta"] = rounded(*eta, 1);
  if (p99) j["guest-p99-ms"] = rounded(ms(*p99), 3);
  if (p.phase == "resume") j["resume-offset"] = p.resume_offset;
  return j;
}

void print_bar(const engine::Progress& p) {
  const double frac = p.total_bytes ? double(p.done_bytes) / double(p.total_bytes) : 1.0;
  const int fill = int(frac * kBarWidth);
  std::string bar(size_t(fill), '#');
  bar.append(size_t(kBarWidth - fill), '-');
  const auto eta = eta_s(p);
  const std::string eta_text = eta ? std::to_string(int64_t(*eta + 0.5)) + "s" : "-";
  std::fprintf(stderr, "\r[%s] %5.1f%% %s / %s  %s/s  ETA %s   ", bar.c_str(), frac * 100,
               format_size(p.done_bytes).c_str(), format_size(p.total_bytes).c_str(),
               format_size(uint64_t(p.rate_bps)).c_str(), eta_text.c_str());
  std::fflush(stderr);
}

}  // namespace

MergeProgress::MergeProgress(Output out, bool bar, bool heartbeat) : out_(out), bar_(bar) {
  if (heartbeat) thread_ = std::thread([this] { this->heartbeat(); });
}

MergeProgress::~MergeProgress() {
  stop();
}

void MergeProgress::stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lk(mu_);
  break_line_locked();
}

void MergeProgress::set_p99_source(std::function<std::optional<std::chrono::nanoseconds>()> source) {
  std::lock_guard lk(mu_);
  p99_ = std::move(source);
}

void MergeProgress::break_line() {
  std::lock_guard lk(mu_);
  break_line_locked();
}

void MergeProgress::break_line_locked() {
  if (!bar_open_) return;
  std::fputc('\n', stderr);
  bar_open_ = false;
}

// "qcommit: copy 12.0 MiB of 100.0 MiB (12.0%), 8.0 MiB/s, ETA 11s, 1m 2s elapsed, guests' p99
// 3.2 ms"
void MergeProgress::print_plain(const engine::Progress& p) {
  plain_at_ = Clock::now();
  const double pct = p.total_bytes ? 100.0 * double(p.done_bytes) / double(p.total_bytes) : 100.0;
  const auto eta = eta_s(p);
  const std::string eta_text = eta ? std::to_string(int64_t(*eta + 0.5)) + "s" : "unknown";
  std::string p99_text;
  if (p99_)
    if (const auto p99 = p99_()) {
      char b[48];
      std::snprintf(b, sizeof b, ", guests' p99 %.1f ms", ms(*p99));
      p99_text = b;
    }
  std::fprintf(stderr, "qcommit: copy %s of %s (%.1f%%), %s/s, ETA %s, %.0fs elapsed%s\n",
               format_size(p.done_bytes).c_str(), format_size(p.total_bytes).c_str(), pct,
               format_size(uint64_t(p.rate_bps)).c_str(), eta_text.c_str(), p.elapsed_s,
               p99_text.c_str());
  std::fflush(stderr);
}

void MergeProgress::on_progress(const engine::Progress& p) {
  std::lock_guard lk(mu_);
  last_ = p;
  last_at_ = Clock::now();
  show(p);
}

void MergeProgress::on_lock_wait(const engine::WaitNotice& notice) {
  std::lock_guard lk(mu_);
  break_line_locked();
  show_wait(notice, out_ == Output::kJson, "qcommit");
  shown_at_ = Clock::now();
}

void MergeProgress::show(const engine::Progress& p) {
  shown_at_ = Clock::now();
  if (out_ == Output::kJson) {
    print_json(progress_json(p, p99_ && p.phase == "copy" ? p99_() : std::nullopt));
  } else if (p.phase == "resume") {
    break_line_locked();
    std::fprintf(stderr, "qcommit: resuming an interrupted merge from guest offset %s\n",
                 format_size(p.resume_offset).c_str());
  } else if (bar_ && p.phase == "copy") {
    print_bar(p);
    bar_open_ = true;
  } else if (!bar_ && p.phase == "copy") {
    // The first line one interval into the copy: a merge refused or done within it says only
    // its result (an error stays one line).
    if (plain_at_ == Clock::time_point{}) plain_at_ = shown_at_;
    if (shown_at_ - plain_at_ >= kPlainLineInterval) print_plain(p);
  }
}

engine::Progress MergeProgress::advanced(const engine::Progress& p, double since) {
  engine::Progress q = p;
  q.elapsed_s += since;
  // The engine's rate is the average over the copy so far: the copy has run done / rate seconds.
  if (p.phase == "copy" && p.rate_bps > 0) {
    const double copy_s = double(p.done_bytes) / p.rate_bps;
    q.rate_bps = double(p.done_bytes) / (copy_s + since);
  }
  return q;
}

// Once a second without anything shown: the last state again, or before any state a "start"
// event (JSON only: the terminal has nothing to draw yet).
void MergeProgress::heartbeat() {
  const Clock::time_point started = Clock::now();
  std::unique_lock lk(mu_);
  shown_at_ = started;
  while (!cv_.wait_for(lk, kHeartbeatPoll, [this] { return stopping_; })) {
    const Clock::time_point now = Clock::now();
    if (now - shown_at_ < kProgressHeartbeat) continue;
    if (last_ && last_->phase == "done") continue;
    if (last_) {
      show(advanced(*last_, seconds(now - last_at_)));
    } else {
      engine::Progress p;
      p.phase = "start";
      p.elapsed_s = seconds(now - started);
      show(p);
    }
  }
}

}  // namespace qcommit::cli
