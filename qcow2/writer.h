// SPDX-License-Identifier: GPL-2.0-or-later
// Writing one qcow2 image: cluster allocation from refcounts, L2 allocation and copy-on-write,
// refcount block and table growth, zero flags, L1 growth, header rewrite.
//
// Crash consistency without a journal. Changes are staged in memory (dirty, pinned tables) and
// made durable by commit(), always in this order:
//
//   data → flush → refcount increments (blocks, then table entries / relocated table + header)
//        → flush → L2 tables → flush → L1 → (flush, when both change) header → flush
//        → refcount decrements → flush
//
// After a crash at any point the image may leak clusters (refcount > references) but never
// points at unwritten data or at a cluster that is used twice. Callers batch many clusters per
// commit so metadata is flushed per window, not per cluster.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "qcow2/image.h"

namespace qcommit::qcow2 {

// Reads the image's current guest view (its own layer plus its backing chain) for filling the
// untouched part of a cluster that a partial write allocates.
using ViewReader = std::function<void(uint64_t guest_offset, std::span<uint8_t> out)>;

// Named points of the persistence order, for fault injection and crash tests.
enum class WritePoint : uint8_t {
  kDataFlush,
  kRefcountBlocks,
  kRefcountTable,
  kHeaderForRefcountTable,
  kL2Tables,
  kL1Table,
  kHeader,
  kRefcountDecrements,
};
[[nodiscard]] const char* to_string(WritePoint p);

class Writer {
 public:
  // The image must be opened writable. Refuses images marked corrupt and images left dirty by
  // lazy refcounts (repair them first with check --repair).
  explicit Writer(Image& image);

  // Why a Writer would refuse `image` whatever is written (marked corrupt, an external data
  // file), without opening one: callers that must refuse before their first write ask first.
  // Dirty images are left to the caller, which repairs them (a write) only once it goes ahead.
  [[nodiscard]] static std::optional<std::string> refusal(const Image& image);
  // Why grow(new_size) would fail (the L1 table would exceed kMaxL1TableBytes), without growing.
  [[nodiscard]] static std::optional<std::string> grow_refusal(const Image& image, uint64_t new_size);

  // Where to write the data for a cluster-aligned range that will be fully overwritten.
  struct HostRun {
    uint64_t guest_offset = 0;
    uint64_t length = 0;
    uint64_t host_offset = 0;
  };
  // Stages the mapping for [offset, offset+length): offset cluster aligned, length a multiple of
  // the cluster size or reaching the virtual size. The caller must write every byte of the
  // returned runs to data_device() before commit().
  [[nodiscard]] std::vector<HostRun> prepare_full_write(uint64_t offset, uint64_t length);

  // Allocates (or copies, if shared) the L2 table that maps guest_offset now, as
  // prepare_full_write would: a caller that does this for a batch of writes first gets their L2
  // tables side by side and the data clusters allocated after them side by side too.
  void prepare_l2(uint64_t guest_offset);

  // Writes an arbitrary range now (partial clusters are filled from `view`).
  void write(uint64_t offset, std::span<const uint8_t> data, const ViewReader& view);

  // The two halves of write() for one cluster, for a caller that writes the data itself.
  // prepare_in_place: the host offset of the cluster at `cluster_offset` when part of it can be
  // overwritten where it is (private, uncompressed, every subcluster plain data; its L2 entry
  // staged with COPIED), nullopt when it must be written whole (nothing staged then).
  [[nodiscard]] std::optional<uint64_t> prepare_in_place(uint64_t cluster_offset);
  // A cluster staged as written whole (prepare_cluster_rewrite).
  struct ClusterRewrite {
    uint64_t host_offset = 0;
    // The host cluster is new to the image, lies past the end the file had when this writer was
    // made, and nothing was written there since (no cluster before it was handed out there): it
    // reads as zeros, so the caller need write only the bytes of the cluster that are not zeros.
    // Never on a block device (its unused clusters hold whatever was there before), nor for a
    // cluster reused from freed space inside the file, nor for space past the end that an
    // interrupted run wrote into (the file's end at opening covers it).
    bool reads_zeros = false;
  };
  // Stages the cluster at `cluster_offset` as written whole and returns its host offset: its own
  // host cluster when private, else a new one (what it referenced released at the commit). The
  // caller reads the cluster's current view before this call and writes all of it (up to the
  // virtual size) at the returned offset before commit(); where reads_zeros, the bytes that are
  // zeros in what it writes may be left out.
  [[nodiscard]] ClusterRewrite prepare_cluster_rewrite(uint64_t cluster_offset);

