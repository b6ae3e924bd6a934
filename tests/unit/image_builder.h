// SPDX-License-Identifier: GPL-2.0-or-later
// A small qcow2 image builder for unit tests: lays out an image byte by byte from the
// specification (independently of the library's own writer), so tests can build valid images and
// then break exactly one thing. All offsets and values are written big-endian by hand.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qcow2/device.h"

namespace qcommit::test {

inline void put_be(std::vector<uint8_t>& b, uint64_t off, uint64_t v, unsigned bytes) {
  if (b.size() < off + bytes) b.resize(off + bytes);
  for (unsigned i = 0; i < bytes; ++i) b[off + i] = uint8_t(v >> (8 * (bytes - 1 - i)));
}
inline uint64_t get_be(const std::vector<uint8_t>& b, uint64_t off, unsigned bytes) {
  uint64_t v = 0;
  for (unsigned i = 0; i < bytes; ++i) v = (v << 8) | b.at(off + i);
  return v;
}

struct ExtensionSpec {
  uint32_t type = 0;
  std::vector<uint8_t> data;
};

struct FeatureSpec {
  uint8_t type = 0;  // 0 incompatible, 1 compatible, 2 autoclear
  uint8_t bit = 0;
  std::string name;
};

struct ImageSpec {
  uint32_t version = 3;
  uint32_t cluster_bits = 16;
  uint64_t size = 64ull << 20;
  uint32_t refcount_order = 4;
  bool extended_l2 = false;
  uint64_t incompatible = 0;  // extra bits; extended_l2/compression bits are added from the fields
  uint64_t compatible = 0;
  uint64_t autoclear = 0;
  uint32_t header_length = 0;  // 0: 72 (v2), 104, or 112 with a compression type
  std::optional<uint8_t> compression_type;
  std::optional<std::string> backing;
  std::optional<std::string> backing_format;
  std::vector<FeatureSpec> features;
  std::vector<ExtensionSpec> extensions;  // written after backing format / feature table
  uint32_t l1_clusters = 0;               // 0: as many as the virtual size needs
};

// Layout: cluster 0 header + extensions + backing name, cluster 1 refcount table (one cluster),
// then L1 table, then refcount blocks / L2 tables / data clusters as allocated.
class ImageBuilder {
 public:
  explicit ImageBuilder(ImageSpec spec) : s_(std::move(spec)) {
    cs_ = 1ull << s_.cluster_bits;
    entry_bytes_ = s_.extended_l2 ? 16 : 8;
    l2_entries_ = cs_ / entry_bytes_;
    const uint64_t span = l2_entries_ * cs_;
    l1_size_ = (s_.size + span - 1) / span;
    uint64_t l1_clusters = s_.l1_clusters ? s_.l1_clusters : (l1_size_ * 8 + cs_ - 1) / cs_;
    if (l1_clusters == 0) l1_clusters = 1;
    bytes_.assign(cs_ * 2, 0);
    reftable_offset_ = cs_;
    l1_offset_ = 2 * cs_;
    bytes_.resize(l1_offset_ + l1_clusters * cs_, 0);
    for (uint64_t c = 0; c < bytes_.size() / cs_; ++c) set_refcount(c, 1);
    write_header();
  }

  [[nodiscard]] uint64_t cluster_size() const { return cs_; }
  [[nodiscard]] uint64_t l1_offset() const { return l1_offset_; }
  [[nodiscard]] uint64_t reftable_offset() const { return reftable_offset_; }
  [[nodiscard]] uint64_t l1_size() const { return l1_size_; }
  std::vector<uint8_t>& bytes() { return bytes_; }

  // Appends a zeroed cluster with refcount 1; returns its offset.
  uint64_t alloc_cluster() {
    const uint64_t off = bytes_.size();
    bytes_.resize(off + cs_, 0);
    set_refcount(off / cs_, 1);
    return off;
  }

  // Sets the refcount of a cluster (allocating refcount blocks as needed).
  void set_refcount(uint64_t cluster, uint64_t value) {
    const uint32_t bits = 1u << s_.refcount_order;
    const uint64_t per_block = cs_ * 8 / bits;
    const uint64_t bi = cluster / per_block;
    uint64_t block = get_be(bytes_, reftable_offset_ + bi * 8, 8);
    if (block == 0) {
      block = bytes_.size();
      bytes_.resize(block + cs_, 0);
      put_be(bytes_, reftable_offset_ + bi * 8, block, 8);
      set_refcount(block / cs_, 1);
    }
    const uint64_t i = cluster % per_block;
    if (bits >= 8) {
      put_be(bytes_, block + i * (bits / 8), value, bits / 8);
    } else {
      const uint64_t per_byte = 8 / bits;
      uint8_t& byte = bytes_[block + i / per_byte];
      const unsigned shift = unsigned(bits * (i % per_byte));
      const unsigned mask = ((1u << bits) - 1u) << shift;
      byte = uint8_t((byte & ~mask) | ((unsigned(value) << shift) & mask));
    }
  }

  // The L2 table covering guest_offset (allocated on first use); returns its host offset.
  uint64_t l2_for(uint64_t guest_offset) {
    const uint64_t l1i = guest_offset / (l2_entries_ * cs_);
    uint64_t e = get_be(bytes_, l1_offset_ + l1i * 8, 8);
    if (e == 0) {
      e = alloc_cluster() | (1ull << 63);
      put_be(bytes_, l1_offset_ + l1i * 8, e, 8);
    }
    return e & 0x00fffffffffffe00ull;
  }

