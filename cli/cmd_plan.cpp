// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit plan: what a merge would do, without writing anything (except the optional
// measurement, --measure, which rehearses the merge's copy into a scratch file beside BASE that
// is unlinked as soon as it is created: engine/copy_trial.h).
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cli/json.h"
#include "cli/merge_policy.h"
#include "cli/options.h"
#include "cli/units.h"
#include "common/defaults.h"
#include "engine/copy_trial.h"
#include "engine/merge.h"
#include "qcow2/device.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace {

// Where the kernel's resolution of a chain path leads (looked up, not opened), for display.
std::string resolved(const std::string& path) {
  try {
    return qcow2::PathHandle::lookup(path).real_path();
  } catch (const qcow2::Error&) {
    return path;
  }
}

std::vector<std::string> resolved_all(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) out.push_back(resolved(p));
  return out;
}

// The plan's members of `plan --output=json`, before the policy's.
json::Ordered plan_json(const std::string& top, const engine::MergePlan& p) {
  json::Ordered j{{"top", top},
                  {"base", p.base},
                  {"base-format", p.base_format},
                  {"layers", p.layers},
                  {"resolved-layers", resolved_all(p.layers)},
                  {"resolved-base", resolved(p.base)},
                  {"top-size", p.top_size},
                  {"base-size", p.base_size},
                  {"grow-base", p.top_size > p.base_size},
                  {"data-bytes", p.data_bytes},
                  {"zero-bytes", p.zero_bytes},
                  {"compressed-bytes", p.compressed_bytes},
                  {"extents", p.extents},
                  {"base-internal-snapshots", p.base_snapshots},
                  {"bitmaps-to-remove", p.base_bitmaps},
                  {"rebase", p.rebase}};
  if (p.resume_from) j["resume-from"] = *p.resume_from;
  // What the merge takes from BASE's filesystem and what is free there (null: a block device).
  j["space-needed"] = p.space.needed();
  j["space-data"] = p.space.data_bytes;
  j["space-metadata"] = p.space.metadata_bytes;
  j["space-reusable"] = p.space.reusable_bytes;
  j["space-free"] =
      p.space.free_bytes ? json::Ordered(*p.space.free_bytes) : json::Ordered(nullptr);
  j["space-short"] = p.space.shortfall();
  return j;
}

// A warning when BASE's filesystem lacks the room the merge needs, on stderr in both outputs.
void warn_short_space(const engine::MergePlan& p) {
  if (!p.space.shortfall()) return;
  std::fprintf(stderr,
               "qcommit plan: warning: %s: its filesystem has %s free, the merge needs about %s "
               "there: make room for %s more before merging\n",
               p.base.c_str(), format_size(*p.space.free_bytes).c_str(),
               format_size(p.space.needed()).c_str(), human_size(p.space.shortfall()).c_str());
}

// The command line of `qcommit plan`.
// --budget, --config, --connect, --output: PolicyArgs (-c: libvirt must answer).
struct PlanArgs : PolicyArgs {
  std::string top, base, rate;
  std::vector<std::string> rebase, allow_dirs;
  bool measure = false;
};

// Every value checked before any image is opened, whatever the other options are.
void validate(const PlanArgs& a) {
  (void)parse_output(a.output);
  if (!a.rate.empty()) (void)parse_rate(a.rate, "--rate");
  if (!a.budget.empty() && a.budget != "off") (void)parse_budget(a.budget);
  if (!a.rate.empty() && a.measure)
    throw UsageError("--rate and --measure exclude each other (a given rate or a measured one)");
}

// The options, or nothing when --help was asked for (and answered).
std::optional<PlanArgs> parse_plan_args(const Args& args) {
  PlanArgs a;
  po::options_description opts("options");
  auto add = opts.add_options();
  add("top", po::value(&a.top)->required(), "the image to merge (TOP)");
  add("base", po::value(&a.base),
      "merge into this image of TOP's chain (default: TOP's backing file)");
  add("rebase", po::value(&a.rebase)->multitoken(), "children of TOP that would be rebased");
  add("rate", po::value(&a.rate), "expected copy rate for the ETA, e.g. 80M (per second)");
  add("measure", po::bool_switch(&a.measure),
      "rehearse the merge's copy for the ETA: up to 256 MiB (at most 3 s) of TOP copied as the "
      "merge copies, at its budget, into a scratch file beside BASE (unnamed where the "
      "filesystem allows it, else unlinked at once; the images are not written)");
  add_policy_args(opts, a, {});
  add_backing_policy(opts, a.allow_dirs);
  po::positional_options_description pos;
  pos.add("top", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm,
             "qcommit plan TOP [--base BASE] [--rebase CHILD...] [--rate R | --measure]",
             "examples:\n  qcommit plan snap.qcow2\n  qcommit plan snap2.qcow2 --base base.qcow2 "
             "--measure\n"))
    return std::nullopt;
  note_given(a, vm);
  validate(a);
  return a;
}

