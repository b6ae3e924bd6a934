// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit check: consistency check like qemu-img check, with repair.
#include <cinttypes>
#include <cstdio>

#include <array>
#include <cstring>

#include "cli/json.h"
#include "cli/options.h"
#include "qcow2/check.h"
#include "qcow2/device.h"
#include "qcow2/error.h"
#include "qcow2/format.h"

namespace qcommit::cli {

namespace {

// qcow2's magic at the start of the file (read through the opened device: the open policy holds).
bool has_qcow2_magic(qcow2::BlockDevice& dev) {
  std::array<uint8_t, 4> magic{};
  if (dev.size() < magic.size()) return false;
  dev.read(0, magic);
  const std::array<uint8_t, 4> want{uint8_t(qcow2::kMagic >> 24), uint8_t(qcow2::kMagic >> 16),
                                    uint8_t(qcow2::kMagic >> 8), uint8_t(qcow2::kMagic)};
  return magic == want;
}

// The statistics lines of qemu-img check's text output, in its words and rounding (no statistics
// line when nothing is allocated).
void print_statistics(const qcow2::CheckResult& r) {
  if (r.total_clusters && r.allocated_clusters)
    std::printf("%" PRIu64 "/%" PRIu64
                " = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% compressed clusters\n",
                r.allocated_clusters, r.total_clusters,
                double(r.allocated_clusters) * 100.0 / double(r.total_clusters),
                double(r.fragmented_clusters) * 100.0 / double(r.allocated_clusters),
                double(r.compressed_clusters) * 100.0 / double(r.allocated_clusters));
  if (r.image_end_offset) std::printf("Image end offset: %" PRIu64 "\n", r.image_end_offset);
}

// The command line with --repair's and -r's values joined to them: a bare --repair takes no
// value from the next word ("check --repair IMAGE" repairs leaks of IMAGE; boost would read IMAGE
// as the value), and -r takes one as qemu-img check spells it ("-r leaks", "-r all").
Args joined_repair(const Args& in) {
  Args args;
  for (size_t i = 0; i < in.size(); ++i) {
    const bool value_next = i + 1 < in.size() && (in[i + 1] == "leaks" || in[i + 1] == "all");
    if (in[i] == "--repair" || in[i] == "-r") {
      if (value_next) {
        args.push_back("--repair=" + in[++i]);
      } else if (in[i] == "-r") {
        throw UsageError("-r needs 'leaks' or 'all' (as qemu-img check -r)");
      } else {
        args.push_back("--repair=leaks");
      }
    } else {
      args.push_back(in[i]);
    }
  }
  return args;
}

// What qemu-img check prints when it repaired something, before checking the image again.
void print_repaired(const qcow2::CheckResult& r) {
  std::printf("The following inconsistencies were found and repaired:\n\n"
              "    %" PRIu64 " leaked clusters\n    %" PRIu64 " corruptions\n\n"
              "Double checking the fixed image now...\n",
              r.leaks_fixed, r.corruptions_fixed);
}

int run_check(const Args& in_args) {
  const Args args = joined_repair(in_args);
  po::options_description opts("options");
  std::string image, output = "human", repair;
  opts.add_options()("image", po::value(&image)->required(), "image file")(
      "repair,r", po::value(&repair)->implicit_value("leaks"),
      "repair: 'leaks' (default) or 'all'; -r leaks|all as qemu-img check spells it")(
      "output", po::value(&output), "human or json");
  po::positional_options_description pos;
  pos.add("image", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm,
             "qcommit check IMAGE [--repair[=leaks|all] | -r leaks|all] [--output=json]",
             "exit status (as qemu-img check): 0 clean, 1 check not run (error), 2 corruptions,\n"
             "3 leaked clusters only, 63 not a qcow2 image\n"
             "examples:\n  qcommit check base.qcow2\n  qcommit check --repair base.qcow2\n"
             "  qcommit check -r all base.qcow2\n"))
    return kExitOk;
  const Output out = parse_output(output);
  qcow2::Repair mode = qcow2::Repair::kNone;
  if (repair == "leaks")
    mode = qcow2::Repair::kLeaks;
  else if (repair == "all")
    mode = qcow2::Repair::kAll;
  else if (!repair.empty())
    throw UsageError("--repair must be 'leaks' or 'all'");
  auto dev = qcow2::FileDevice::open(image, {.writable = mode != qcow2::Repair::kNone});
  if (!has_qcow2_magic(*dev)) {
    std::fprintf(stderr, "qcommit: %s: not a qcow2 image: this format has no checks\n", image.c_str());
    return kCheckExitUnsupported;
  }
  auto img = qcow2::Image::open(std::move(dev));
  auto r = qcow2::check(*img, mode);
  const uint64_t corruptions = r.corruptions - r.corruptions_fixed;
  const uint64_t leaks = r.leaks - r.leaks_fixed;
  if (out == Output::kJson) {
    print_json(json::Ordered{{"filename", image},
                             {"format", "qcow2"},
                             {"corruptions", corruptions},
                             {"leaks", leaks},
                             {"corruptions-fixed", r.corruptions_fixed},
                             {"leaks-fixed", r.leaks_fixed},
                             {"allocated-clusters", r.allocated_clusters},
                             {"fragmented-clusters", r.fragmented_clusters},
                             {"compressed-clusters", r.compressed_clusters},
                             {"total-clusters", r.total_clusters},
                             {"image-end-offset", r.image_end_offset},
                             {"check-errors", 0}});
  } else {
    for (const auto& m : r.messages) std::fprintf(stderr, "%s\n", m.c_str());
    if (r.leaks_fixed || r.corruptions_fixed) print_repaired(r);
    // qemu-img check's verdict, word for word (scripts and people read it).
    if (!corruptions && !leaks) std::printf("No errors were found on the image.\n");
    if (corruptions)
      std::printf("\n%" PRIu64 " errors were found on the image.\n"
                  "Data may be corrupted, or further writes to the image may corrupt it.\n",
                  corruptions);
    if (leaks)
      std::printf("\n%" PRIu64 " leaked clusters were found on the image.\n"
                  "This means waste of disk space, but no harm to data.\n",
                  leaks);
    print_statistics(r);
  }
  if (corruptions) return kCheckExitCorrupt;
  if (leaks) return kCheckExitLeaks;
  return kExitOk;
}

}  // namespace

// The check's own exit codes for every outcome, whatever other commands return for the same
// error (a usage error is 2 elsewhere, which here would read as "corruptions found").
int cmd_check(const Args& args) {
  return run_reporting_failures("check", [&] { return run_check(args); }, kCheckFailureExits);
}

}  // namespace qcommit::cli
