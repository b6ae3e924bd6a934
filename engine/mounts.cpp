// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/mounts.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace qcommit::engine {

namespace {

// A mountinfo field with its octal escapes (\040 for a space) undone.
std::string unescape_mount_field(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const std::string oct = s[i] == '\\' ? s.substr(i + 1, 3) : "";
    if (oct.size() == 3 && oct.find_first_not_of("01234567") == std::string::npos) {
      out += static_cast<char>(std::stoi(oct, nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

bool lies_under(const std::string& path, const std::string& point) {
  return point == "/" || path == point || path.rfind(point + "/", 0) == 0;
}

// The value of `key=` in a comma-separated option list ("" when absent). overlayfs escapes a
// comma in a path as "\,"; such paths are not supported here (the lookup then finds nothing).
std::string option_value(const std::string& options, std::string_view key) {
  std::istringstream in(options);
  std::string opt;
  while (std::getline(in, opt, ','))
    if (opt.size() > key.size() && opt.compare(0, key.size(), key) == 0 && opt[key.size()] == '=')
      return opt.substr(key.size() + 1);
  return "";
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

}  // namespace

std::optional<MountEntry> parse_mountinfo_line(const std::string& line) {
  std::istringstream fields(line);
  std::string id, parent, devno, root, point, field;
  if (!(fields >> id >> parent >> devno >> root >> point)) return std::nullopt;
  while (fields >> field && field != "-") {
  }
  MountEntry m;
  unsigned maj = 0, min = 0;
  if (std::sscanf(devno.c_str(), "%u:%u", &maj, &min) != 2) return std::nullopt;
  m.dev = makedev(maj, min);
  m.root = unescape_mount_field(root);
  m.point = unescape_mount_field(point);
  std::string source, options;
  if (!(fields >> m.type)) return std::nullopt;
  fields >> source >> options;
  m.source = unescape_mount_field(source);
  m.super_options = unescape_mount_field(options);
  return m;
}

std::vector<MountEntry> read_mounts() {
  std::vector<MountEntry> mounts;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line))
    if (auto m = parse_mountinfo_line(line)) mounts.push_back(std::move(*m));
  return mounts;
}

std::optional<MountEntry> mount_of(dev_t dev, const std::string& path,
                                   const std::vector<MountEntry>& mounts) {
  std::optional<MountEntry> found;
  bool found_under = false;
  for (const MountEntry& m : mounts) {
    if (m.dev != dev) continue;
    const bool under = lies_under(path, m.point);
    if (!found || (under && (!found_under || m.point.size() > found->point.size()))) {
      found = m;
      found_under = under;
    }
  }
  return found;
}

std::optional<MountEntry> mount_containing(const std::string& path,
                                           const std::vector<MountEntry>& mounts) {
  std::optional<MountEntry> found;
  for (const MountEntry& m : mounts)
    if (lies_under(path, m.point) && (!found || m.point.size() >= found->point.size())) found = m;
  return found;
}

std::optional<std::string> stacked_lower_path(const std::string& real_path,
                                              const std::vector<MountEntry>& mounts) {
  const std::optional<MountEntry> m = mount_containing(real_path, mounts);
  if (!m) return std::nullopt;
  const std::string rel = m->point == "/" ? real_path : real_path.substr(m->point.size());
  if (m->type == "overlay") {
    const std::string upper = option_value(m->super_options, "upperdir");
    if (!upper.empty() && exists(upper + rel)) return upper + rel;
    std::istringstream lowers(option_value(m->super_options, "lowerdir"));
    std::string lower;
    while (std::getline(lowers, lower, ':'))
      if (!lower.empty() && exists(lower + rel)) return lower + rel;
    return std::nullopt;
  }
  if (m->type == "ecryptfs" && !m->source.empty() && m->source[0] == '/') return m->source + rel;
  return std::nullopt;
}

}  // namespace qcommit::engine