engine::MergePlan plan(const PlanArgs& a) {
  engine::MergeOptions mo;
  mo.top = a.top;
  if (!a.base.empty()) mo.base = a.base;
  mo.rebase = a.rebase;
  mo.allowed_backing_dirs = backing_policy(a.top, a.allow_dirs);
  return engine::plan_merge(mo);
}

// "20ms", "1.5ms"
std::string ms_text(std::chrono::nanoseconds d) {
  char b[32];
  std::snprintf(b, sizeof b, "%gms", std::chrono::duration<double, std::milli>(d).count());
  return b;
}

// The ETA: from a rate given (--rate), from a rehearsal of the copy (--measure), or none.
struct Eta {
  std::string source;  // "given", "measured" ("": none)
  double bytes_per_s = 0;
  engine::CopyEstimate estimate;
  std::optional<engine::CopyTrial> trial;
  std::string paced_by;  // the rehearsal's pacing: "budget 20ms", "none"
};

Eta estimate(const PlanArgs& a, const engine::MergePlan& p,
             const std::optional<MergePolicy>& policy) {
  Eta e;
  if (!a.rate.empty()) {
    e.bytes_per_s = parse_rate(a.rate, "--rate");
    e.source = "given";
    e.estimate.seconds = e.estimate.low_seconds = e.estimate.high_seconds =
        double(p.data_bytes) / e.bytes_per_s;
    e.estimate.rate_bytes_per_s = e.bytes_per_s;
  } else if (a.measure) {
    engine::CopyTrialOptions t;
    t.source = p.layers.front();
    t.dir = std::filesystem::absolute(p.base).parent_path().string();
    if (p.base_format != "qcow2") t.grain = 4096;
    // Paced as the merge would be: its governor, with the probe and the co-tenants.
    if (policy) {
      t.governor = make_budget_governor(*policy, "", true);
      t.ceiling_bytes_per_s = policy->resolution.policy.ceiling_bytes_per_s;
    }
    e.paced_by = policy ? "the budget " + ms_text(policy->resolution.policy.budget) : "none";
    e.trial = engine::run_copy_trial(t);
    e.estimate = engine::estimate_copy_time(p.data_bytes, *e.trial);
    e.bytes_per_s = e.estimate.rate_bytes_per_s;
    e.source = "measured";
  }
  return e;
}

// The budget `qcommit merge` would take, and from where (nothing: --budget off).
std::optional<MergePolicy> merge_policy(const PlanArgs& a, const engine::MergePlan& p) {
  if (a.budget == "off") return std::nullopt;
  MergePolicyOptions popts;
  if (!a.budget.empty()) popts.budget = parse_budget(a.budget);
  popts.config_path = a.config_path;
  popts.config_given = a.config_given;
  popts.uri = a.uri;
  popts.libvirt_required = a.uri_given;
  return resolve_merge_policy(popts, p.base);
}

void print_plan_json(const std::string& top, const engine::MergePlan& p,
                     const std::optional<MergePolicy>& policy, const Eta& eta) {
  json::Ordered doc = plan_json(top, p);
  doc.update(policy ? policy->json_fields() : off_policy_json());
  // A rehearsal of nothing (TOP empty, BASE's filesystem full) gives no ETA.
  if (eta.source == "given" || (eta.trial && eta.trial->bytes > 0)) {
    doc["rate"] = whole(eta.bytes_per_s);
    doc["eta-seconds"] = rounded(eta.estimate.seconds, 1);
    doc["eta-low-seconds"] = rounded(eta.estimate.low_seconds, 1);
    doc["eta-high-seconds"] = rounded(eta.estimate.high_seconds, 1);
    doc["eta-source"] = eta.source;
  }
  if (eta.trial)
    doc["measured"] = json::Ordered{{"bytes", eta.trial->bytes},
                                    {"seconds", rounded(eta.trial->seconds, 3)},
                                    {"direct-io", eta.trial->direct_io},
                                    {"request-bytes", eta.trial->request_bytes},
                                    {"paced-by", eta.paced_by}};
  print_json(doc);
}

// A path as QEMU names it, and where the kernel resolves it when that differs.
std::string shown(const std::string& path) {
  const std::string real = resolved(path);
  return real == path ? path : path + " -> " + real;
}

// The chain, what is copied and what BASE holds that the merge changes.
void print_contents(const engine::MergePlan& p) {
  for (size_t i = 0; i < p.layers.size(); ++i)
    std::printf("  %-8s %s\n", i == 0 ? "top" : "through", shown(p.layers[i]).c_str());
  std::printf("  %-8s %s (%s)\n", "into", shown(p.base).c_str(), p.base_format.c_str());
  if (p.top_size > p.base_size)
    std::printf("  base grows from %s to %s first\n", format_size(p.base_size).c_str(),
                format_size(p.top_size).c_str());
  std::printf(
      "data to copy:   %s in %zu extents%s\n", format_size(p.data_bytes).c_str(), p.extents,
      p.compressed_bytes ? (" (" + format_size(p.compressed_bytes) + " compressed)").c_str() : "");
  std::printf("zero ranges:    %s (zero flags on a qcow2 v3 base, holes on raw)\n",
              format_size(p.zero_bytes).c_str());
  if (p.base_snapshots)
    std::printf("base has %u internal snapshots: clusters they share are copied on write\n",
                p.base_snapshots);
  if (p.base_bitmaps)
    std::printf("base has %u persistent bitmaps: they will be removed (stale after the merge)\n",
                p.base_bitmaps);
  if (p.resume_from)
    std::printf("an interrupted merge will resume at %s\n", format_size(*p.resume_from).c_str());
}

