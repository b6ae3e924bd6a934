// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit: merge qcow2 snapshots without stalling the guests that share the storage.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/options.h"
#include "qcow2/error.h"

namespace {

void usage(FILE* f) {
  std::fputs(
      "usage: qcommit COMMAND [ARGS...]\n"
      "\n"
      "commands:\n"
      "  info IMAGE [--output=json]   format, features and backing chain of an image\n"
      "  map IMAGE [--output=json]    which layer provides each byte (like qemu-img map)\n"
      "  merge TOP [--base B] [--rebase CHILD...] [--delete] [--budget 20ms|off]\n"
      "                               merge TOP (and intermediates) into BASE, offline\n"
      "  plan TOP [--base B]          what a merge would do (bytes, zeros, switch-over, ETA)\n"
      "  check IMAGE [-r leaks|all]   consistency check (like qemu-img check)\n"
      "  doctor [DOMAIN]              what on this host makes merges stall guests, and why\n"
      "  report TRACE.csv [-o F.html] summary and self-contained HTML plots of a merge --trace\n"
      "  status [--output=json]       block jobs governed by qcommitd\n"
      "  live DOMAIN DISK [--pivot]   governed block commit of a running domain's disk\n"
      "  demo [--output=json]         build a small qcow2 chain, merge it and verify it\n"
      "\n"
      "Every command takes --output=json. Run 'qcommit COMMAND --help' (or 'qcommit help\n"
      "COMMAND') for the options and examples of one command; 'qcommit --version' prints the\n"
      "version.\n",
      f);
}

// Runs the subcommand `cmd`; nullopt when there is none of that name.
std::optional<int> run_command(const std::string& cmd, const qcommit::cli::Args& args) {
  using namespace qcommit::cli;
  if (cmd == "info") return cmd_info(args);
  if (cmd == "map") return cmd_map(args);
  if (cmd == "demo") return cmd_demo(args);
  if (cmd == "merge") return cmd_merge(args);
  if (cmd == "check") return cmd_check(args);
  if (cmd == "plan") return cmd_plan(args);
  if (cmd == "doctor") return cmd_doctor(args);
  if (cmd == "report") return cmd_report(args);
  if (cmd == "status") return cmd_status(args);
  if (cmd == "live") return cmd_live(args);
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qcommit::cli;
  if (argc < 2) {
    usage(stderr);
    return kExitUsage;
  }
  // A peer that goes away (libvirtd restarting, qcommitd stopping, a reader of our output that
  // exits) is an error a command reports or waits out, not a silent death: libvirt's client
  // writes to its socket without MSG_NOSIGNAL, so libvirtd closing the connection between two
  // calls killed `qcommit live` with SIGPIPE (exit 141, nothing said).
  std::signal(SIGPIPE, SIG_IGN);
  const std::string cmd = argv[1];
  Args args(argv + 2, argv + argc);
  return run_reporting_failures(cmd, [&]() -> int {
    if (const auto rc = run_command(cmd, args)) return *rc;
    // "qcommit help merge" is "qcommit merge --help".
    if (cmd == "help" && args.size() == 1) {
      if (const auto rc = run_command(args[0], {"--help"})) return *rc;
      std::fprintf(stderr, "qcommit: unknown command '%s'\n", args[0].c_str());
      usage(stderr);
      return kExitUsage;
    }
    if (cmd == "--version" || cmd == "version") {
      std::printf("qcommit %s\n", QCOMMIT_VERSION);
      return kExitOk;
    }
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      usage(stdout);
      return kExitOk;
    }
    std::fprintf(stderr, "qcommit: unknown command '%s'\n", cmd.c_str());
    usage(stderr);
    return kExitUsage;
  });
}
