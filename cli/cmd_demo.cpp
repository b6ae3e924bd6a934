// qcommit demo: builds a small qcow2 chain with qemu-img/qemu-io in a temporary directory and
// shows what qcommit sees, checking our reading against qemu-img's.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>

#include "cli/json.h"
#include "cli/options.h"
#include "plugin/process.h"
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
  const bool human = out == Output::kHuman;
  char tmpl[] = "/tmp/qcommit-demo.XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("cannot create a temporary directory");
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    bool keep;
    ~Cleanup() {
      if (!keep) std::filesystem::remove_all(dir);
    }
  } cleanup{dir, keep};
  const std::string base = dir + "/base.qcow2", s1 = dir + "/snap1.qcow2",
                    s2 = dir + "/snap2.qcow2";
  if (human) std::cout << "== building a chain in " << dir << " with qemu-img/qemu-io\n";
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", base, "64M"});
  run_checked({"qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 32M 1M", base});
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", s1});
  run_checked({"qemu-io", "-c", "write -P 0x21 4M 2M", "-c", "write -z 33M 512k", s1});
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", "-b", "snap1.qcow2", "-F", "qcow2", s2});
  run_checked({"qemu-io", "-c", "write -P 0x31 5M 64k", "-c", "discard 0 64k", s2});
  json::Ordered doc{{"dir", dir}, {"kept", keep}, {"images", {base, s1, s2}}};
  if (human) {
    std::cout << "base.qcow2 <- snap1.qcow2 <- snap2.qcow2\n\n== qcommit info " << s2 << "\n";
    int rc = cmd_info({s2});
    if (rc) return rc;
    std::cout << "\n== qcommit map " << s2 << "\n";
    rc = cmd_map({s2});
    if (rc) return rc;
  } else {
    doc["info"] = child_json({"info", s2});
    doc["map"] = child_json({"map", s2});
  }
  // Cross-check: every byte we read equals qemu-img convert's raw output.
  const std::string raw = dir + "/view.raw";
  run_checked({"qemu-img", "convert", "-O", "raw", s2, raw});
  std::optional<uint64_t> mismatch;
  uint64_t compared = 0;
  {
    qcow2::Chain chain = qcow2::Chain::open(s2);
    auto dev = qcow2::FileDevice::open(raw);
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
  doc["cross-check"] =
      json::Ordered{{"bytes-equal", compared},
                    {"mismatch-at", mismatch ? json::Ordered(*mismatch) : json::Ordered(nullptr)}};
  if (mismatch) {
    if (human) {
      std::cout << "\nMISMATCH at offset " << *mismatch << " between qcommit and qemu-img\n";
    } else {
      doc["passed"] = false;
      print_json(doc);
    }
    return kExitError;
  }
  if (human)
    std::cout << "\n== every byte read through the chain equals qemu-img convert's output\n";

  // Merge snap2 (and snap1) into base, then verify with qemu-img itself.
  if (human) {
    std::cout << "\n== qcommit merge " << s2 << " --base " << base << "\n";
    const int rc = cmd_merge({s2, "--base", base, "--budget", "off"});
    if (rc) return rc;
  } else {
    doc["merge"] =
        child_json({"merge", s2, "--base", base, "--budget", "off"}, JsonForm::kLastLine);
  }
  ProcessResult cmp = run_process({"qemu-img", "compare", "-f", "raw", "-F", "qcow2", raw, base});
  ProcessResult chk = run_process({"qemu-img", "check", base});
  const bool passed = cmp.exit_code == 0 && chk.exit_code == 0;
  if (!human) {
    doc["qemu-img-compare"] = process_json(cmp);
    doc["qemu-img-check"] = process_json(chk);
    doc["passed"] = passed;
    print_json(doc);
    return passed ? kExitOk : kExitError;
  }
  std::cout << "qemu-img compare (view before merge vs base after): " << cmp.output;
  std::cout << "qemu-img check base: " << chk.output;
  if (!passed) {
    std::cout << "\nDEMO FAILED: the merged base does not match or is not clean\n";
    return kExitError;
  }
  std::cout << "\n== demo passed: base.qcow2 now shows exactly what snap2.qcow2 showed\n";
  if (keep) std::cout << "kept " << dir << "\n";
  return kExitOk;
}

}  // namespace qcommit::cli
