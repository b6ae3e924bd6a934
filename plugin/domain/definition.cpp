// SPDX-License-Identifier: GPL-2.0-or-later
// What the offline merge of a domain's disk reads and edits through libvirt: its errors, XML, the
// pools that hold a file, the disk's <source> and <backingStore>, and the merge journal.
#include "plugin/domain/definition.h"

#include <libvirt/virterror.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "qcow2/error.h"

namespace qcommit::plugin {

namespace fs = std::filesystem;
using qcow2::Error;
using CStr = lv::CString;
using Doc = xml::Doc;
using Pool = lv::Pool;
using Vol = lv::Vol;

namespace {

bool is_block_device(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISBLK(st.st_mode);
}

}  // namespace

std::string last_libvirt_error() {
  const virError* e = virGetLastError();
  return e && e->message ? e->message : "unknown libvirt error";
}

Doc parse_xml(const std::string& text, const std::string& what) {
  Doc d = xml::parse(text);
  if (!d) throw Error(what, "cannot parse libvirt XML");
  return d;
}

std::string canonical_path(const std::string& p) {
  std::error_code ec;
  auto c = fs::weakly_canonical(p, ec);
  return ec ? p : c.string();
}

std::string pool_lookup_error() {
  const virError* e = virGetLastError();
  if (!e || e->code == VIR_ERR_NO_STORAGE_POOL)
    return "no such storage pool (virsh pool-list --all lists them)";
  return last_libvirt_error();
}

bool looks_like_uuid(const std::string& s) {
  size_t digits = 0;
  for (char c : s) {
    if (std::isxdigit(static_cast<unsigned char>(c)))
      ++digits;
    else if (c != '-')
      return false;
  }
  return digits == 32;
}

Pool find_pool(virConnectPtr conn, const std::string& pool) {
  Pool p(virStoragePoolLookupByName(conn, pool.c_str()));
  if (!p && looks_like_uuid(pool)) p.reset(virStoragePoolLookupByUUIDString(conn, pool.c_str()));
  return p;
}

std::string volume_path(virConnectPtr conn, const std::string& pool, const std::string& vol) {
  Pool p = find_pool(conn, pool);
  if (!p) throw Error("pool " + pool, pool_lookup_error());
  Vol v(virStorageVolLookupByName(p.get(), vol.c_str()));
  if (!v) throw Error("pool " + pool, "volume '" + vol + "' not found: " + last_libvirt_error());
  CStr path(virStorageVolGetPath(v.get()));
  if (!path) throw Error("pool " + pool, "cannot get the path of volume '" + vol + "'");
  return path.get();
}

std::vector<Pool> pools_holding(virConnectPtr conn, const std::string& file) {
  std::vector<Pool> out;
  virStoragePoolPtr* pools = nullptr;
  const int n = virConnectListAllStoragePools(conn, &pools, VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE);
  for (Pool& p : lv::take_list<Pool>(pools, n)) {
    CStr xml(virStoragePoolGetXMLDesc(p.get(), 0));
    if (!xml) continue;
    Doc d = parse_xml(xml.get(), "pool");
    xmlNodePtr path = xml::first(d.get(), "/pool/target/path");
    if (!path) continue;
    std::string dir = canonical_path(xml::text(path));
    auto rel = fs::path(canonical_path(file)).lexically_relative(dir);
    if (!rel.empty() && *rel.begin() != "..") out.push_back(std::move(p));
  }
  return out;
}

void set_source(xmlNodePtr element, xmlNodePtr source, const std::string& path) {
  const bool block = is_block_device(path);
  xml::set_attr(element, "type", block ? "block" : "file");
  for (const char* a : {"file", "dev", "pool", "volume"}) xml::unset_attr(source, a);
  xml::set_attr(source, block ? "dev" : "file", path);
}

void set_backing_store(xmlNodePtr disk, const qcow2::Chain& chain) {
  xml::remove_children(disk, "backingStore");
  xmlNodePtr parent = disk;
  for (size_t i = 1; i < chain.depth(); ++i) {
    const qcow2::Layer& l = chain.layer(i);
    const xmlNodePtr bs = xml::add_child(parent, "backingStore");
    xml::set_attr(xml::add_child(bs, "format"), "type", qcow2::to_string(l.format));
    set_source(bs, xml::add_child(bs, "source"), l.path);
    parent = bs;
  }
  xml::add_child(parent, "backingStore");
}

bool MergeJournal::load(virDomainPtr dom) {
  CStr text(virDomainGetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, kJournalUri,
                                 VIR_DOMAIN_AFFECT_CONFIG));
  if (!text) return false;
  Doc d = parse_xml(text.get(), "domain-merge journal");
  const xmlNodePtr root = xml::root(d.get());
  if (xml::name(root) != "merge" || xml::attr(root, "version") != "2")
    throw Error(std::string("domain ") + virDomainGetName(dom),
                "has a qcommit merge journal this version cannot read (remove it: virsh "
                "metadata DOMAIN " +
                    std::string(kJournalUri) + " --config --remove)");
  disk = xml::attr(root, "disk");
  switch_source = xml::attr(root, "switch-source") == "yes";
  delete_merged = xml::attr(root, "delete-merged") == "yes";
  for (const xmlNodePtr n : xml::children(root)) {
    const std::string name = xml::name(n);
    if (name == "top")
      top = xml::text(n);
    else if (name == "base")
      base = xml::text(n);
    else if (name == "merged")
      merged.push_back(xml::text(n));
    else if (name == "snapshot")
      snapshots.push_back(xml::text(n));
  }
  return true;
}

