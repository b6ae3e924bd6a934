// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit map: which layer provides each byte, with qemu-img map's JSON keys.
#include <cinttypes>
#include <cstdio>

#include "cli/json.h"
#include "cli/options.h"
#include "qcow2/chain.h"

namespace qcommit::cli {

namespace {

// One entry with qemu-img map's keys; "offset" only where the data is in the image file.
json::Ordered entry_json(const qcow2::MapEntry& e) {
  json::Ordered j{{"start", e.start},     {"length", e.length}, {"depth", e.depth},
                  {"present", e.present}, {"zero", e.zero},     {"data", e.data}};
  if (e.offset) j["offset"] = *e.offset;
  return j;
}

// qemu-img map --output=json opens each entry with "{ ".
std::string qemu_img_layout(const std::string& entry) {
  return "{ " + entry.substr(1);
}

}  // namespace

int cmd_map(const Args& args) {
  const auto cmd = parse_chain_command(
      args,
      {.output_help = "human or json (same entries as qemu-img map --output=json)",
       .synopsis = "qcommit map IMAGE [--output=json]",
       .examples =
           "examples:\n  qcommit map vm.qcow2\n  qcommit map --output=json vm.qcow2 | jq .\n"});
  if (!cmd) return kExitOk;
  qcow2::Chain chain = qcow2::Chain::open(cmd->image, cmd->chain);
  auto entries = chain.map();
  std::string buf;
  buf.reserve(entries.size() * 120);
  char line[320];
  if (cmd->output == Output::kJson) {
    buf += "[";
    for (size_t i = 0; i < entries.size(); ++i) {
      if (i) buf += ",\n";
      buf += qemu_img_layout(json::dump_spaced(entry_json(entries[i])));
    }
    buf += "]\n";
  } else {
    int n = std::snprintf(line, sizeof line, "%-20s%-20s%-7s%-10s%-20s%s\n", "Offset", "Length",
                          "Depth", "Kind", "Mapped to", "File");
    buf.append(line, size_t(n));
    for (const auto& e : entries) {
      const char* kind = e.data ? (e.compressed ? "compressed" : (e.zero ? "data/zero" : "data"))
                                : (e.zero ? (e.present ? "zero" : "hole") : "backing");
      std::string mapped = e.offset ? "0x" +
                                          [&] {
                                            char h[24];
                                            std::snprintf(h, sizeof h, "%" PRIx64, *e.offset);
                                            return std::string(h);
                                          }()
                                    : "-";
      const auto& L = chain.layer(e.depth);
      std::string file =
          e.offset && L.qcow2 && L.qcow2->has_data_file() ? L.qcow2->data_device().name() : L.path;
      n = std::snprintf(line, sizeof line, "0x%-18" PRIx64 "0x%-18" PRIx64 "%-7u%-10s%-20s%s\n",
                        e.start, e.length, e.depth, kind, mapped.c_str(),
                        e.present ? file.c_str() : "-");
      buf.append(line, size_t(n));
    }
  }
  std::fwrite(buf.data(), 1, buf.size(), stdout);
  return kExitOk;
}

}  // namespace qcommit::cli
