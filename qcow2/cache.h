// SPDX-License-Identifier: GPL-2.0-or-later
// A size-bounded LRU cache of metadata tables (L2 tables, refcount blocks), keyed by host offset.
// Metadata memory stays bounded whatever the image size.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

namespace qcommit::qcow2 {

class TableCache {
 public:
  using Table = std::shared_ptr<std::vector<uint8_t>>;
  explicit TableCache(size_t capacity_bytes) : capacity_(capacity_bytes) {}

  // Returns the cached table at `offset`, loading it with `load` on a miss.
  [[nodiscard]] Table get(uint64_t offset, size_t bytes,
                          const std::function<void(std::vector<uint8_t>&)>& load) {
    if (auto it = index_.find(offset); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->table;
    }
    auto table = std::make_shared<std::vector<uint8_t>>(bytes);
    load(*table);
    insert(offset, table);
    return table;
  }

  // Replaces (or inserts) the cached copy of a table.
  void put(uint64_t offset, Table table) {
    erase(offset);
    insert(offset, std::move(table));
  }

  // Dirty tables are pinned (never evicted) until mark_clean(): the cache is the only copy of
  // their new contents until the caller writes them at the right point of its persistence order.
  // `table` is the caller's copy: put back if it was evicted meanwhile (it is then the only copy).
  void mark_dirty(uint64_t offset, const Table& table) {
    auto it = index_.find(offset);
    if (it == index_.end() || it->second->table != table) {
      put(offset, table);
      it = index_.find(offset);
    }
    it->second->dirty = true;
  }
  void mark_clean(uint64_t offset) {
    if (auto it = index_.find(offset); it != index_.end()) it->second->dirty = false;
    shrink();
  }
  [[nodiscard]] bool is_dirty(uint64_t offset) const {
    auto it = index_.find(offset);
    return it != index_.end() && it->second->dirty;
  }

  void erase(uint64_t offset) {
    if (auto it = index_.find(offset); it != index_.end()) {
      used_ -= it->second->table->size();
      lru_.erase(it->second);
      index_.erase(it);
    }
  }

  void clear() {
    lru_.clear();
    index_.clear();
    used_ = 0;
  }

  [[nodiscard]] size_t used_bytes() const { return used_; }

 private:
  struct Slot {
    uint64_t offset;
    Table table;
    bool dirty = false;
  };
  void insert(uint64_t offset, Table table) {
    used_ += table->size();
    lru_.push_front(Slot{offset, std::move(table)});
    index_[offset] = lru_.begin();
    shrink();
  }
  void shrink() {
    // Evict clean tables from the cold end; keep at least two so a caller holding one can
    // still load another, and never the newest (just inserted: its caller is about to use it,
    // e.g. mark it dirty, even when every other table is pinned dirty).
    auto it = lru_.end();
    while (used_ > capacity_ && lru_.size() > 2) {
      --it;
      if (it == lru_.begin()) break;
      if (it->dirty) continue;
      used_ -= it->table->size();
      index_.erase(it->offset);
      it = lru_.erase(it);
    }
  }
  size_t capacity_;
  size_t used_ = 0;
  std::list<Slot> lru_;
  std::unordered_map<uint64_t, std::list<Slot>::iterator> index_;
};

}  // namespace qcommit::qcow2