void MergeJournal::save(virDomainPtr dom) const {
  const Doc d = xml::new_document("merge");
  const xmlNodePtr root = xml::root(d.get());
  xml::set_attr(root, "version", "2");
  xml::set_attr(root, "disk", disk);
  xml::set_attr(root, "switch-source", switch_source ? "yes" : "no");
  xml::set_attr(root, "delete-merged", delete_merged ? "yes" : "no");
  xml::add_child(root, "top", top);
  xml::add_child(root, "base", base);
  for (const auto& m : merged) xml::add_child(root, "merged", m);
  for (const auto& n : snapshots) xml::add_child(root, "snapshot", n);
  // One element, without an XML declaration: what libvirt takes as metadata.
  const std::string text = xml::dump_element(root);
  if (virDomainSetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, text.c_str(), kJournalKey,
                           kJournalUri, VIR_DOMAIN_AFFECT_CONFIG) != 0)
    throw Error(std::string("domain ") + virDomainGetName(dom),
                "cannot record the merge journal in its definition (nothing written): " +
                    last_libvirt_error());
}

void MergeJournal::remove(virDomainPtr dom) {
  if (virDomainSetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, nullptr, nullptr, kJournalUri,
                           VIR_DOMAIN_AFFECT_CONFIG) != 0)
    throw Error(std::string("domain ") + virDomainGetName(dom),
                "merge done, but removing its journal from the definition failed: " +
                    last_libvirt_error());
}

void refresh_pool(virStoragePoolPtr pool, DomainMergeResult& res, const std::function<void(const std::string&)>& note) {
  const std::string name = virStoragePoolGetName(pool);
  if (std::find(res.pools_refreshed.begin(), res.pools_refreshed.end(), name) != res.pools_refreshed.end()) return;
  if (virStoragePoolRefresh(pool, 0) == 0)
    res.pools_refreshed.push_back(name);
  else
    note("could not refresh storage pool " + name + " (vol-list/vol-info may show the files as before the merge; " +
         "run 'virsh pool-refresh " + name + "'): " + last_libvirt_error());
}

void refresh_pools_holding(virConnectPtr conn, const std::string& file, DomainMergeResult& res,
                           const std::function<void(const std::string&)>& note) {
  for (auto& p : pools_holding(conn, file)) refresh_pool(p.get(), res, note);
}

}  // namespace qcommit::plugin
