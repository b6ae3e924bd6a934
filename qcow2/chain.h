// SPDX-License-Identifier: GPL-2.0-or-later
// A backing chain: the top image and every image below it (qcow2 or raw), with block status and
// reads through the whole chain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qcow2/device.h"
#include "qcow2/image.h"

namespace qcommit::qcow2 {

inline constexpr size_t kMaxChainDepth = 256;

enum class Format { kQcow2, kRaw };
[[nodiscard]] const char* to_string(Format f);

// One layer of a chain.
struct Layer {
  // As QEMU names it (its "filename" in `qemu-img info --backing-chain`): the top as given, a
  // backing file as resolve_backing() joins it. Not normalised: the kernel resolves it on open.
  std::string path;
  // Where the kernel's resolution of `path` led when it was opened (absolute, no symlinks).
  std::string real_path;
  FileId id;                 // of the file opened
  std::string backing_name;  // as written in the image above (empty for the top)
  Format format = Format::kQcow2;
  std::unique_ptr<Image> qcow2;       // when format == kQcow2
  std::unique_ptr<BlockDevice> raw;   // when format == kRaw
  [[nodiscard]] uint64_t virtual_size() const;
  [[nodiscard]] const std::string& name() const { return path; }
};

// Where the bytes of one guest range come from, with QEMU's block-status attributes
// (as `qemu-img map --output=json` prints them).
struct MapEntry {
  uint64_t start = 0;
  uint64_t length = 0;
  uint32_t depth = 0;
  bool present = false;
  bool zero = false;
  bool data = false;
  std::optional<uint64_t> offset;
  // Extra detail, not in qemu-img's output:
  bool compressed = false;
};

struct ChainOptions {
  bool writable_top = false;
  // Open the layer at this depth writable (the base of a merge).
  std::optional<size_t> writable_depth;
  // Backing and data files must resolve inside one of these directory trees (empty: no
  // restriction). The check is made on the kernel's resolution of the name (a symlink inside an
  // allowed tree pointing out of it is outside), before the file is opened for I/O.
  std::vector<std::string> allowed_backing_dirs;
  size_t cache_bytes = kDefaultCacheBytes;
  size_t max_depth = kMaxChainDepth;
  // Asked when a backing or external data file does not exist (ENOENT), with the path looked up:
  // true once it may be there (it is looked up again), false to fail as without it. Empty: fail.
  std::function<bool(const std::string& path)> await_missing;
  // A backing file that does not exist ends the chain there instead of failing the open (what
  // `qcommit info` shows); Chain::missing_backing() names it. The chain then must not be read.
  bool stop_at_missing_backing = false;
};

// The backing file a chain opened with stop_at_missing_backing lacks.
struct MissingBacking {
  std::string named_by;  // the image that names it (the chain's last layer)
  std::string name;      // as that image names it
  std::string path;      // where it was looked up
};

// Probes a file's format: qcow2 by magic, otherwise raw.
[[nodiscard]] Format probe_format(BlockDevice& dev);

// The path QEMU opens for a backing file name (its full backing filename): an absolute name as
// is; a relative name appended to `image_path` up to and including its last '/' (nothing when
// it has none), textually, without normalising: "link/../b" below "d/top" is "d/link/../b", which
// the kernel resolves through the symlink. A "file:" prefix is dropped and the rest used as is
// (QEMU's file protocol opens it relative to the working directory). Refuses json: and other
// protocol names.
[[nodiscard]] std::string resolve_backing(const std::string& image_path, const std::string& name);

// Whether `real_path` (a kernel-resolved absolute path) lies inside one of the directory trees
// `dirs`, each resolved by the kernel too (a directory that does not exist contains nothing).
[[nodiscard]] bool inside_dirs(const std::string& real_path, const std::vector<std::string>& dirs);

class Chain {
 public:
  // Opens `path` and its whole backing chain. `format` forces the top format (else probed).
  static Chain open(const std::string& path, ChainOptions options = {},
                    std::optional<Format> format = std::nullopt);
  Chain(Chain&&) = default;
  Chain& operator=(Chain&&) = default;

  [[nodiscard]] size_t depth() const { return layers_.size(); }
  [[nodiscard]] Layer& layer(size_t i) { return *layers_.at(i); }
  [[nodiscard]] const Layer& layer(size_t i) const { return *layers_.at(i); }
  [[nodiscard]] Layer& top() { return *layers_.front(); }
  [[nodiscard]] uint64_t virtual_size() const { return layers_.front()->virtual_size(); }
  // Set when the chain was opened with stop_at_missing_backing and ends at a missing file.
  [[nodiscard]] const std::optional<MissingBacking>& missing_backing() const { return missing_; }

  // Block status of [offset, offset+len) as one entry (the first run), looking through layers
  // from `from_depth` down. Mirrors QEMU's bdrv_block_status + qemu-img map's depth loop.
  // With stop_depth, layers from stop_depth down are not consulted: a range none of the layers
  // above provides comes back with depth == stop_depth and present/zero/data all false.
  [[nodiscard]] MapEntry status(uint64_t offset, uint64_t len, size_t from_depth = 0,
                                std::optional<size_t> stop_depth = std::nullopt);

  // The whole map, adjacent entries with equal attributes (and contiguous offsets) merged,
  // exactly like `qemu-img map`.
  [[nodiscard]] std::vector<MapEntry> map(uint64_t offset = 0,
                                          std::optional<uint64_t> len = std::nullopt);

  // Reads guest bytes through the chain, starting at layer `from_depth`.
  void read(uint64_t offset, std::span<uint8_t> out, size_t from_depth = 0);

 private:
  Chain() = default;
  struct LayerStatus {
    uint64_t length = 0;
    bool data = false, zero = false, allocated = false, compressed = false;
    std::optional<uint64_t> offset;
  };
  [[nodiscard]] LayerStatus layer_status(size_t i, uint64_t offset, uint64_t len);
  std::vector<std::unique_ptr<Layer>> layers_;
  std::optional<MissingBacking> missing_;
};

// Merges adjacent entries the way qemu-img map does.
[[nodiscard]] bool mergeable(const MapEntry& a, const MapEntry& b);

}  // namespace qcommit::qcow2
