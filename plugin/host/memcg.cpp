// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/host/memcg.h"

#include <fstream>
#include <sstream>
#include <string_view>
#include <system_error>

namespace qcommit::plugin {

namespace {

struct StatKeys {
  std::string_view dirty;
  std::string_view writeback;
};

// In order of preference: v1 hierarchical, v2, v1 local.
constexpr StatKeys kStatKeys[] = {
    {"total_dirty", "total_writeback"},
    {"file_dirty", "file_writeback"},
    {"dirty", "writeback"},
};

// One line of /proc/PID/cgroup: "hierarchy-ID:controller-list:path".
struct CgroupLine {
  std::string controllers;
  std::string path;
};

std::optional<CgroupLine> parse_cgroup_line(const std::string& line) {
  const auto a = line.find(':');
  if (a == std::string::npos) return std::nullopt;
  const auto b = line.find(':', a + 1);
  if (b == std::string::npos) return std::nullopt;
  return CgroupLine{line.substr(a + 1, b - a - 1), line.substr(b + 1)};
}

bool lists_memory(const std::string& controllers) {
  std::istringstream is(controllers);
  std::string c;
  while (std::getline(is, c, ','))
    if (c == "memory") return true;
  return false;
}

bool has_memory_stat(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / "memory.stat", ec);
}

// From hierarchy_root/group up to hierarchy_root, the first directory with memory.stat.
std::optional<std::filesystem::path> nearest_with_stat(const std::filesystem::path& hierarchy_root,
                                                       const std::string& group) {
  std::filesystem::path rel = std::filesystem::path(group).relative_path().lexically_normal();
  for (;;) {
    const std::filesystem::path dir = rel.empty() ? hierarchy_root : hierarchy_root / rel;
    if (has_memory_stat(dir)) return dir;
    if (rel.empty()) return std::nullopt;
    const std::filesystem::path up = rel.parent_path();
    if (up == rel) return std::nullopt;
    rel = up;
  }
}

}  // namespace

std::optional<MemcgPageCache> parse_memory_stat(const std::string& text) {
  constexpr std::size_t kKeyPairs = std::size(kStatKeys);
  std::optional<std::uint64_t> dirty[kKeyPairs], writeback[kKeyPairs];
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string key;
    std::uint64_t value = 0;
    if (!(ls >> key >> value)) continue;
    for (std::size_t i = 0; i < kKeyPairs; ++i) {
      if (key == kStatKeys[i].dirty) dirty[i] = value;
      if (key == kStatKeys[i].writeback) writeback[i] = value;
    }
  }
  for (std::size_t i = 0; i < kKeyPairs; ++i)
    if (dirty[i] && writeback[i]) return MemcgPageCache{*dirty[i], *writeback[i]};
  return std::nullopt;
}

std::optional<std::filesystem::path> memcg_dir(const std::string& proc_cgroup_text,
                                               const std::filesystem::path& cgroup_root) {
  std::optional<std::string> v1_group, v2_group;
  std::istringstream is(proc_cgroup_text);
  std::string line;
  while (std::getline(is, line)) {
    const std::optional<CgroupLine> l = parse_cgroup_line(line);
    if (!l) continue;
    if (l->controllers.empty())
      v2_group = l->path;
    else if (lists_memory(l->controllers))
      v1_group = l->path;
  }
  if (v1_group) return nearest_with_stat(cgroup_root / "memory", *v1_group);
  if (!v2_group) return std::nullopt;
  if (auto d = nearest_with_stat(cgroup_root / "unified", *v2_group)) return d;
  return nearest_with_stat(cgroup_root, *v2_group);
}

std::optional<std::filesystem::path> memcg_dir_of(pid_t pid, const std::filesystem::path& proc_root,
                                                  const std::filesystem::path& cgroup_root) {
  std::ifstream f(proc_root / std::to_string(pid) / "cgroup");
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  return memcg_dir(ss.str(), cgroup_root);
}

std::optional<MemcgPageCache> read_memcg_page_cache(const std::filesystem::path& dir) {
  std::ifstream f(dir / "memory.stat");
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_memory_stat(ss.str());
}

}  // namespace qcommit::plugin
