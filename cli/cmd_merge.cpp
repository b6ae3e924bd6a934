// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit merge: offline merge of TOP (and intermediates) into BASE.
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "plugin/domain/domain_merge.h"
#include "cli/json.h"
#include "cli/merge_policy.h"
#include "cli/merge_progress.h"
#include "cli/merge_users.h"
#include "cli/options.h"
#include "cli/units.h"
#include "common/defaults.h"
#include "engine/merge.h"
#include "qcow2/chain.h"
#include "qcow2/error.h"

namespace qcommit::cli {

using plugin::DomainMergeRequest;
using plugin::DomainMergeResult;
using plugin::merge_domain;

namespace {

// What a dry run adds to the engine's plan for a merge through libvirt.
struct DryRunExtras {
  std::string definition;  // the change to the domain's definition, "" when none
  bool journal = false;    // finishes an interrupted run recorded in the domain's definition
};

// The read-only part of the engine's check of --rebase CHILD: each child's backing file is TOP
// (or, when an interrupted run of this merge is to be resumed, BASE already).
void check_rebase_children(const engine::MergeOptions& mo, const engine::MergePlan& plan) {
  struct stat top_st {
  }, base_st{};
  if (::stat(mo.top.c_str(), &top_st) != 0) throw qcow2::Error(mo.top, "cannot stat it");
  const bool base_known = ::stat(plan.base.c_str(), &base_st) == 0;
  auto same = [](const struct stat& a, const std::string& path) {
    struct stat b {};
    return ::stat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
  };
  for (const auto& child : mo.rebase) {
    qcow2::ChainOptions o;
    o.allowed_backing_dirs = mo.allowed_backing_dirs;
    o.allowed_backing_dirs.push_back(std::filesystem::absolute(child).parent_path().string());
    const qcow2::Chain c = qcow2::Chain::open(child, o);
    const bool on_top = c.depth() >= 2 && same(top_st, c.layer(1).path);
    const bool rebased_before =
        plan.resume_from && base_known && c.depth() >= 2 && same(base_st, c.layer(1).path);
    if (!on_top && !rebased_before)
      throw qcow2::Error(child, "its backing file is not " + mo.top + "; refusing to rebase it");
  }
}

// [{"layer": ..., "user": ...}]: who uses a layer --delete would remove.
json::Ordered users_json(const std::vector<engine::LayerUser>& users) {
  json::Ordered a = json::Ordered::array();
  for (const auto& u : users) a.push_back(json::Ordered{{"layer", u.layer}, {"user", u.user}});
  return a;
}

// --delete with users of a merged layer: the real merge refuses before writing anything, and so
// does its dry run, after saying what it would have done (the same line, the same exit status).
void refuse_orphaning(const engine::MergePlan& p, bool del) {
  if (!del || p.users.empty()) return;
  throw qcow2::Error(p.users.front().layer,
                     "--delete would leave its users without their backing file: " +
                         engine::describe_users(p.users) +
                         "; nothing was written (name them with --rebase, or merge without --delete)");
}

// A dry run's report as JSON: {"event": "dry-run", "top": ..., "written": false}.
json::Ordered dry_run_json(const engine::MergePlan& p, bool del, const DryRunExtras& extra) {
  const std::string& top = p.layers.empty() ? p.base : p.layers.front();
  return json::Ordered{
      {"event", "dry-run"},
      {"top", top},
      {"base", p.base},
      {"layers", p.layers},
      {"data-bytes", p.data_bytes},
      {"zero-bytes", p.zero_bytes},
      {"grow-base", p.top_size > p.base_size},
      {"rebase", p.rebase},
      {"delete", del ? p.layers : std::vector<std::string>{}},
      {"users", users_json(p.users)},
      {"definition",
       extra.definition.empty() ? json::Ordered(nullptr) : json::Ordered(extra.definition)},
      {"resume-from", p.resume_from ? json::Ordered(*p.resume_from) : json::Ordered(nullptr)},
      {"written", false}};
}

// {"event": "note", "message": ...}
json::Ordered note_json(const std::string& message) {
  return json::Ordered{{"event", "note"}, {"message", message}};
}

double ms(std::chrono::nanoseconds d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// The budget and co-tenant members of the result: the policy's, or --budget off.
json::Ordered budget_result_json(const std::optional<MergePolicy>& policy,
                                 engine::BudgetGovernor* governor) {
  if (!policy || !governor) return off_policy_json();
  const engine::CotenantStats cs = governor->cotenant_stats();
  return json::Ordered{{"budget-ms", quantity(ms(policy->resolution.policy.budget))},
                       {"budget-source", plugin::to_string(policy->resolution.source)},
                       {"cotenant-samples", cs.samples},
                       {"cotenant-disks-max", cs.max_disks},
                       {"cotenant-max-ms", rounded(ms(cs.max_latency), 3)}};
}

json::Ordered result_json(const engine::MergeResult& r, const std::optional<MergePolicy>& policy,
                          engine::BudgetGovernor* governor) {
  json::Ordered j{{"event", "result"},
                  {"top", r.top},
                  {"base", r.base},
                  {"copied", r.copied_bytes},
                  {"zeroed", r.zeroed_bytes},
                  {"resumed", r.resumed},
                  {"resumed-from", r.resumed_from},
                  {"base-changed", r.base_changed},
                  {"leaks-repaired", r.leaks_repaired},
                  {"bitmaps-removed", r.bitmaps_removed},
                  {"direct-io", r.direct_io},
                  {"io-uring", r.io_uring},
                  {"io-uring-writes", r.io_uring_writes}};
  j.update(budget_result_json(policy, governor));
  j["copy-seconds"] = rounded(r.copy_seconds, 3);
  j["switch-seconds"] = rounded(r.switch_seconds, 6);
  j["total-seconds"] = rounded(r.total_seconds, 3);
  j["rebased"] = r.rebased;
  j["deleted"] = r.deleted;
  json::Ordered left = json::Ordered::array();
  for (const auto& n : r.not_deleted) left.push_back(json::Ordered{{"path", n.path}, {"reason", n.reason}});
  j["not-deleted"] = left;
  return j;
}

// A dry run's report: what the merge would write, change and delete. Nothing is written.
void print_dry_run(Output out, const engine::MergePlan& p, bool del, const DryRunExtras& extra) {
  const std::string& top = p.layers.empty() ? p.base : p.layers.front();
  if (out == Output::kJson) {
    print_json(dry_run_json(p, del, extra));
    return;
  }
  std::printf("would merge %s into %s (nothing written)\n", top.c_str(), p.base.c_str());
  if (extra.journal)
    std::printf("  would finish the interrupted merge recorded in the domain's definition\n");
  for (size_t i = 1; i < p.layers.size(); ++i) std::printf("  through %s\n", p.layers[i].c_str());
  if (p.top_size > p.base_size)
    std::printf("  would grow %s from %s to %s\n", p.base.c_str(), format_size(p.base_size).c_str(),
                format_size(p.top_size).c_str());
  if (p.data_bytes || p.zero_bytes || p.extents)
    // The zeros TOP shows; the merge writes only those BASE does not already read as zeros.
    std::printf("  would copy %s in %zu extents; %s must read as zeros (written where BASE "
                "holds data there)\n",
                format_size(p.data_bytes).c_str(), p.extents, format_size(p.zero_bytes).c_str());
  if (p.base_bitmaps)
    std::printf("  would remove %u persistent bitmaps of %s\n", p.base_bitmaps, p.base.c_str());
  if (p.resume_from)
    std::printf("  would resume an interrupted run at %s\n", format_size(*p.resume_from).c_str());
  for (const auto& c : p.rebase)
    std::printf("  would rebase %s onto %s\n", c.c_str(), p.base.c_str());
  if (!extra.definition.empty())
    std::printf("  would update the definition: %s\n", extra.definition.c_str());
  if (del)
    for (const auto& l : p.layers) std::printf("  would delete %s\n", l.c_str());
  if (del)
    for (const auto& u : p.users)
      std::printf("  would refuse --delete: %s\n", u.user.c_str());
}

// The command line of `qcommit merge`.
// --budget, --config, --connect, --max-rate, --output: PolicyArgs.
struct MergeArgs : PolicyArgs {
  std::string top, base, trace, probe = "on", cotenants = "on";
  bool libvirt_required = false;  // -c or --cotenants given: libvirt must answer
  bool verbose = false;
  std::vector<std::string> rebase, allow_dirs;
  bool del = false, no_direct = false, force_direct = false, no_io_uring = false;
  std::string domain, disk, pool, vol;
  bool dry_run = false;
  std::string lock_wait = defaults::lock_wait_text();

  [[nodiscard]] bool via_libvirt() const { return !domain.empty() || !pool.empty(); }
  [[nodiscard]] bool governed() const { return budget != "off"; }
};

void add_merge_options(po::options_description& opts, MergeArgs& a) {
  opts.add_options()("top", po::value(&a.top), "the image to merge (TOP)")(
      "domain", po::value(&a.domain),
      "a shut-off libvirt domain whose disk chain to merge (with --disk); one that is shutting "
      "down is waited for (--wait)")(
      "disk", po::value(&a.disk),
      "the domain's disk target, e.g. vda (TOP defaults to its active layer)")(
      "pool", po::value(&a.pool), "storage pool of the volume to merge (with --vol)")(
      "vol", po::value(&a.vol), "volume name in --pool to merge into its backing file")(
      "dry-run", po::bool_switch(&a.dry_run),
      "resolve and check everything, print what the merge would do (copy, rebase, delete, "
      "definition), write nothing")(
      "base", po::value(&a.base),
      "merge into this image of TOP's chain (default: TOP's backing file)")(
      "rebase", po::value(&a.rebase)->multitoken(),
      "images whose backing file is TOP: point them at BASE")(
      "delete", po::bool_switch(&a.del), "remove TOP and the intermediates afterwards")(
      "wait", po::value(&a.lock_wait),
      ("wait this long for another process (qemu-img info, a backup tool) to release an image "
       "or to close a merged layer before --delete, for a backing device under /dev to appear, "
       "and for a --domain that is shutting down to shut off, each wait at most this long, e.g. "
       "30s; 0: refuse at once (default " +
       defaults::lock_wait_text() + "; a running guest is never waited for)")
          .c_str());
  add_policy_args(opts, a,
                  {.max_rate_use = "with a budget it caps the policy's ceiling, with --budget off "
                                   "it paces the copy alone",
                   .output_json = " (JSON lines: progress events and the result)"});
  opts.add_options()(
      "cotenants", po::value(&a.cotenants),
      "on (default): the block stats of running guests on BASE's storage (libvirt) join the probe; "
      "off")("verbose,v", po::bool_switch(&a.verbose),
             "say also when no co-tenant runs or --cotenants off (libvirt unreachable is said "
             "always; a URI named with -c that does not connect is an error)")(
      "no-direct", po::bool_switch(&a.no_direct),
      "buffered writes with bounded dirty data, large requests too (--budget off default: large "
      "O_DIRECT, small buffered)")(
      "direct", po::bool_switch(&a.force_direct),
      "O_DIRECT writes where the filesystem allows (default with a budget)")(
      "no-io-uring", po::bool_switch(&a.no_io_uring),
      "--budget off: one thread per O_DIRECT request (splice), also for requests under 64 KiB, "
      "which otherwise go in batches through io_uring")(
      "trace", po::value(&a.trace),
      "write one CSV row per controller tick to this file (see scripts/plot-trace)")(
      "probe", po::value(&a.probe),
      "on (default): time a 4 KiB O_DSYNC write on the target's filesystem each tick; off");
  add_backing_policy(opts, a.allow_dirs);
}

// Options that exclude or need each other.
void validate(const MergeArgs& a) {
  if (a.dry_run && !a.trace.empty())
    throw UsageError("--trace records a merge as it runs; a dry run runs none (drop --trace)");
  if (!a.via_libvirt() && a.top.empty())
    throw UsageError("give TOP, or --domain DOM --disk DEV, or --pool P --vol V");
  if (!a.domain.empty() && a.disk.empty()) throw UsageError("--domain needs --disk");
  if (!a.pool.empty() != !a.vol.empty()) throw UsageError("--pool and --vol go together");
  if (!a.max_rate.empty()) (void)parse_max_rate(a.max_rate);
  if (a.no_direct && a.force_direct)
    throw UsageError("--direct and --no-direct exclude each other");
  // Every value is checked, whatever the other options make of it.
  if (a.governed() && !a.budget.empty()) (void)parse_budget(a.budget);
  (void)parse_wait(a.lock_wait);
  (void)parse_output(a.output);
  if (a.probe != "on" && a.probe != "off")
    throw UsageError("--probe must be 'on' or 'off', not '" + a.probe + "'");
  if (a.cotenants != "on" && a.cotenants != "off")
    throw UsageError("--cotenants must be 'on' or 'off', not '" + a.cotenants + "'");
  if (!a.governed() && !a.trace.empty())
    throw UsageError("--trace needs a budget (the trace records the controller's decisions)");
}

// False when --help was asked for (and printed).
[[nodiscard]] bool parse_merge_args(const Args& args, MergeArgs& a) {
  po::options_description opts("options");
  add_merge_options(opts, a);
  po::positional_options_description pos;
  pos.add("top", 1);
  po::variables_map vm;
  if (!parse(
          args, opts, pos, vm,
          "qcommit merge TOP [--base BASE] [--rebase CHILD...] [--delete] [--budget DURATION|off]\n"
          "              [--config FILE] [--connect URI] [--cotenants on|off] [--probe on|off] "
          "[--trace FILE.csv]\n"
          "              [--max-rate SIZE] [--dry-run]",
          "examples:\n"
          "  qcommit merge snap1.qcow2                      # into snap1's backing file\n"
          "  qcommit merge snap2.qcow2 --base base.qcow2 --rebase snap3.qcow2\n"
          "  qcommit merge snap.qcow2 --budget off --output=json\n"
          "  qcommit merge snap.qcow2 --max-rate 50M            # at most 50 MiB/s\n"
          "  qcommit merge snap2.qcow2 --rebase snap3.qcow2 --delete --dry-run   # what it would "
          "do, nothing written\n"
          "  qcommit merge --domain vm1 --disk vda           # shut-off domain: merge and "
          "redefine\n"
          "  qcommit merge --pool default --vol vm1-snap.qcow2\n"
          "\nAfter a crash or kill, run the same command again: it resumes from its checkpoint.\n"))
    return false;
  note_given(a, vm);
  a.libvirt_required = a.uri_given || vm.count("cotenants");
  validate(a);
  return true;
}

// The engine's options for a merge of files. With a budget, O_DIRECT: the bytes we have queued
// are exactly our requests in flight, which the controller bounds. Unthrottled, kAuto: large
// requests O_DIRECT (spliced from the source's page cache), small ones buffered with writeback
// started at once, which lets the kernel merge and queue small random writes deeper than our
// threads do (see scripts/bench-merge).
engine::MergeOptions merge_options(const MergeArgs& a) {
  engine::MergeOptions mo;
  mo.top = a.top;
  if (!a.base.empty()) mo.base = a.base;
  mo.rebase = a.rebase;
  if (!a.top.empty()) mo.allowed_backing_dirs = backing_policy(a.top, a.allow_dirs);
  mo.delete_merged = a.del;
  // libvirt's users of the layers (its pools' images, its domains); the --domain form's own
  // domain is redefined by the merge, not orphaned.
  if (a.del) mo.find_users = libvirt_layer_users(a.uri, a.domain);
  mo.lock_wait = parse_wait(a.lock_wait);
  mo.io_uring = !a.no_io_uring;
  mo.write_mode = a.force_direct ? engine::WriteMode::kDirect
                  : a.no_direct  ? engine::WriteMode::kBuffered
                  : a.governed() ? engine::WriteMode::kDirect
                                 : engine::WriteMode::kAuto;
  return mo;
}

MergePolicyOptions policy_options(const MergeArgs& a) {
  MergePolicyOptions p;
  if (a.governed() && !a.budget.empty()) p.budget = parse_budget(a.budget);
  p.config_path = a.config_path;
  p.config_given = a.config_given;
  p.uri = a.uri;
  p.libvirt_required = a.libvirt_required;
  p.domain = a.domain;
  p.cotenants = a.cotenants == "on";
  if (!a.max_rate.empty()) p.max_rate_bytes_per_s = parse_max_rate(a.max_rate);
  return p;
}

// The budget and co-tenants of a governed merge depend on BASE (its pool, its filesystem): they
// are decided once BASE is known and said before the copy starts. Resolving the policy reads
// the configuration and asks libvirt, writing nothing (a dry run shows it too); the governor
// creates its probe file and trace, so only a real merge gets one.
struct GovernedMerge {
  GovernedMerge(const MergeArgs& a, Output o) : args(a), out(o), popts(policy_options(a)) {}

  const MergeArgs& args;
  Output out;
  MergePolicyOptions popts;
  std::optional<MergePolicy> policy;
  std::shared_ptr<engine::BudgetGovernor> governor;

  void announce_policy(const std::string& merge_base) {
    policy = resolve_merge_policy(popts, merge_base);
    if (out == Output::kJson) {
      json::Ordered event{{"event", "policy"}};
      event.update(policy->json_fields());
      print_json(event);
      if (policy->cotenant_state != "on") print_json(note_json(policy->cotenant_line()));
      for (const auto& n : policy->notes) print_json(note_json(n));
    } else {
      std::printf("%s\n", policy->budget_line().c_str());
      // Co-tenant pacing off because libvirt is unreachable is said without -v too.
      if (args.verbose || !policy->cotenant_disks.empty() ||
          policy->cotenant_state == "unavailable")
        std::printf("%s\n", policy->cotenant_line().c_str());
      std::fflush(stdout);
      for (const auto& n : policy->notes) std::fprintf(stderr, "%s\n", n.c_str());
    }
  }

  // `top`: TOP as its trace records it (empty where it is not known here).
  std::shared_ptr<engine::CopyGovernor> governor_for(const std::string& merge_base,
                                                     const std::string& top) {
    if (!args.governed()) return rate_cap();
    announce_policy(merge_base);
    governor = make_budget_governor(*policy, args.trace, args.probe == "on", top);
    return governor;
  }

  // --budget off: the copy paced at --max-rate alone (nullptr without it: unthrottled).
  std::shared_ptr<engine::CopyGovernor> rate_cap() const {
    if (!popts.max_rate_bytes_per_s) return nullptr;
    const std::string line =
        "no budget; at most " +
        format_size(static_cast<uint64_t>(*popts.max_rate_bytes_per_s)) + "/s (--max-rate)";
    if (out == Output::kJson) {
      json::Ordered event = off_policy_json();
      event["max-rate"] = whole(*popts.max_rate_bytes_per_s);
      json::Ordered e{{"event", "policy"}};
      e.update(event);
      print_json(e);
    } else {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    return make_rate_cap_governor(*popts.max_rate_bytes_per_s);
  }
};

// A message about the domain or pool, as a JSON note or a line on stderr.
void print_note(Output out, const std::string& m) {
  if (out == Output::kJson)
    print_json(note_json(m));
  else
    std::fprintf(stderr, "%s\n", m.c_str());
}

DomainMergeRequest domain_request(const MergeArgs& a, const engine::MergeOptions& mo) {
  DomainMergeRequest req;
  req.uri = a.uri;
  req.domain = a.domain;
  req.disk = a.disk;
  req.pool = a.pool;
  req.volume = a.vol;
  if (!a.top.empty()) req.top = a.top;
  if (!a.base.empty()) req.base = a.base;
  req.dry_run = a.dry_run;
  req.merge = mo;
  if (!a.top.empty())
    req.merge.allowed_backing_dirs = backing_policy(a.top, a.allow_dirs);
  else
    req.merge.allowed_backing_dirs =
        a.allow_dirs.empty() ? std::vector<std::string>{"/"} : a.allow_dirs;
  return req;
}

// What a dry run through libvirt would do, printed.
void print_domain_dry_run(const MergeArgs& a, const DomainMergeRequest& req,
                          const DomainMergeResult& dr, GovernedMerge& gm) {
  if (dr.plan && a.domain.empty()) {
    engine::MergeOptions m = req.merge;
    m.top = dr.top;
    check_rebase_children(m, *dr.plan);
  }
  if (a.governed() && !dr.base.empty()) gm.announce_policy(dr.base);
  DryRunExtras extra;
  extra.definition = dr.would_update_definition
                         ? "disk " + a.disk + " of domain " + a.domain + " would use " + dr.base
                         : std::string();
  extra.journal = dr.finished_earlier_run;
  if (dr.plan) {
    print_dry_run(gm.out, *dr.plan, dr.would_delete, extra);
    refuse_orphaning(*dr.plan, dr.would_delete);
  } else {
    engine::MergePlan p;  // an interrupted run whose data is merged: the rest is metadata
    p.layers = {dr.top};
    p.base = dr.base;
    print_dry_run(gm.out, p, dr.would_delete, extra);
  }
}

// A merge of a domain's disk (--domain) or of a pool's volume (--pool/--vol); nullopt after a
// dry run (printed).
std::optional<engine::MergeResult> merge_through_libvirt(const MergeArgs& a,
                                                         const engine::MergeOptions& mo,
                                                         GovernedMerge& gm) {
  DomainMergeRequest req = domain_request(a, mo);
  if ((a.governed() || !a.max_rate.empty()) && !a.dry_run) {
    // --domain hands over TOP and BASE; --pool/--vol hands over TOP (the volume) alone.
    req.make_governor = [&gm, &mo, dirs = req.merge.allowed_backing_dirs](
                            const std::string& top, const std::string& base) {
      return gm.governor_for(base.empty() ? merge_base_of(top, mo.base, dirs) : base, top);
    };
  }
  auto note = [&gm](const std::string& m) { print_note(gm.out, m); };
  DomainMergeResult dr = merge_domain(req, note);
  if (a.dry_run) {
    print_domain_dry_run(a, req, dr, gm);
    return std::nullopt;
  }
  for (auto& s : dr.snapshot_metadata_removed) note("removed metadata of snapshot '" + s + "'");
  if (dr.definition_updated)
    note("domain definition updated: disk " + a.disk + " now uses " + dr.base);
  for (auto& p : dr.pools_refreshed) note("refreshed storage pool " + p);
  engine::MergeResult r = dr.merge;
  if (r.top.empty()) {
    r.top = dr.top;
    r.base = dr.base;
  }
  return r;
}

void print_merge_result(const engine::MergeResult& r, engine::WriteMode mode,
                        const GovernedMerge& gm) {
  if (gm.out == Output::kJson) {
    print_json(result_json(r, gm.policy, gm.governor.get()));
    return;
  }
  // The requests under 64 KiB that went through io_uring (O_DIRECT, whatever the mode says of
  // small requests); nothing where none did.
  const std::string batched = r.io_uring_writes == 0
                                  ? ""
                                  : "; " + std::to_string(r.io_uring_writes) +
                                        (r.io_uring_writes == 1 ? " request" : " requests") +
                                        " under 64 KiB O_DIRECT in batches through io_uring";
  // The zeros written, and those BASE already read as zeros (the dry run's figure is their sum).
  const std::string already =
      r.skipped_zero_bytes ? " (" + format_size(r.skipped_zero_bytes) + " already read as zeros)" : "";
  std::printf("merged %s into %s: %s copied, %s of zeros written%s in %.2fs (%s%s)\n",
              r.top.c_str(), r.base.c_str(), format_size(r.copied_bytes).c_str(),
              format_size(r.zeroed_bytes).c_str(), already.c_str(), r.copy_seconds,
              !r.direct_io                       ? "buffered, bounded dirty data"
              : mode == engine::WriteMode::kAuto ? "O_DIRECT for large requests, buffered for small"
                                                 : "O_DIRECT",
              batched.c_str());
  if (r.resumed && r.base_changed)
    std::printf("resumed an interrupted run, but %s had changed since (replaced, rolled back or "
                "restored): copied everything again\n",
                r.base.c_str());
  else if (r.resumed)
    std::printf("resumed an interrupted run (from offset %s)\n",
                format_size(r.resumed_from).c_str());
  if (r.leaks_repaired)
    std::printf("repaired %" PRIu64 " leaked clusters left by the interrupted run\n",
                r.leaks_repaired);
  if (r.bitmaps_removed)
    std::printf("removed %zu persistent bitmaps from the base (they would be stale)\n",
                r.bitmaps_removed);
  for (auto& c : r.rebased) std::printf("rebased %s onto %s\n", c.c_str(), r.base.c_str());
  for (auto& d : r.deleted) std::printf("deleted %s\n", d.c_str());
  for (auto& n : r.not_deleted)
    std::fprintf(stderr, "qcommit: %s: merged, but not deleted: %s\n", n.path.c_str(), n.reason.c_str());
  if (!r.not_deleted.empty())
    std::fprintf(stderr, "qcommit: %s: the checkpoint is kept; run the same command again to delete what is left\n",
                 r.base.c_str());
  std::printf("switch-over took %.3f ms\n", r.switch_seconds * 1000);
  if (gm.governor) {
    const engine::CotenantStats cs = gm.governor->cotenant_stats();
    if (cs.samples)
      std::printf("co-tenants: %llu latency samples from up to %zu disks, largest %.1f ms\n",
                  static_cast<unsigned long long>(cs.samples), cs.max_disks,
                  std::chrono::duration<double, std::milli>(cs.max_latency).count());
  }
}

// The problem of a merge that ran out of room on BASE's storage, as one line: how much more it
// needs there (what is left to write from its checkpoint on, less what is free) and that the
// same command resumes it.
std::string no_space_problem(const engine::NoSpaceError& e) {
  const engine::SpaceNeed& n = e.need;
  std::string m = std::strerror(e.error_number());
  if (n.free_bytes) {
    m += ": the merge needs about " + human_size(n.shortfall() ? n.shortfall() : n.needed()) +
         (n.shortfall() ? " more there (" : " there (") + format_size(n.data_bytes) +
         " of data and " + format_size(n.metadata_bytes) + " of metadata left to write";
    if (n.reusable_bytes) m += ", " + format_size(n.reusable_bytes) + " reusable in the file";
    m += ", " + format_size(*n.free_bytes) + " free)";
  }
  if (e.resume_from)
    m += "; make room and run the same command again: it resumes from its checkpoint at " +
         format_size(*e.resume_from);
  else
    m += "; nothing was merged yet: make room and run the same command again";
  return m;
}

// The same as a JSON event, before the error line: {"event": "no-space", ...}.
json::Ordered no_space_json(const engine::NoSpaceError& e) {
  const engine::SpaceNeed& n = e.need;
  auto opt = [](const std::optional<uint64_t>& v) {
    return v ? json::Ordered(*v) : json::Ordered(nullptr);
  };
  return json::Ordered{{"event", "no-space"},
                       {"base", e.file()},
                       {"more-bytes", n.free_bytes ? opt(n.shortfall()) : json::Ordered(nullptr)},
                       {"data-bytes", n.data_bytes},
                       {"metadata-bytes", n.metadata_bytes},
                       {"reusable-bytes", n.reusable_bytes},
                       {"free-bytes", opt(n.free_bytes)},
                       {"resume-from", opt(e.resume_from)}};
}

}  // namespace

int cmd_merge(const Args& args) {
  MergeArgs a;
  if (!parse_merge_args(args, a)) return kExitOk;
  GovernedMerge gm(a, parse_output(a.output));
  engine::MergeOptions mo = merge_options(a);
  if (a.dry_run && !a.via_libvirt()) {
    const engine::MergePlan plan = engine::plan_merge(mo);
    check_rebase_children(mo, plan);
    if (a.governed()) gm.announce_policy(plan.base);
    print_dry_run(gm.out, plan, a.del, {});
    refuse_orphaning(plan, a.del);
    return kExitOk;
  }
  if (a.governed() && !a.via_libvirt())
    mo.governor = gm.governor_for(merge_base_of(a.top, mo.base, mo.allowed_backing_dirs),
                                  std::filesystem::absolute(a.top).lexically_normal().string());
  else if (!a.via_libvirt())
    mo.governor = gm.rate_cap();
  MergeProgress shown(gm.out, isatty(2) && gm.out == Output::kHuman, !a.dry_run);
  if (gm.governor)
    shown.set_p99_source([g = gm.governor] { return g->take_foreground_p99(); });
  mo.on_progress = [&shown](const engine::Progress& p) { shown.on_progress(p); };
  mo.on_lock_wait = [&shown](const engine::WaitNotice& n) { shown.on_lock_wait(n); };
  engine::MergeResult r;
  try {
    if (a.via_libvirt()) {
      auto merged = merge_through_libvirt(a, mo, gm);
      if (!merged) return kExitOk;  // a dry run
      r = std::move(*merged);
    } else {
      r = engine::merge(mo);
    }
    if (gm.governor) gm.governor->finish_trace(engine::Clock::now());  // the merge's end
  } catch (const engine::NoSpaceError& e) {
    shown.stop();
    if (gm.out == Output::kJson) print_json(no_space_json(e));
    throw qcow2::IoError(e.file(), no_space_problem(e), e.error_number());
  }
  shown.stop();
  print_merge_result(r, mo.write_mode, gm);
  return r.not_deleted.empty() ? kExitOk : kExitNotAllDeleted;
}

}  // namespace qcommit::cli