// The room on BASE's filesystem and the children rebased at the end.
void print_space_and_switch(const engine::MergePlan& p) {
  if (p.space.free_bytes)
    std::printf(
        "space needed:   about %s on BASE's filesystem (%s of data, %s of metadata), %s "
        "free%s\n",
        format_size(p.space.needed()).c_str(), format_size(p.space.data_bytes).c_str(),
        format_size(p.space.metadata_bytes).c_str(), format_size(*p.space.free_bytes).c_str(),
        p.space.shortfall() ? ": NOT ENOUGH" : "");
  std::printf("switch-over:    ");
  if (p.rebase.empty())
    std::printf("none (TOP is left intact and unreferenced by the merge)\n");
  else
    for (size_t i = 0; i < p.rebase.size(); ++i)
      std::printf("%srewrite the header of %s to point at %s\n", i ? "                " : "",
                  p.rebase[i].c_str(), p.base.c_str());
}

// "8.3 s", "2 min 5 s"
std::string seconds_text(double s) {
  char b[48];
  const long whole_s = std::lround(s);
  if (whole_s >= 60)
    std::snprintf(b, sizeof b, "%ld min %ld s", whole_s / 60, whole_s % 60);
  else
    std::snprintf(b, sizeof b, "%.1f s", s);
  return b;
}

void print_eta(const Eta& eta) {
  if (eta.source.empty()) {
    std::printf("ETA:            give --rate or --measure\n");
    return;
  }
  const engine::CopyEstimate& e = eta.estimate;
  if (eta.source == "given") {
    std::printf("ETA:            %s at %s/s (given; with a latency budget the copy takes what "
                "co-tenants leave)\n",
                seconds_text(e.seconds).c_str(), format_size(uint64_t(eta.bytes_per_s)).c_str());
    return;
  }
  const engine::CopyTrial& t = *eta.trial;
  if (t.bytes == 0) {
    std::printf("ETA:            unknown (nothing to rehearse: TOP is empty or BASE's filesystem "
                "is full)\n");
    return;
  }
  std::string range;
  if (e.high_seconds - e.low_seconds >= 0.05)
    range = " (" + seconds_text(e.low_seconds) + " to " + seconds_text(e.high_seconds) + ")";
  std::printf("ETA:            about %s%s for the copy\n", seconds_text(e.seconds).c_str(),
              range.c_str());
  std::printf("                measured: %s of TOP copied beside BASE as the merge copies "
              "(%s, %s requests, paced by %s) in %.2f s",
              format_size(t.bytes).c_str(), t.direct_io ? "O_DIRECT" : "buffered",
              format_size(t.request_bytes).c_str(), eta.paced_by.c_str(), t.seconds);
  if (e.rate_bytes_per_s > 0 && e.seconds > t.seconds)
    std::printf(", the rest at %s/s%s", format_size(uint64_t(e.rate_bytes_per_s)).c_str(),
                t.governed ? " on average (the rate still growing as during the measurement)"
                           : "");
  std::printf("\n");
  if (eta.paced_by != "none")
    std::printf("                co-tenants busier than during the measurement make it longer\n");
}

void print_budget_and_eta(const std::optional<MergePolicy>& policy, const Eta& eta) {
  if (policy) {
    std::printf("budget:         %s\n", policy->budget_line().substr(7).c_str());
    std::printf("                %s\n", policy->cotenant_line().c_str());
  } else {
    std::printf("budget:         off (unthrottled)\n");
  }
  print_eta(eta);
}

void print_plan_human(const engine::MergePlan& p, const std::optional<MergePolicy>& policy,
                      const Eta& eta) {
  if (eta.trial)
    std::printf("merge plan (no image written; --measure copied into a scratch file beside BASE, "
                "unnamed where the filesystem allows it, else unlinked at once)\n");
  else
    std::printf("merge plan (nothing written)\n");
  print_contents(p);
  print_space_and_switch(p);
  print_budget_and_eta(policy, eta);
}

}  // namespace

int cmd_plan(const Args& args) {
  const std::optional<PlanArgs> a = parse_plan_args(args);
  if (!a) return kExitOk;
  const Output out = parse_output(a->output);
  const engine::MergePlan p = plan(*a);
  const std::optional<MergePolicy> policy = merge_policy(*a, p);
  const Eta eta = estimate(*a, p, policy);
  warn_short_space(p);
  if (out == Output::kJson)
    print_plan_json(a->top, p, policy, eta);
  else
    print_plan_human(p, policy, eta);
  return kExitOk;
}

}  // namespace qcommit::cli
