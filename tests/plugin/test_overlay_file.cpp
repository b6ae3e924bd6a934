// SPDX-License-Identifier: GPL-2.0-or-later
// The fresh overlay of a two-phase live merge, made by qemu-img (which CI installs).
#include <doctest/doctest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "plugin/hypervisor/overlay_file.h"
#include "plugin/host/process.h"

using qcommit::plugin::create_fresh_overlay;
using qcommit::plugin::ProcessResult;
using qcommit::plugin::run_process;

TEST_CASE("plugin.overlay.fresh_overlay") {
  char tmpl[] = "/tmp/qcommit-overlay-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  const std::string base = dir + "/vm.qcow2", overlay = dir + "/vm.fresh.qcow2";
  REQUIRE(run_process({"qemu-img", "create", "-q", "-f", "qcow2", base, "64M"}).exit_code == 0);

  CHECK(create_fresh_overlay(overlay, base, "qcow2", 64ull << 20) == "");
  const ProcessResult info_run = run_process({"qemu-img", "info", "--output=json", overlay});
  REQUIRE(info_run.exit_code == 0);
  const std::string& info = info_run.output;
  CHECK(info.find("\"lazy-refcounts\": true") != std::string::npos);
  CHECK(info.find("\"backing-filename\": \"" + base + "\"") != std::string::npos);
  CHECK(info.find("\"backing-filename-format\": \"qcow2\"") != std::string::npos);
  CHECK(info.find("\"virtual-size\": 67108864") != std::string::npos);
  CHECK(run_process({"qemu-img", "check", "-q", overlay}).exit_code == 0);  // clean

  // qemu-img's complaint comes back and nothing is left behind.
  const std::string bad = dir + "/bad.qcow2";
  const std::string err = create_fresh_overlay(bad, base, "no-such-format", 64ull << 20);
  CHECK(err.find("no-such-format") != std::string::npos);
  struct stat sb{};
  CHECK(::lstat(bad.c_str(), &sb) != 0);

  std::filesystem::remove_all(dir);
}
