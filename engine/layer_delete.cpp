// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/layer_delete.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace qcommit::engine {

namespace fs = std::filesystem;

std::optional<uint64_t> first_view_difference(qcow2::Chain& chain, size_t base_depth,
                                              const std::vector<qcow2::MapEntry>& extents,
                                              const std::function<void(uint64_t, uint64_t)>& prefetch) {
  std::vector<uint8_t> top_view, base_view;
  // The chunks in order, each prefetched while the one before it is read and compared.
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (const qcow2::MapEntry& e : extents)
    for (uint64_t off = e.start, end = e.start + e.length; off < end; off += kViewCompareChunkBytes)
      chunks.emplace_back(off, std::min(kViewCompareChunkBytes, end - off));
  if (prefetch && !chunks.empty()) prefetch(chunks[0].first, chunks[0].second);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto [off, n] = chunks[i];
    if (prefetch && i + 1 < chunks.size()) prefetch(chunks[i + 1].first, chunks[i + 1].second);
    top_view.resize(n);
    base_view.resize(n);
    chain.read(off, top_view, 0);
    chain.read(off, base_view, base_depth);
    if (std::memcmp(top_view.data(), base_view.data(), n) == 0) continue;
    const auto [t, b] = std::mismatch(top_view.begin(), top_view.end(), base_view.begin());
    return off + uint64_t(t - top_view.begin());
  }
  return std::nullopt;
}

std::vector<std::string> names_to_delete(const std::string& path, const std::string& real_path) {
  const std::string named = fs::absolute(path).string();  // not normalised: "link/.." is the kernel's
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode) && !real_path.empty() && real_path != named)
    return {named, real_path};
  return {named};
}

void unlink_names(const std::vector<std::string>& names, std::vector<std::string>& deleted,
                  std::vector<NotDeleted>& not_deleted,
                  const std::function<void(std::string_view)>& before_each) {
  for (const std::string& p : names) {
    if (before_each) before_each("delete");
    if (::unlink(p.c_str()) == 0)
      deleted.push_back(p);
    else if (errno != ENOENT)
      not_deleted.push_back({p, std::strerror(errno)});
  }
}

}  // namespace qcommit::engine
