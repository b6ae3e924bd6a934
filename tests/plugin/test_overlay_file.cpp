// The fresh overlay of a two-phase live merge, made by qemu-img (which CI installs).
#include <doctest/doctest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "plugin/overlay_file.h"

using qcommit::plugin::create_fresh_overlay;

namespace {

std::string run(const std::string& cmd) {
  std::string out;
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen(cmd.c_str(), "r"), ::pclose);
  REQUIRE(p);
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p.get())) > 0) out.append(buf.data(), n);
  return out;
}

}  // namespace

TEST_CASE("plugin.overlay.fresh_overlay") {
  char tmpl[] = "/tmp/qcommit-overlay-XXXXXX";
  REQUIRE(::mkdtemp(tmpl));
  const std::string dir = tmpl;
  const std::string base = dir + "/vm.qcow2", overlay = dir + "/vm.fresh.qcow2";
  REQUIRE(run("qemu-img create -q -f qcow2 " + base + " 64M && echo ok") == "ok\n");

  CHECK(create_fresh_overlay(overlay, base, "qcow2", 64ull << 20) == "");
  const std::string info = run("qemu-img info --output=json " + overlay);
  CHECK(info.find("\"lazy-refcounts\": true") != std::string::npos);
  CHECK(info.find("\"backing-filename\": \"" + base + "\"") != std::string::npos);
  CHECK(info.find("\"backing-filename-format\": \"qcow2\"") != std::string::npos);
  CHECK(info.find("\"virtual-size\": 67108864") != std::string::npos);
  CHECK(run("qemu-img check -q " + overlay + " && echo clean") == "clean\n");

  // qemu-img's complaint comes back and nothing is left behind.
  const std::string bad = dir + "/bad.qcow2";
  const std::string err = create_fresh_overlay(bad, base, "no-such-format", 64ull << 20);
  CHECK(err.find("no-such-format") != std::string::npos);
  struct stat sb{};
  CHECK(::lstat(bad.c_str(), &sb) != 0);

  std::filesystem::remove_all(dir);
}
