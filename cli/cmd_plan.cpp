// qcommit plan: what a merge would do, without writing anything (except the optional
// bandwidth measurement, which writes and removes a scratch file beside BASE).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "common/defaults.h"
#include "cli/json.h"
#include "cli/merge_policy.h"
#include "cli/options.h"
#include "cli/units.h"
#include "engine/merge.h"
#include "qcow2/device.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace {

inline constexpr uint64_t kMeasureBytes = 32ull << 20;
inline constexpr uint64_t kMeasureChunk = 1ull << 20;

// Sequential O_DIRECT (else O_DSYNC) write bandwidth of the filesystem holding `dir`, bytes/s.
double measure_write_bandwidth(const std::string& dir) {
  const std::string path = dir + "/.qcommit-measure-" + std::to_string(getpid());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_DSYNC | O_CLOEXEC, 0600);
  if (fd < 0)
    throw std::runtime_error(path + ": cannot create measurement file: " + std::strerror(errno));
  ::unlink(path.c_str());
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, kMeasureChunk) != 0) {
    ::close(fd);
    throw std::bad_alloc();
  }
  std::memset(mem, 0xa5, kMeasureChunk);
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t off = 0; off < kMeasureBytes; off += kMeasureChunk)
    if (::pwrite(fd, mem, kMeasureChunk, off_t(off)) != ssize_t(kMeasureChunk)) break;
  ::fdatasync(fd);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  free(mem);
  return s > 0 ? double(kMeasureBytes) / s : 0;
}

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

}  // namespace

int cmd_plan(const Args& args) {
  po::options_description opts("options");
  std::string top, base, output = "human", rate, budget, uri = defaults::kUri;
  std::string config_path = defaults::kConfigPath;
  std::vector<std::string> rebase, allow_dirs;
  bool measure = false;
  opts.add_options()("top", po::value(&top)->required(), "the image to merge (TOP)")(
      "base", po::value(&base),
      "merge into this image of TOP's chain (default: TOP's backing file)")(
      "rebase", po::value(&rebase)->multitoken(), "children of TOP that would be rebased")(
      "rate", po::value(&rate), "expected copy rate for the ETA, e.g. 80M (per second)")(
      "measure", po::bool_switch(&measure),
      "measure the target's sequential write bandwidth for the ETA (writes 32 MiB beside BASE)")(
      "budget", po::value(&budget),
      ("the budget the merge would be given on the command line (" + defaults::budget_text() +
       ", off)").c_str())(
      "config", po::value(&config_path),
      (std::string("qcommitd configuration with the per-pool policies (default ") +
       defaults::kConfigPath + ")").c_str())(
      "connect,c", po::value(&uri),
      (std::string("libvirt connection URI for the pool of BASE and its co-tenants (default ") +
       defaults::kUri + ")").c_str())(
      "uri", po::value(&uri), "the same as --connect")("output", po::value(&output),
                                                       "human or json");
  add_backing_policy(opts, allow_dirs);
  po::positional_options_description pos;
  pos.add("top", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm,
             "qcommit plan TOP [--base BASE] [--rebase CHILD...] [--rate R | --measure]",
             "examples:\n  qcommit plan snap.qcow2\n  qcommit plan snap2.qcow2 --base base.qcow2 "
             "--measure\n"))
    return kExitOk;
  const Output out = parse_output(output);
  engine::MergeOptions mo;
  mo.top = top;
  if (!base.empty()) mo.base = base;
  mo.rebase = rebase;
  mo.allowed_backing_dirs = backing_policy(top, allow_dirs);
  const engine::MergePlan p = engine::plan_merge(mo);
  double bw = 0;
  std::string bw_source;
  if (!rate.empty()) {
    bw = double(parse_size(rate));
    bw_source = "given";
  } else if (measure) {
    bw = measure_write_bandwidth(std::filesystem::absolute(p.base).parent_path().string());
    bw_source = "measured";
  }
  const double eta = bw > 0 ? double(p.data_bytes) / bw : -1;
  // The budget `qcommit merge` would take, and from where.
  std::optional<MergePolicy> policy;
  if (budget != "off") {
    MergePolicyOptions popts;
    if (!budget.empty()) popts.budget = parse_duration(budget);
    popts.config_path = config_path;
    popts.config_given = vm.count("config") > 0;
    popts.uri = uri;
    policy = resolve_merge_policy(popts, p.base);
  }
  warn_short_space(p);
  if (out == Output::kJson) {
    json::Ordered doc = plan_json(top, p);
    doc.update(policy ? policy->json_fields() : off_policy_json());
    if (bw > 0) {
      doc["rate"] = whole(bw);
      doc["eta-seconds"] = rounded(eta, 1);
    }
    print_json(doc);
    return kExitOk;
  }
  std::printf("merge plan (nothing written)\n");
  // Each path as QEMU names it, and where the kernel resolves it when that differs.
  const auto shown = [](const std::string& path) {
    const std::string real = resolved(path);
    return real == path ? path : path + " -> " + real;
  };
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
  if (policy) {
    std::printf("budget:         %s\n", policy->budget_line().substr(7).c_str());
    std::printf("                %s\n", policy->cotenant_line().c_str());
  } else {
    std::printf("budget:         off (unthrottled)\n");
  }
  if (bw > 0)
    std::printf(
        "ETA:            %.1f s at %s/s (%s; with a latency budget the copy takes what co-tenants "
        "leave)\n",
        eta, format_size(uint64_t(bw)).c_str(), bw_source.c_str());
  else
    std::printf("ETA:            give --rate or --measure\n");
  return kExitOk;
}

}  // namespace qcommit::cli
