// qcommit demo: builds a small qcow2 chain with qemu-img/qemu-io in a temporary directory and
// shows what qcommit sees, checking our reading against qemu-img's.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "cli/options.h"
#include "cli/process.h"
#include "qcow2/chain.h"

namespace qcommit::cli {

int cmd_demo(const Args& args) {
  po::options_description opts("options");
  bool keep = false;
  opts.add_options()("keep", po::bool_switch(&keep), "keep the temporary directory");
  po::positional_options_description pos;
  po::variables_map vm;
  if (!parse(args, opts, pos, vm, "qcommit demo [--keep]",
             "Builds base.qcow2 <- snap1.qcow2 <- snap2.qcow2 with qemu-img and qemu-io in a\n"
             "temporary directory and shows the chain as qcommit reads it.\n"))
    return kExitOk;
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
  const std::string base = dir + "/base.qcow2", s1 = dir + "/snap1.qcow2", s2 = dir + "/snap2.qcow2";
  std::cout << "== building a chain in " << dir << " with qemu-img/qemu-io\n";
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", base, "64M"});
  run_checked({"qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 32M 1M", base});
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", s1});
  run_checked({"qemu-io", "-c", "write -P 0x21 4M 2M", "-c", "write -z 33M 512k", s1});
  run_checked({"qemu-img", "create", "-q", "-f", "qcow2", "-b", "snap1.qcow2", "-F", "qcow2", s2});
  run_checked({"qemu-io", "-c", "write -P 0x31 5M 64k", "-c", "discard 0 64k", s2});
  std::cout << "base.qcow2 <- snap1.qcow2 <- snap2.qcow2\n\n== qcommit info " << s2 << "\n";
  int rc = cmd_info({s2});
  if (rc) return rc;
  std::cout << "\n== qcommit map " << s2 << "\n";
  rc = cmd_map({s2});
  if (rc) return rc;
  // Cross-check: every byte we read equals qemu-img convert's raw output.
  const std::string raw = dir + "/view.raw";
  run_checked({"qemu-img", "convert", "-O", "raw", s2, raw});
  {
    qcow2::Chain chain = qcow2::Chain::open(s2);
    auto dev = qcow2::FileDevice::open(raw);
    std::vector<uint8_t> a(1 << 20), b(1 << 20);
    for (uint64_t off = 0; off < chain.virtual_size(); off += a.size()) {
      chain.read(off, a);
      dev->read(off, b);
      if (a != b) {
        std::cout << "\nMISMATCH at offset " << off << " between qcommit and qemu-img\n";
        return kExitError;
      }
    }
  }
  std::cout << "\n== every byte read through the chain equals qemu-img convert's output\n";

  // Merge snap2 (and snap1) into base, then verify with qemu-img itself.
  std::cout << "\n== qcommit merge " << s2 << " --base " << base << "\n";
  rc = cmd_merge({s2, "--base", base, "--budget", "off"});
  if (rc) return rc;
  ProcessResult cmp = run_process({"qemu-img", "compare", "-f", "raw", "-F", "qcow2", raw, base});
  std::cout << "qemu-img compare (view before merge vs base after): " << cmp.output;
  ProcessResult chk = run_process({"qemu-img", "check", base});
  std::cout << "qemu-img check base: " << chk.output;
  if (cmp.exit_code != 0 || chk.exit_code != 0) {
    std::cout << "\nDEMO FAILED: the merged base does not match or is not clean\n";
    return kExitError;
  }
  std::cout << "\n== demo passed: base.qcow2 now shows exactly what snap2.qcow2 showed\n";
  if (keep) std::cout << "kept " << dir << "\n";
  return kExitOk;
}

}  // namespace qcommit::cli
