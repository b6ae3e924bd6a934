// SPDX-License-Identifier: GPL-2.0-or-later
// What the offline merge of a domain's disk (domain_merge.cpp) reads and edits through libvirt:
// its errors, XML, the pools that hold a file, the disk's <source> and <backingStore>, and the
// merge journal kept in the domain's definition.
#pragma once

#include <libvirt/libvirt.h>

#include <functional>
#include <string>
#include <vector>

#include "plugin/domain/domain_merge.h"
#include "plugin/host/xml.h"
#include "plugin/hypervisor/libvirt_handles.h"
#include "qcow2/chain.h"

namespace qcommit::plugin {

// libvirt's message for the last failed call on this thread.
[[nodiscard]] std::string last_libvirt_error();
// `text` parsed; qcow2::Error naming `what` when it is not XML.
[[nodiscard]] xml::Doc parse_xml(const std::string& text, const std::string& what);
// `p` with symbolic links and dot segments resolved as far as it exists; `p` on error.
[[nodiscard]] std::string canonical_path(const std::string& p);

// ---- pools ----
// Why a pool lookup found nothing: "no such storage pool" when libvirt says so, else libvirt's
// own words (access denied, connection lost).
[[nodiscard]] std::string pool_lookup_error();
// 32 hexadecimal digits, with or without dashes between them (as libvirt writes UUIDs).
[[nodiscard]] bool looks_like_uuid(const std::string& s);
// The pool named `pool`, or whose UUID it is; null when there is none. The UUID is looked up
// only for a string that is one (libvirt's error for a name otherwise says "uuidstr ... must
// be a valid UUID").
[[nodiscard]] lv::Pool find_pool(virConnectPtr conn, const std::string& pool);
// The path of volume `vol` of `pool`; qcow2::Error naming the pool when there is none.
[[nodiscard]] std::string volume_path(virConnectPtr conn, const std::string& pool,
                                      const std::string& vol);
// Active pools whose target directory contains `file`.
[[nodiscard]] std::vector<lv::Pool> pools_holding(virConnectPtr conn, const std::string& file);
// Refreshes `pool` once per merge so vol-list/vol-info show the files as they are now. A failure
// leaves the data merged and only libvirt's cached view stale: say so, naming the way out.
void refresh_pool(virStoragePoolPtr pool, DomainMergeResult& res,
                  const std::function<void(const std::string&)>& note);
// refresh_pool for every active pool holding `file`.
void refresh_pools_holding(virConnectPtr conn, const std::string& file, DomainMergeResult& res,
                           const std::function<void(const std::string&)>& note);

// ---- the disk's definition ----
// Points the <source> of a <disk> or <backingStore> element at `path` (a file or a block device).
void set_source(xmlNodePtr element, xmlNodePtr source, const std::string& path);
// Replaces the disk's <backingStore> chain with the layers below the top of `chain`, ended by an
// empty <backingStore/>. libvirt takes an inactive definition's chain as written instead of
// probing the files, so a chain that still names a merged layer keeps reading through it, or the
// domain fails to start once that file is gone.
void set_backing_store(xmlNodePtr disk, const qcow2::Chain& chain);

// The journal: what a re-run needs to finish an interrupted merge, kept in the domain's own
// definition (<metadata>, namespace kJournalUri) before the first write. There it survives a
// reboot whatever BASE is (a file, a logical volume under /dev), goes with the domain, and the
// redefinition of the disk carries it along. Paths are as the chain names them (what goes into
// the definition); compare them canonically.
inline constexpr const char* kJournalUri = "urn:qcommit:domain-merge";
inline constexpr const char* kJournalKey = "qcommit";

struct MergeJournal {
  std::string disk, top, base;
  bool switch_source = false;          // TOP was the active layer: the disk moves to BASE
  bool delete_merged = false;          // --delete: remove `merged` once the definition is updated
  std::vector<std::string> merged;     // TOP and the intermediates
  std::vector<std::string> snapshots;  // snapshot metadata of merged states, to remove

  // False when the domain has none.
  [[nodiscard]] bool load(virDomainPtr dom);
  void save(virDomainPtr dom) const;
  static void remove(virDomainPtr dom);
};

}  // namespace qcommit::plugin