  // Sets the raw L2 entry (and, for extended L2, the subcluster bitmap) of the cluster at guest.
  void set_l2(uint64_t guest_offset, uint64_t entry, uint64_t bitmap = 0) {
    const uint64_t l2 = l2_for(guest_offset);
    const uint64_t idx = (guest_offset / cs_) % l2_entries_;
    put_be(bytes_, l2 + idx * entry_bytes_, entry, 8);
    if (s_.extended_l2) put_be(bytes_, l2 + idx * entry_bytes_ + 8, bitmap, 8);
  }

  // Allocates a data cluster for the guest cluster at guest_offset, filled with `fill`.
  uint64_t write_cluster(uint64_t guest_offset, uint8_t fill, uint64_t bitmap = 0xffffffffull) {
    (void)l2_for(guest_offset);  // the L2 table first, so consecutive data clusters are contiguous
    const uint64_t host = alloc_cluster();
    std::memset(bytes_.data() + host, fill, cs_);
    set_l2(guest_offset, host | (1ull << 63), s_.extended_l2 ? bitmap : 0);
    return host;
  }

  // Stores a compressed stream at the end of the file (512-byte aligned start + `skew`) and
  // points the guest cluster at it. Returns the host byte offset of the stream.
  uint64_t write_compressed(uint64_t guest_offset, const std::vector<uint8_t>& stream,
                            uint64_t skew = 0) {
    pad_to_cluster();
    (void)l2_for(guest_offset);  // allocated while the file still ends on a cluster boundary
    uint64_t off = ((bytes_.size() + 511) & ~511ull) + skew;
    bytes_.resize(off + stream.size(), 0);
    std::memcpy(bytes_.data() + off, stream.data(), stream.size());
    for (uint64_t c = off / cs_; c <= (off + stream.size() - 1) / cs_; ++c) set_refcount(c, 1);
    set_l2(guest_offset, compressed_descriptor(off, stream.size()));
    pad_to_cluster();
    return off;
  }

  // The compressed cluster descriptor for a stream at host `off` of `len` bytes.
  [[nodiscard]] uint64_t compressed_descriptor(uint64_t off, uint64_t len) const {
    const unsigned x = 62 - (s_.cluster_bits - 8);
    const uint64_t end = off + len;
    const uint64_t sectors = (end + 511) / 512 - off / 512;  // 512-byte sectors touched
    return (1ull << 62) | ((sectors - 1) << x) | off;
  }

  void pad_to_cluster() { bytes_.resize((bytes_.size() + cs_ - 1) / cs_ * cs_, 0); }

  void put32(uint64_t off, uint32_t v) { put_be(bytes_, off, v, 4); }
  void put64(uint64_t off, uint64_t v) { put_be(bytes_, off, v, 8); }

  [[nodiscard]] std::unique_ptr<qcow2::MemoryDevice> device(const std::string& name) const {
    return std::make_unique<qcow2::MemoryDevice>(name, bytes_);
  }

 private:
  void write_header() {
    const bool v3 = s_.version >= 3;
    uint64_t incompat = s_.incompatible;
    if (s_.extended_l2) incompat |= 1ull << 4;
    if (s_.compression_type && *s_.compression_type != 0) incompat |= 1ull << 3;
    uint32_t hlen = s_.header_length;
    if (!hlen) hlen = !v3 ? 72 : s_.compression_type ? 112 : 104;
    put32(0, 0x514649fb);
    put32(4, s_.version);
    put32(20, s_.cluster_bits);
    put64(24, s_.size);
    put32(32, 0);
    put32(36, uint32_t(l1_size_));
    put64(40, l1_offset_);
    put64(48, reftable_offset_);
    put32(56, 1);
    put32(60, 0);
    put64(64, 0);
    if (v3) {
      put64(72, incompat);
      put64(80, s_.compatible);
      put64(88, s_.autoclear);
      put32(96, s_.refcount_order);
      put32(100, hlen);
      if (s_.compression_type) bytes_[104] = *s_.compression_type;
    }
    uint64_t pos = hlen;
    auto ext = [&](uint32_t type, const std::vector<uint8_t>& d) {
      put32(pos, type);
      put32(pos + 4, uint32_t(d.size()));
      std::memcpy(bytes_.data() + pos + 8, d.data(), d.size());
      pos += 8 + ((d.size() + 7) & ~size_t(7));
    };
    if (s_.backing_format)
      ext(0xe2792aca, std::vector<uint8_t>(s_.backing_format->begin(), s_.backing_format->end()));
    if (!s_.features.empty()) {
      std::vector<uint8_t> t(48 * s_.features.size(), 0);
      for (size_t i = 0; i < s_.features.size(); ++i) {
        t[48 * i] = s_.features[i].type;
        t[48 * i + 1] = s_.features[i].bit;
        std::memcpy(t.data() + 48 * i + 2, s_.features[i].name.data(),
                    std::min<size_t>(46, s_.features[i].name.size()));
      }
      ext(0x6803f857, t);
    }
    for (const auto& e : s_.extensions) ext(e.type, e.data);
    if (pos + 8 <= cs_) {  // end of extensions (optional when the area is full)
      put32(pos, 0);
      put32(pos + 4, 0);
      pos += 8;
    }
    if (s_.backing) {
      put64(8, pos);
      put32(16, uint32_t(s_.backing->size()));
      std::memcpy(bytes_.data() + pos, s_.backing->data(), s_.backing->size());
    }
  }

  ImageSpec s_;
  uint64_t cs_ = 0;
  uint64_t entry_bytes_ = 8;
  uint64_t l2_entries_ = 0;
  uint64_t l1_size_ = 0;
  uint64_t l1_offset_ = 0;
  uint64_t reftable_offset_ = 0;
  std::vector<uint8_t> bytes_;
};

}  // namespace qcommit::test
