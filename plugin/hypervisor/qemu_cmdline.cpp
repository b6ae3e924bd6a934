// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/hypervisor/qemu_cmdline.h"

#include <fstream>
#include <iterator>

#include "plugin/host/json.h"

namespace qcommit::plugin {
namespace {

// How far the way from a disk down to its protocol node may go (format, filters): QEMU's own
// graphs are a few nodes deep; a loop in a malformed command line ends here.
constexpr int kMaxNodeDepth = 16;

// QEMU's key=value,key=value form: ",," is a comma inside a value; a first element without '='
// is the value of `implied` (when given), another one a switch set to "on".
QemuCommandLine::Options parse_keyval(const std::string& text, const char* implied) {
  std::vector<std::string> elements(1);
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != ',') {
      elements.back() += text[i];
    } else if (i + 1 < text.size() && text[i + 1] == ',') {
      elements.back() += ',';
      ++i;
    } else {
      elements.emplace_back();
    }
  }
  QemuCommandLine::Options out;
  for (std::size_t i = 0; i < elements.size(); ++i) {
    const std::string& e = elements[i];
    if (e.empty()) continue;
    const auto eq = e.find('=');
    if (eq != std::string::npos)
      out[e.substr(0, eq)] = e.substr(eq + 1);
    else if (i == 0 && implied)
      out[implied] = e;
    else
      out[e] = "on";
  }
  return out;
}

void flatten(const json::Value& v, const std::string& prefix, QemuCommandLine::Options& out) {
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else if (v.is_array()) {
    for (std::size_t i = 0; i < v.size(); ++i) flatten(v[i], prefix + "." + std::to_string(i), out);
  } else if (v.is_string()) {
    out[prefix] = v.get<std::string>();
  } else if (v.is_boolean()) {
    out[prefix] = v.get<bool>() ? "on" : "off";
  } else if (!v.is_null()) {
    out[prefix] = json::dump(v);
  }
}

// -blockdev and -device: one JSON object, or the key=value form with `implied` first.
std::optional<QemuCommandLine::Options> parse_option(const std::string& text, const char* implied) {
  if (text.empty() || text[0] != '{') return parse_keyval(text, implied);
  const std::optional<json::Value> v = json::parse(text, json::kQmpLimits, nullptr);
  if (!v || !v->is_object()) return std::nullopt;
  QemuCommandLine::Options out;
  flatten(*v, "", out);
  return out;
}

std::string member(const QemuCommandLine::Options& o, const std::string& key) {
  const auto it = o.find(key);
  return it == o.end() ? std::string() : it->second;
}

const QemuCommandLine::Options* find_by(const std::vector<QemuCommandLine::Options>& list,
                                        const char* key, const std::string& value) {
  if (value.empty()) return nullptr;
  for (const auto& o : list)
    if (member(o, key) == value) return &o;
  return nullptr;
}

bool protocol_driver(const std::string& driver) {
  return driver == "file" || driver == "host_device" || driver == "host_cdrom";
}

// The aio of the protocol node below the node whose options are those of `o` under `prefix`.
std::optional<std::string> protocol_aio(const QemuCommandLine& cl,
                                        const QemuCommandLine::Options& o,
                                        const std::string& prefix, int depth) {
  if (depth > kMaxNodeDepth) return std::nullopt;
  if (protocol_driver(member(o, prefix + "driver"))) return member(o, prefix + "aio");
  const std::string child = prefix + "file";
  if (const auto it = o.find(child); it != o.end()) {  // a node name
    const QemuCommandLine::Options* node = find_by(cl.blockdevs, "node-name", it->second);
    return node ? protocol_aio(cl, *node, "", depth + 1) : std::nullopt;
  }
  const std::string nested = child + ".";
  const auto it = o.lower_bound(nested);
  if (it != o.end() && it->first.compare(0, nested.size(), nested) == 0)
    return protocol_aio(cl, o, nested, depth + 1);
  return std::nullopt;
}

// A -drive's aio: its own key, or that of its protocol layer spelled out (file.aio=).
std::string drive_aio(const QemuCommandLine::Options& drive) {
  const std::string aio = member(drive, "aio");
  return aio.empty() ? member(drive, "file.aio") : aio;
}

// The aio of the node or -drive called `name`.
std::optional<std::string> aio_of_name(const QemuCommandLine& cl, const std::string& name) {
  if (const QemuCommandLine::Options* node = find_by(cl.blockdevs, "node-name", name))
    return protocol_aio(cl, *node, "", 0);
  if (const QemuCommandLine::Options* drive = find_by(cl.drives, "id", name))
    return drive_aio(*drive);
  return std::nullopt;
}

}  // namespace

QemuCommandLine parse_qemu_command_line(const std::vector<std::string>& argv) {
  QemuCommandLine cl;
  for (std::size_t i = 0; i + 1 < argv.size(); ++i) {
    std::string opt = argv[i];
    if (opt.rfind("--", 0) == 0) opt.erase(0, 1);  // QEMU takes --drive as -drive
    const std::string& arg = argv[i + 1];
    if (opt == "-drive") {
      cl.drives.push_back(parse_keyval(arg, nullptr));
    } else if (opt == "-blockdev") {
      if (auto o = parse_option(arg, "driver")) cl.blockdevs.push_back(std::move(*o));
    } else if (opt == "-device") {
      if (auto o = parse_option(arg, "driver")) cl.devices.push_back(std::move(*o));
    } else {
      continue;
    }
    ++i;
  }
  return cl;
}

std::vector<std::string> read_cmdline(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  std::string cur;
  for (char c : text) {
    if (c != '\0') {
      cur += c;
    } else {
      argv.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) argv.push_back(std::move(cur));
  return argv;
}

std::optional<std::string> aio_of(const QemuCommandLine& cl, const DiskNames& disk) {
  if (const QemuCommandLine::Options* drive = find_by(cl.drives, "id", disk.drive))
    return drive_aio(*drive);
  if (auto aio = aio_of_name(cl, disk.root_node)) return aio;
  if (const QemuCommandLine::Options* dev = find_by(cl.devices, "id", disk.qdev_id))
    return aio_of_name(cl, member(*dev, "drive"));
  return std::nullopt;
}

}  // namespace qcommit::plugin
