// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit demo: builds a small qcow2 chain with qemu-img/qemu-io in a temporary directory and
// shows what qcommit sees, checking our reading against qemu-img's.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>

#include "cli/json.h"
#include "cli/options.h"
#include "plugin/host/process.h"
#include "qcow2/chain.h"

namespace qcommit::cli {

using plugin::ProcessResult;
using plugin::run_checked;
using plugin::run_process;

namespace {

// `qcommit ARGS... --output=json` run as a child of this process: its JSON document (of JSON
// lines, the last one: merge's result), members in the child's order.
enum class JsonForm { kDocument, kLastLine };
json::Ordered child_json(const std::vector<std::string>& args,
                         JsonForm form = JsonForm::kDocument) {
  std::vector<std::string> argv{"/proc/self/exe"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back("--output=json");
  std::string out = run_checked(argv);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  if (form == JsonForm::kLastLine) {
    if (const auto nl = out.rfind('\n'); nl != std::string::npos) out.erase(0, nl + 1);
  }
  std::string err;
  std::optional<json::Ordered> doc =
      json::parse<json::Ordered>(out, json::kChildOutputLimits, &err);
  if (!doc)
    throw std::runtime_error("qcommit " + args[0] + " --output=json: not JSON (" + err + ")");
  return *doc;
}

json::Ordered process_json(const ProcessResult& r) {
  return json::Ordered{{"exit-code", r.exit_code}, {"output", r.output}};
}

// A temporary directory, removed at the end unless it is to be kept.
struct DemoDir {
  std::string path;
  bool keep;
  explicit DemoDir(bool keep_it) : keep(keep_it) {
    char tmpl[] = "/tmp/qcommit-demo.XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("cannot create a temporary directory");
    path = tmpl;
  }
  ~DemoDir() {
    if (!keep) std::filesystem::remove_all(path);
  }
  DemoDir(const DemoDir&) = delete;
  DemoDir& operator=(const DemoDir&) = delete;
};

// The demo's steps, each shown (human) or recorded in one JSON document.
class Demo {
 public:
  Demo(const DemoDir& dir, bool human)
      : human_(human),
        keep_(dir.keep),
        dir_(dir.path),
        base_(dir_ + "/base.qcow2"),
        s1_(dir_ + "/snap1.qcow2"),
        s2_(dir_ + "/snap2.qcow2"),
        raw_(dir_ + "/view.raw"),
        doc_{{"dir", dir_}, {"kept", dir.keep}, {"images", {base_, s1_, s2_}}} {}

  // Each step returns an exit code: kExitOk to go on.
  int run() {
    build_chain();
    if (const int rc = show_chain()) return rc;
    if (const int rc = cross_check()) return rc;
    if (const int rc = merge()) return rc;
    return verify();
  }

 private:
  // base.qcow2 <- snap1.qcow2 <- snap2.qcow2, each layer with data, zeroes or a discard.
  void build_chain() {
    if (human_) std::cout << "== building a chain in " << dir_ << " with qemu-img/qemu-io\n";
    run_checked({"qemu-img", "create", "-q", "-f", "qcow2", base_, "64M"});
    run_checked({"qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 32M 1M", base_});
    run_checked(
        {"qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", s1_});
    run_checked({"qemu-io", "-c", "write -P 0x21 4M 2M", "-c", "write -z 33M 512k", s1_});
    run_checked(
        {"qemu-img", "create", "-q", "-f", "qcow2", "-b", "snap1.qcow2", "-F", "qcow2", s2_});
    run_checked({"qemu-io", "-c", "write -P 0x31 5M 64k", "-c", "discard 0 64k", s2_});
  }

  // `qcommit info` and `qcommit map` of the top.
  int show_chain() {
    if (!human_) {
      doc_["info"] = child_json({"info", s2_});
      doc_["map"] = child_json({"map", s2_});
      return kExitOk;
    }
    std::cout << "base.qcow2 <- snap1.qcow2 <- snap2.qcow2\n\n== qcommit info " << s2_ << "\n";
    if (const int rc = cmd_info({s2_})) return rc;
    std::cout << "\n== qcommit map " << s2_ << "\n";
    return cmd_map({s2_});
  }

  // Every byte read through the chain against qemu-img convert's raw output.
  int cross_check() {
    run_checked({"qemu-img", "convert", "-O", "raw", s2_, raw_});
    std::optional<uint64_t> mismatch;
    uint64_t compared = 0;
    {
      qcow2::Chain chain = qcow2::Chain::open(s2_);
      auto dev = qcow2::FileDevice::open(raw_);
      std::vector<uint8_t> a(1 << 20), b(1 << 20);
      for (uint64_t off = 0; off < chain.virtual_size() && !mismatch; off += a.size()) {
        chain.read(off, a);
        dev->read(off, b);
        if (a != b)
          mismatch = off;
        else
          compared += a.size();
      }
    }
    doc_["cross-check"] = json::Ordered{
        {"bytes-equal", compared},
        {"mismatch-at", mismatch ? json::Ordered(*mismatch) : json::Ordered(nullptr)}};
    if (!mismatch) {
      if (human_)
        std::cout << "\n== every byte read through the chain equals qemu-img convert's output\n";
      return kExitOk;
    }
    if (human_) {
      std::cout << "\nMISMATCH at offset " << *mismatch << " between qcommit and qemu-img\n";
    } else {
      doc_["passed"] = false;
      print_json(doc_);
    }
    return kExitError;
  }

  // snap2 (and snap1) into base.
  int merge() {
    if (!human_) {
      doc_["merge"] =
          child_json({"merge", s2_, "--base", base_, "--budget", "off"}, JsonForm::kLastLine);
      return kExitOk;
    }
    std::cout << "\n== qcommit merge " << s2_ << " --base " << base_ << "\n";
    return cmd_merge({s2_, "--base", base_, "--budget", "off"});
  }

  // The base against the view before the merge, and its metadata, by qemu-img itself.
  int verify() {
    ProcessResult cmp =
        run_process({"qemu-img", "compare", "-f", "raw", "-F", "qcow2", raw_, base_});
    ProcessResult chk = run_process({"qemu-img", "check", base_});
    const bool passed = cmp.exit_code == 0 && chk.exit_code == 0;
    if (!human_) {
      doc_["qemu-img-compare"] = process_json(cmp);
      doc_["qemu-img-check"] = process_json(chk);
      doc_["passed"] = passed;
      print_json(doc_);
      return passed ? kExitOk : kExitError;
    }
    std::cout << "qemu-img compare (view before merge vs base after): " << cmp.output;
    std::cout << "qemu-img check base: " << chk.output;
    if (!passed) {
      std::cout << "\nDEMO FAILED: the merged base does not match or is not clean\n";
      return kExitError;
    }
    std::cout << "\n== demo passed: base.qcow2 now shows exactly what snap2.qcow2 showed\n";
    if (keep_) std::cout << "kept " << dir_ << "\n";
    return kExitOk;
  }

  bool human_, keep_;
  std::string dir_, base_, s1_, s2_, raw_;
  json::Ordered doc_;
};

}  // namespace

int cmd_demo(const Args& args) {
  po::options_description opts("options");
  bool keep = false;
  std::string output = "human";
  opts.add_options()("keep", po::bool_switch(&keep), "keep the temporary directory")(
      "output", po::value(&output), "human or json (one document: each step's result)");
  po::positional_options_description pos;
  po::variables_map vm;
  if (!parse(
          args, opts, pos, vm, "qcommit demo [--keep] [--output=json]",
          "Builds base.qcow2 <- snap1.qcow2 <- snap2.qcow2 with qemu-img and qemu-io in a\n"
          "temporary directory, shows the chain as qcommit reads it, checks every byte against\n"
          "qemu-img convert, merges it and verifies the base with qemu-img compare and check.\n"
          "examples:\n  qcommit demo\n  qcommit demo --keep      # look at the images afterwards\n"
          "  qcommit demo --output=json | jq '.passed, .merge.copied'\n"))
    return kExitOk;
  const Output out = parse_output(output);
  const DemoDir dir(keep);
  return Demo(dir, out == Output::kHuman).run();
}

}  // namespace qcommit::cli
