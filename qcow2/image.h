// SPDX-License-Identifier: GPL-2.0-or-later
// One qcow2 image (a single layer of a chain): header and extensions, L1/L2 lookup, refcounts,
// data and compressed-cluster reads. Metadata memory is bounded by a table cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qcow2/cache.h"
#include "qcow2/device.h"
#include "qcow2/format.h"

namespace qcommit::qcow2 {

inline constexpr size_t kDefaultCacheBytes = 16u << 20;  // L2 + refcount tables per image

struct Header {
  uint32_t version = 3;
  uint64_t backing_file_offset = 0;
  uint32_t backing_file_size = 0;
  uint32_t cluster_bits = 16;
  uint64_t size = 0;
  uint32_t crypt_method = 0;
  uint32_t l1_size = 0;
  uint64_t l1_table_offset = 0;
  uint64_t refcount_table_offset = 0;
  uint32_t refcount_table_clusters = 0;
  uint32_t nb_snapshots = 0;
  uint64_t snapshots_offset = 0;
  uint64_t incompatible_features = 0;
  uint64_t compatible_features = 0;
  uint64_t autoclear_features = 0;
  uint32_t refcount_order = 4;
  uint32_t header_length = kHeaderV2Bytes;
  CompressionType compression_type = CompressionType::kZlib;
};

struct Extension {
  uint32_t type = 0;
  std::vector<uint8_t> data;  // unpadded payload
};

struct FeatureName {
  uint8_t type = 0;  // 0 incompatible, 1 compatible, 2 autoclear
  uint8_t bit = 0;
  std::string name;
};

struct BitmapsInfo {
  uint32_t nb_bitmaps = 0;
  uint64_t directory_size = 0;
  uint64_t directory_offset = 0;
};

// A byte range of the image file that valid persistent bitmaps keep in use.
struct BitmapExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
  const char* what = "";  // "bitmap directory", "bitmap table" or "bitmap data"
};
using BitmapExtentVisitor = std::function<void(const BitmapExtent&)>;

// What one guest subcluster maps to (QEMU's QCow2SubclusterType, from the spec).
enum class SubclusterType : uint8_t {
  kUnallocatedPlain,  // read from the backing file (or zeros)
  kUnallocatedAlloc,  // extended L2: cluster allocated, this subcluster not: backing
  kZeroPlain,         // reads as zeros, no host cluster
  kZeroAlloc,         // reads as zeros, host cluster preallocated
  kNormal,            // data at host_offset
  kCompressed,        // compressed cluster
};

[[nodiscard]] const char* to_string(SubclusterType t);

// A run of guest bytes with one type and (where there is one) contiguous host offsets.
struct Run {
  uint64_t guest_offset = 0;
  uint64_t length = 0;
  SubclusterType type = SubclusterType::kUnallocatedPlain;
  uint64_t host_offset = 0;  // of guest_offset, in the data file (normal/zero_alloc/unalloc_alloc)
  uint64_t compressed_offset = 0;  // compressed: host byte offset of the compressed stream
  uint64_t compressed_size = 0;    // compressed: bytes the descriptor covers
};

struct ImageOptions {
  bool writable = false;
  size_t cache_bytes = kDefaultCacheBytes;
};

class Image {
 public:
  // Parses and validates the header; throws Error/CorruptionError/UnsupportedError naming the file.
  static std::unique_ptr<Image> open(std::unique_ptr<BlockDevice> file, ImageOptions options = {});
  ~Image();
  Image(const Image&) = delete;
  Image& operator=(const Image&) = delete;

  [[nodiscard]] const std::string& name() const { return file_->name(); }
  [[nodiscard]] const Header& header() const { return header_; }
  [[nodiscard]] const Geometry& geometry() const { return geo_; }
  [[nodiscard]] uint64_t virtual_size() const { return header_.size; }
  [[nodiscard]] uint64_t cluster_size() const { return geo_.cluster_size(); }
  [[nodiscard]] const std::optional<std::string>& backing_name() const { return backing_name_; }
  [[nodiscard]] const std::optional<std::string>& backing_format() const { return backing_format_; }
  [[nodiscard]] const std::optional<std::string>& data_file_name() const { return data_file_name_; }
  [[nodiscard]] const std::vector<Extension>& extensions() const { return extensions_; }
  [[nodiscard]] const std::vector<FeatureName>& feature_names() const { return feature_names_; }
  // Persistent bitmaps, valid only while the autoclear bitmaps bit is set: a program without
  // bitmap support clears that bit when it writes the image (spec, "Bitmaps extension"), and the
  // extension it leaves behind describes nothing. Such a stale extension is not in bitmaps() and
  // not in extensions(): its clusters are not in use (check counts them as leaks, repair frees
  // them), no writer frees or follows them, and every header rewrite drops it, as QEMU does when
  // it opens the image for writing.
  [[nodiscard]] const std::optional<BitmapsInfo>& bitmaps() const { return bitmaps_; }
  [[nodiscard]] const std::optional<BitmapsInfo>& stale_bitmaps() const { return stale_bitmaps_; }