  // Makes [offset, offset+length) read as zeros (zero flags on v3, zero data on v2).
  void write_zeroes(uint64_t offset, uint64_t length, const ViewReader& view);

  // Grows the virtual size (L1 relocated when needed). Never shrinks.
  void grow(uint64_t new_size);

  // Rewrites the backing file name and format (std::nullopt removes the backing file).
  void set_backing(const std::optional<std::string>& name,
                   const std::optional<std::string>& format);
  // Throws (naming the image) when the header as staged (backing name, extensions) would not fit
  // in the first cluster: callers check before they write anything else.
  void check_header_fits();

  // Removes persistent bitmaps: extension and autoclear bit first, then their clusters are freed.
  // Returns how many bitmaps were removed. A stale bitmaps extension (Image::stale_bitmaps()) is
  // dropped from the header and nothing of it is freed; it counts no bitmaps. Throws
  // CorruptionError, before staging anything, when the valid bitmaps' metadata is inconsistent.
  size_t remove_bitmaps();

  // Persists everything staged, in the documented order.
  void commit();

  // Marks the image corrupt on disk (best effort) after a CorruptionError.
  void mark_corrupt() noexcept;

  [[nodiscard]] uint64_t dirty_metadata_bytes() const {
    return (dirty_refblocks_.size() + dirty_l2s_.size()) * image_.cluster_size();
  }
  [[nodiscard]] bool has_staged_changes() const;
  [[nodiscard]] uint64_t allocated_clusters() const { return allocated_clusters_; }

  // Called at each named point of commit(); tests inject faults or crashes here.
  std::function<void(WritePoint)> on_write_point;

 private:
  struct ClusterState {
    uint64_t l1_index = 0;
    uint64_t l2_offset = 0;
    uint64_t l2_index = 0;
    uint64_t entry = 0;
    uint64_t bitmap = 0;  // extended L2 only
  };
  // Returns the (writable, private) L2 table for guest_offset, allocating or copying it.
  std::shared_ptr<std::vector<uint8_t>> writable_l2(uint64_t guest_offset, uint64_t& l2_offset);
  [[nodiscard]] ClusterState cluster_state(uint64_t guest_offset);
  void set_l2(uint64_t guest_offset, uint64_t entry, uint64_t bitmap);
  // Host cluster of the cluster's entry that we may overwrite in place (refcount 1, not
  // compressed), if any.
  [[nodiscard]] std::optional<uint64_t> private_host(const ClusterState& st);
  void release_entry(const ClusterState& st);  // deferred decrement of what the entry referenced

  [[nodiscard]] uint64_t allocate(uint64_t clusters);  // contiguous, refcounts set to 1
  [[nodiscard]] uint64_t find_free(uint64_t clusters);
  void find_refcounted_end();
  [[nodiscard]] uint64_t get_refcount(uint64_t cluster);
  void set_refcount(uint64_t cluster, uint64_t value);
  void ensure_refblock(uint64_t block_index);
  void grow_reftable(uint64_t min_entries);
  // Pin a modified table in the cache (put back if it was evicted while the caller held it).
  void dirty_refblock(uint64_t table_offset, const std::shared_ptr<std::vector<uint8_t>>& table);
  void dirty_l2(uint64_t table_offset, const std::shared_ptr<std::vector<uint8_t>>& table);
  void point(WritePoint p);
  void write_header(const Header& h);
  void write_tables(std::set<uint64_t>& offsets);
  void apply_frees();
  void flush();

  Image& image_;
  const Geometry geo_;
  const uint64_t cs_;
  uint64_t file_end_cluster_ = 0;  // first cluster index past everything allocated
  // Clusters past the file's end read as zeros until written (a regular file, not a device).
  bool zeros_past_end_ = false;
  uint64_t refcounted_end_cluster_ = 0;  // past the file's last cluster with a refcount
  uint64_t free_hint_ = 0;
  std::set<uint64_t> reserved_;  // picked for a new refcount block, refcount not yet set
  Header committed_;             // the header as it is on disk
  std::set<uint64_t> dirty_refblocks_;
  std::set<uint64_t> dirty_l2s_;
  std::set<uint64_t> dirty_l1_;
  std::set<uint64_t> dirty_reftable_;
  bool l1_relocated_ = false;
  bool reftable_relocated_ = false;
  bool header_dirty_ = false;
  std::vector<std::pair<uint64_t, uint64_t>> deferred_frees_;  // (first cluster, count)
  uint64_t allocated_clusters_ = 0;
  bool data_written_ = false;
};

}  // namespace qcommit::qcow2
