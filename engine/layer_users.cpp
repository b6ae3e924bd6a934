// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/layer_users.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "qcow2/chain.h"
#include "qcow2/error.h"
#include "qcow2/format.h"
#include "common/unique_fd.h"

namespace qcommit::engine {

namespace fs = std::filesystem;

namespace {

// A file as the kernel knows it: a block device by its device number (two nodes of one LV are
// one device), anything else by device and inode.
struct FileKey {
  bool block = false;
  dev_t dev = 0;
  ino_t ino = 0;
  auto operator<=>(const FileKey&) const = default;
};

std::optional<FileKey> key_of(const struct stat& st) {
  if (S_ISBLK(st.st_mode)) return FileKey{true, st.st_rdev, 0};
  return FileKey{false, st.st_dev, st.st_ino};
}

std::optional<FileKey> key_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return key_of(st);
}

// The query's files by key: which layer each merged file is, which files are no users.
struct Known {
  std::vector<std::pair<FileKey, std::string>> layers;
  std::set<FileKey> ignore;

  explicit Known(const LayerUserQuery& q) {
    for (const auto& l : q.layers)
      if (auto k = key_of(l)) layers.emplace_back(*k, l);
    for (const auto& i : q.ignore)
      if (auto k = key_of(i)) ignore.insert(*k);
  }
  [[nodiscard]] const std::string* layer(const FileKey& k) const {
    for (const auto& [key, path] : layers)
      if (key == k) return &path;
    return nullptr;
  }
};

// The backing file name in a qcow2 image's header, read from a regular file only (a FIFO would
// block, a device would be read): nullopt when `path` is no such image or names none.
std::optional<std::string> backing_name_of(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  qcow2::RawHeader h {};
  if (::pread(fd.get(), &h, sizeof h, 0) < ssize_t(qcow2::kHeaderV2Bytes)) return std::nullopt;
  if (h.magic.value() != qcow2::kMagic) return std::nullopt;
  const uint64_t offset = h.backing_file_offset.value();
  const uint32_t size = h.backing_file_size.value();
  if (offset == 0 || size == 0 || size > qcow2::kMaxBackingNameBytes) return std::nullopt;
  std::string name(size, '\0');
  if (::pread(fd.get(), name.data(), size, off_t(offset)) != ssize_t(size)) return std::nullopt;
  return name;
}

// Follows `image`'s chain by headers from its backing file on.
std::optional<std::string> layer_below(const std::string& image, const Known& known) {
  std::string current = image;
  for (size_t depth = 0; depth < qcow2::kMaxChainDepth; ++depth) {
    const std::optional<std::string> name = backing_name_of(current);
    if (!name) return std::nullopt;
    std::string next;
    try {
      next = qcow2::resolve_backing(current, *name);
    } catch (const qcow2::Error&) {
      return std::nullopt;  // not a local file: not one of ours
    }
    struct stat st {};
    if (::stat(next.c_str(), &st) != 0) return std::nullopt;
    const FileKey k = *key_of(st);
    if (const std::string* layer = known.layer(k)) return *layer;
    if (known.ignore.count(k) || !S_ISREG(st.st_mode)) return std::nullopt;
    current = next;
  }
  return std::nullopt;
}

std::optional<std::string> layer_reached(const std::string& image, const Known& known) {
  const auto k = key_of(image);
  if (!k) return std::nullopt;
  if (const std::string* layer = known.layer(*k)) return *layer;
  if (known.ignore.count(*k)) return std::nullopt;
  return layer_below(image, known);
}

void add_unique(std::vector<LayerUser>& out, LayerUser u) {
  for (const LayerUser& o : out)
    if (o.user == u.user) return;
  out.push_back(std::move(u));
}

}  // namespace

std::optional<std::string> layer_reached_from(const std::string& image, const LayerUserQuery& q) {
  return layer_reached(image, Known(q));
}

std::vector<LayerUser> image_users_in(const std::vector<std::string>& dirs, const LayerUserQuery& q) {
  const Known known(q);
  std::vector<LayerUser> out;
  std::set<FileKey> seen_dirs;
  for (const auto& dir : dirs) {
    const auto dk = key_of(dir);
    if (!dk || !seen_dirs.insert(*dk).second) continue;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string path = it->path().string();
      struct stat st {};
      // Only regular files are opened; a layer or an ignored image is no user of itself.
      if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      const FileKey k = *key_of(st);
      if (known.layer(k) || known.ignore.count(k)) continue;
      if (auto layer = layer_below(path, known))
        add_unique(out, {*layer, "image " + path + " (backed by " + *layer + ")"});
    }
  }
  return out;
}

std::vector<LayerUser> find_layer_users(const LayerUserQuery& q, const FindLayerUsers& more) {
  std::vector<std::string> dirs;
  for (const auto& l : q.layers) {
    const std::string parent = fs::absolute(l).parent_path().string();
    dirs.push_back(parent.empty() ? "." : parent);
  }
  std::vector<LayerUser> out = image_users_in(dirs, q);
  if (more)
    for (LayerUser& u : more(q)) add_unique(out, std::move(u));
  return out;
}

std::string describe_users(const std::vector<LayerUser>& users) {
  std::string s;
  for (const LayerUser& u : users) s += (s.empty() ? "" : ", ") + u.user;
  return s;
}

}  // namespace qcommit::engine