  // Calls `visit` for every range the valid bitmaps keep in use (directory, tables, data
  // clusters); nothing when there are none or they are stale. Returns the first inconsistency
  // found, if any: the ranges visited until then are all that can be known to be in use. This is
  // the one definition of what bitmaps use, shared by the consistency check and the writer.
  [[nodiscard]] std::optional<std::string> visit_bitmap_extents(const BitmapExtentVisitor& visit);
  [[nodiscard]] bool has_data_file() const {
    return header_.incompatible_features & kIncompatDataFile;
  }
  [[nodiscard]] bool dirty() const { return header_.incompatible_features & kIncompatDirty; }
  [[nodiscard]] bool corrupt() const { return header_.incompatible_features & kIncompatCorrupt; }
  [[nodiscard]] const std::vector<uint64_t>& l1_table() const { return l1_; }
  [[nodiscard]] const std::vector<uint64_t>& refcount_table() const { return reftable_; }

  // The external data file; required before data can be read when has_data_file().
  void attach_data_file(std::unique_ptr<BlockDevice> data);
  [[nodiscard]] BlockDevice& file() { return *file_; }
  [[nodiscard]] const BlockDevice& file() const { return *file_; }
  [[nodiscard]] BlockDevice& data_device() { return data_ ? *data_ : *file_; }

  // The run of guest bytes starting at guest_offset (at most max_len, never crossing the end of
  // one L2 table) that share one subcluster type and contiguous host offsets.
  [[nodiscard]] Run lookup(uint64_t guest_offset, uint64_t max_len);

  // Reads guest bytes [guest_offset, guest_offset + out.size()) that lie inside `run`, which must
  // be of type kNormal or kCompressed.
  void read_run(const Run& run, uint64_t guest_offset, std::span<uint8_t> out);

  // Decompresses the compressed cluster described by `run` into out (cluster_size bytes).
  void decompress(const Run& run, std::span<uint8_t> out);

  [[nodiscard]] uint64_t refcount(uint64_t cluster_index);

  // QEMU's heuristic for preallocation=metadata images (more clusters referenced than the file
  // has allocated): then qemu-img map asks the file which data clusters are holes.
  [[nodiscard]] bool metadata_preallocated();

  // Reads one L2 table (validated offset) through the cache.
  [[nodiscard]] std::shared_ptr<const std::vector<uint8_t>> l2_table(uint64_t l2_offset,
                                                                     uint64_t l1_index);

 private:
  friend class Writer;         // qcow2/writer.h: allocation and metadata updates
  friend class Checker;        // qcow2/check.cpp: consistency check, repair plan
  friend class RepairApplier;  // qcow2/check_apply.cpp: writes a repair plan
  Image(std::unique_ptr<BlockDevice> file, ImageOptions options);
  // Header parsing (parse_header), step by step; each step's contract is at its definition.
  void parse_header();
  void read_fixed_fields(uint64_t file_size);
  void check_version3_fields(uint64_t file_size) const;
  void read_compression_type();
  void read_extension_area(uint64_t file_size);
  void parse_extensions(uint64_t start, uint64_t end);
  void check_features() const;
  void read_backing_name(uint64_t file_size);
  void check_table_locations(uint64_t file_size) const;
  void load_tables();
  // A refcount block as the refcount table points at it.
  struct RefcountBlock {
    uint64_t offset = 0;      // host offset of the block; 0 when the table has none there
    TableCache::Table table;  // its cluster_size() bytes, through the cache; null when none
  };
  // The one loader of refcount blocks, for refcount(), the writer's updates and the check's
  // repairs: block `block_index` of the refcount table, read through the cache. No block (an
  // index past the table, or an entry of 0): offset 0 and no table, and every cluster it would
  // describe has refcount 0. Throws CorruptionError when the block is not cluster aligned, or
  // when it is not in the cache and does not lie wholly inside the file (a block a writer has
  // just allocated lives in the cache until it is written).
  [[nodiscard]] RefcountBlock refcount_block(uint64_t block_index);
  [[noreturn]] void corrupt_at(const std::string& what) const;
  // The first cluster as a header rewrite stores it: `h`, the bytes past the known fields as on
  // disk, the extensions() (a stale bitmaps extension is not among them) and the backing name.
  [[nodiscard]] std::vector<uint8_t> encode_header(const Header& h);
  struct Entry {
    SubclusterType type;
    uint64_t cluster_host;  // host offset of the cluster (normal/zero_alloc/unalloc_alloc)
    uint64_t coffset = 0, csize = 0;
  };
  [[nodiscard]] Entry decode(const std::vector<uint8_t>& l2, uint64_t l2_offset, uint64_t index,
                             uint32_t sub) const;

  std::unique_ptr<BlockDevice> file_;
  std::unique_ptr<BlockDevice> data_;
  ImageOptions options_;
  Header header_;
  Geometry geo_;
  std::optional<std::string> backing_name_;
  std::optional<std::string> backing_format_;
  std::optional<std::string> data_file_name_;
  std::vector<Extension> extensions_;
  std::vector<FeatureName> feature_names_;
  std::optional<BitmapsInfo> bitmaps_;
  std::optional<BitmapsInfo> stale_bitmaps_;
  std::vector<uint64_t> l1_;
  std::vector<uint64_t> reftable_;
  TableCache cache_;
  std::optional<bool> metadata_prealloc_;
  uint64_t decompressed_key_ = ~0ull;
  std::vector<uint8_t> decompressed_;
};

// A range of guest bytes.
struct GuestExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The guest ranges the image has contents of its own for (data, zeros, compressed: what does not
// read from the backing file), ascending and merged.  A commit of the image copies these; QEMU
// skips the rest without writing.  Reads every L2 table the L1 table names.
[[nodiscard]] std::vector<GuestExtent> own_extents(Image& img);

}  // namespace qcommit::qcow2
