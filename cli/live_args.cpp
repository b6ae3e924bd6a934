// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit live`'s options: their declarations, --help text and checks.
#include "cli/live_args.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>

#include "cli/merge_policy.h"
#include "cli/units.h"

namespace qcommit::cli {
namespace {

using plugin::Duration;

constexpr const char* kSynopsis =
    "qcommit live DOMAIN DISK [--top T] [--base B] [--budget 20ms] [--pivot]\n"
    "                    [--strategy two-phase|direct] [--overlay-dir DIR] [-c|--connect URI]\n"
    "                    [--wait DURATION] [--dry-run] [--output=json]\n"
    "                    [--page-cache auto|no-cachestat|meminfo] [--probe auto|off|PERIOD]\n"
    "       qcommit live --qmp SOCKET DISK [--top T] [--base B] [--budget 20ms] [--pivot] ...";

constexpr const char* kExamples =
    "Merges TOP (default: the disk's active layer) into BASE (default: the bottom of the chain)\n"
    "on the running DOMAIN with libvirt block jobs, paced by the qcommitd governor so that the\n"
    "guests on the same storage see at most BUDGET of added latency. While qcommitd answers on\n"
    "its socket and no other connection is named (-c), it governs the jobs this command starts,\n"
    "with its own policy (--budget is then not used), and the progress shown is qcommitd's.\n"
    "examples:\n"
    "  qcommit live vm1 vda --pivot\n"
    "  qcommit live vm1 vda --dry-run --strategy direct\n"
    "  qcommit live vm1 vda --pivot --output=json | jq -c 'select(.event != \"progress\")'\n"
    "  qcommit live --qmp /var/run/qemu-server/100.qmp drive-scsi0 --pivot\n";

void add_live_options(po::options_description& opts, LiveArgs& a) {
  opts.add_options()("top", po::value(&a.req.top), "the layer to merge (default: the active one)")(
      "base", po::value(&a.req.base), "the layer to merge into (default: the bottom of the chain)");
  a.budget = defaults::budget_text();
  add_policy_args(opts, a,
                  {.budget_off = false,
                   .budget_from_policy = false,
                   .config = false,
                   .max_rate_use = "it caps the job's speed whatever the policy allows",
                   .max_rate_least = "64K",
                   .output_json = " (JSON lines on stdout: plan, wait, step, progress (1/s) and "
                                  "result events)"});
  opts.add_options()(
      "probe", po::value(&a.probe),
      "the shared-queue probe (a 4 KiB write + flush beside BASE, standing for guests on other "
      "hosts): auto (default: every 100ms where BASE is on storage other hosts can share, e.g. "
      "NFS), off, or a period from 10ms to 10s such as 50ms (on any storage)")(
      "pivot", po::bool_switch(&a.req.pivot),
                    "switch the disk to BASE when the active commit is ready (else it is left "
                    "ready)")(
      "strategy", po::value(&a.strategy),
      "two-phase (default, active layer only): a fresh overlay takes the guest's new writes, the "
      "old overlay is committed as a non-active commit (one 512 KiB request at a time), then the "
      "small fresh overlay is active-committed; direct: one active commit (QEMU's mirror: 16 x 1 "
      "MiB requests in flight)")(
      "overlay-dir", po::value(&a.overlay_dir),
      "two-phase: create the fresh overlay in DIR (e.g. local SSD) instead of next to TOP: the "
      "guest's writes during the merge then never wait behind it on shared storage. Until the "
      "pivot the disk depends on DIR: a host failure leaves its latest writes there")(
      "wait", po::value(&a.wait),
      ("how long a block job somebody else runs on the disk is waited for (default " +
       defaults::lock_wait_text() + "; 0: refuse at once)")
          .c_str())("dry-run", po::bool_switch(&a.dry_run), "print the steps, change nothing")(
      "page-cache", po::value(&a.page_cache_name),
      "where the target's dirty pages are read: auto (cachestat(2) where the kernel has it, else "
      "no-cachestat), no-cachestat (forced: what a kernel before 6.5 gets), no-cachestat-shadow "
      "(also logs cachestat's truth) or meminfo")(
      "qmp", po::value(&a.qmp),
      "a QEMU that libvirt does not manage (e.g. Proxmox VE's /var/run/qemu-server/ID.qmp), "
      "driven over its QMP monitor; DISK: a drive id, device id, node name or the active layer's "
      "path. QEMU serves one QMP client per socket: its other clients wait until qcommit live "
      "ends")("socket", po::value(&a.daemon_socket),
              "qcommitd's control socket (default /run/qcommit/qcommitd.sock)")(
      "daemon-socket", po::value(&a.daemon_socket), "the same as --socket");
}

// The overlay directory as QEMU and libvirt must be given it: an existing directory, absolute.
std::string checked_overlay_dir(const std::string& dir) {
  struct stat sb {};
  if (::stat(dir.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode))
    throw LiveError("--overlay-dir " + dir + ": not a directory");
  char* real = ::realpath(dir.c_str(), nullptr);
  if (!real) return dir;
  std::string out = real;
  std::free(real);
  return out;
}

void validate(LiveArgs& a, const po::variables_map& vm) {
  if (a.strategy == "direct")
    a.req.strategy = plugin::LiveStrategy::Direct;
  else if (a.strategy == "two-phase")
    a.req.strategy = plugin::LiveStrategy::TwoPhase;
  else
    throw UsageError("--strategy must be two-phase or direct, not '" + a.strategy + "'");
  const auto src = plugin::parse_page_cache_source(a.page_cache_name);
  if (!src)
    throw UsageError(
        "--page-cache must be auto, no-cachestat, no-cachestat-shadow or meminfo, "
        "not '" +
        a.page_cache_name + "'");
  a.page_cache = *src;
  a.json_out = parse_output(a.output) == Output::kJson;
  a.wait_limit = std::chrono::duration_cast<Duration>(parse_wait(a.wait));
  (void)parse_budget(a.budget);
  note_given(a, vm);
  if (!a.max_rate.empty()) {
    a.max_rate_bytes_per_s = parse_max_rate(a.max_rate);
    if (*a.max_rate_bytes_per_s < static_cast<double>(plugin::kMinJobSpeedBytesPerS))
      throw UsageError("--max-rate " + a.max_rate +
                       ": at least 64K for a block job (the slowest speed the governor sets)");
  }
  if (!a.overlay_dir.empty()) {
    if (a.req.strategy != plugin::LiveStrategy::TwoPhase)
      throw UsageError("--overlay-dir is for the two-phase strategy (its fresh overlay)");
    a.overlay_dir = checked_overlay_dir(a.overlay_dir);
  }
  if (!a.qmp.empty()) {
    if (a.uri_given) throw UsageError("--qmp and --connect exclude each other");
    if (a.pos.size() != 1) throw UsageError("expected --qmp SOCKET DISK (see --help)");
    a.req.disk = a.pos[0];
  } else {
    if (a.pos.size() != 2) throw UsageError("expected DOMAIN DISK (see --help)");
    a.req.domain = a.pos[0];
    a.req.disk = a.pos[1];
  }
}

}  // namespace

bool parse_live_args(const Args& args, LiveArgs& a) {
  po::options_description opts("options");
  add_live_options(opts, a);
  po::options_description hidden;
  hidden.add_options()("target", po::value(&a.pos)->multitoken(), "DOMAIN DISK, or DISK");
  po::positional_options_description pos;
  pos.add("target", -1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm, kSynopsis, kExamples, &hidden)) return false;
  validate(a, vm);
  return true;
}

}  // namespace qcommit::cli
