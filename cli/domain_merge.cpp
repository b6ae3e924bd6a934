#include "cli/domain_merge.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <libxml/xpath.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "qcow2/chain.h"
#include "cli/xml.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace fs = std::filesystem;
using qcow2::Error;

namespace {

// --- RAII for libvirt and libxml2 handles ----------------------------------------------------
struct ConnFree { void operator()(virConnectPtr p) const { virConnectClose(p); } };
struct DomFree { void operator()(virDomainPtr p) const { virDomainFree(p); } };
struct SnapFree { void operator()(virDomainSnapshotPtr p) const { virDomainSnapshotFree(p); } };
struct PoolFree { void operator()(virStoragePoolPtr p) const { virStoragePoolFree(p); } };
struct VolFree { void operator()(virStorageVolPtr p) const { virStorageVolFree(p); } };
struct DocFree { void operator()(xmlDocPtr p) const { xmlFreeDoc(p); } };
struct CharFree { void operator()(char* p) const { std::free(p); } };
using Conn = std::unique_ptr<virConnect, ConnFree>;
using Dom = std::unique_ptr<virDomain, DomFree>;
using Snap = std::unique_ptr<virDomainSnapshot, SnapFree>;
using Pool = std::unique_ptr<virStoragePool, PoolFree>;
using Vol = std::unique_ptr<virStorageVol, VolFree>;
using Doc = std::unique_ptr<xmlDoc, DocFree>;
using CStr = std::unique_ptr<char, CharFree>;

// Test-only seam: QCOMMIT_TEST_KILL_AT=<point> makes this process SIGKILL itself at that named
// point of a domain merge, so tests can crash it between the steps a re-run must finish
// (tests/libvirt/offline-domain-crash.sh). Points, in order: data-window (after the first
// committed window of the copy), data-merged, snapshots-removed, defined (before the pools are
// refreshed and the journal is removed). Not for production use.
void test_kill_point(const char* point) {
  const char* at = std::getenv("QCOMMIT_TEST_KILL_AT");
  if (at && std::strcmp(at, point) == 0) ::kill(::getpid(), SIGKILL);
}

std::string last_libvirt_error() {
  const virError* e = virGetLastError();
  return e && e->message ? e->message : "unknown libvirt error";
}

Doc parse_xml(const std::string& xml, const std::string& what) {
  Doc d(xmlReadMemory(xml.data(), int(xml.size()), "in.xml", nullptr, XML_PARSE_NONET | XML_PARSE_NOBLANKS));
  if (!d) throw Error(what, "cannot parse libvirt XML");
  return d;
}

// The <disk> element of `doc` whose <target dev=...> is `dev` (domain XML: devices/disk;
// snapshot XML: disks/disk with name=).
xmlNodePtr find_domain_disk(xmlDocPtr doc, const std::string& dev) {
  xmlNodePtr devices = xml_child(xmlDocGetRootElement(doc), "devices");
  for (xmlNodePtr d = devices ? devices->children : nullptr; d; d = d->next) {
    if (d->type != XML_ELEMENT_NODE || xmlStrcmp(d->name, BAD_CAST "disk") != 0) continue;
    if (xml_attr(xml_child(d, "target"), "dev") == dev) return d;
  }
  return nullptr;
}

std::string dump(xmlDocPtr doc) {
  xmlChar* out = nullptr;
  int len = 0;
  xmlDocDumpFormatMemory(doc, &out, &len, 1);
  std::string s(reinterpret_cast<char*>(out), size_t(len));
  xmlFree(out);
  return s;
}

std::string canonical(const std::string& p) {
  std::error_code ec;
  auto c = fs::weakly_canonical(p, ec);
  return ec ? p : c.string();
}

std::string volume_path(virConnectPtr conn, const std::string& pool, const std::string& vol) {
  Pool p(virStoragePoolLookupByName(conn, pool.c_str()));
  if (!p) p.reset(virStoragePoolLookupByUUIDString(conn, pool.c_str()));
  if (!p) throw Error("pool " + pool, "not found: " + last_libvirt_error());
  Vol v(virStorageVolLookupByName(p.get(), vol.c_str()));
  if (!v) throw Error("pool " + pool, "volume '" + vol + "' not found: " + last_libvirt_error());
  CStr path(virStorageVolGetPath(v.get()));
  if (!path) throw Error("pool " + pool, "cannot get the path of volume '" + vol + "'");
  return path.get();
}

// Active pools whose target directory contains `file`.
std::vector<Pool> pools_holding(virConnectPtr conn, const std::string& file) {
  std::vector<Pool> out;
  virStoragePoolPtr* pools = nullptr;
  int n = virConnectListAllStoragePools(conn, &pools, VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE);
  for (int i = 0; i < n; ++i) {
    Pool p(pools[i]);
    CStr xml(virStoragePoolGetXMLDesc(p.get(), 0));
    if (!xml) continue;
    Doc d = parse_xml(xml.get(), "pool");
    xmlNodePtr target = xml_child(xmlDocGetRootElement(d.get()), "target");
    xmlNodePtr path = xml_child(target, "path");
    if (!path) continue;
    xmlChar* t = xmlNodeGetContent(path);
    std::string dir = canonical(reinterpret_cast<char*>(t));
    xmlFree(t);
    auto rel = fs::path(canonical(file)).lexically_relative(dir);
    if (!rel.empty() && *rel.begin() != "..") out.push_back(std::move(p));
  }
  std::free(pools);
  return out;
}

struct Journal {
  std::string path;
  std::string domain_uuid, disk, top, base;
  bool load() {
    std::ifstream in(path);
    if (!in) return false;
    std::string magic;
    std::getline(in, magic);
    std::getline(in, domain_uuid);
    std::getline(in, disk);
    std::getline(in, top);
    std::getline(in, base);
    return magic == "qcommit-domain-merge v1" && !base.empty();
  }
  void save() const {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << "qcommit-domain-merge v1\n" << domain_uuid << "\n" << disk << "\n" << top << "\n" << base << "\n";
      out.flush();
      if (!out) throw Error(tmp, "cannot write the domain-merge journal");
    }
    fs::rename(tmp, path);
  }
};

}  // namespace

DomainMergeResult merge_domain(DomainMergeRequest req, const std::function<void(const std::string&)>& note) {
  DomainMergeResult res;
  Conn conn(virConnectOpen(req.uri.c_str()));
  if (!conn) throw Error(req.uri, "cannot connect to libvirt: " + last_libvirt_error());

  // --- A volume of a pool as TOP (no domain) -------------------------------------------------
  if (req.domain.empty()) {
    if (req.pool.empty() || req.volume.empty()) throw Error("", "give --domain DOM --disk DEV, or --pool POOL --vol NAME");
    std::string top = volume_path(conn.get(), req.pool, req.volume);
    req.merge.top = top;
    if (req.base) req.merge.base = *req.base;
    if (req.make_governor) req.merge.governor = req.make_governor(top);
    if (!req.dry_run) res.merge = engine::merge(req.merge);
    res.top = top;
    res.base = res.merge.base;
    Pool p(virStoragePoolLookupByName(conn.get(), req.pool.c_str()));
    if (!p) p.reset(virStoragePoolLookupByUUIDString(conn.get(), req.pool.c_str()));
    if (p && !req.dry_run && virStoragePoolRefresh(p.get(), 0) == 0) res.pools_refreshed.push_back(req.pool);
    return res;
  }

  // --- A shut-off domain's disk --------------------------------------------------------------
  Dom dom(virDomainLookupByName(conn.get(), req.domain.c_str()));
  if (!dom) throw Error("domain " + req.domain, "not found: " + last_libvirt_error());
  if (virDomainIsActive(dom.get()) == 1)
    throw Error("domain " + req.domain, "is running; merge its disks live with 'qcommit live " + req.domain +
                                            " " + req.disk + "' (or shut it off first)");
  char uuid[VIR_UUID_STRING_BUFLEN] = {};
  virDomainGetUUIDString(dom.get(), uuid);
  CStr xml(virDomainGetXMLDesc(dom.get(), VIR_DOMAIN_XML_INACTIVE));
  if (!xml) throw Error("domain " + req.domain, "cannot read its definition: " + last_libvirt_error());
  Doc doc = parse_xml(xml.get(), "domain " + req.domain);
  xmlNodePtr disk = find_domain_disk(doc.get(), req.disk);
  if (!disk) throw Error("domain " + req.domain, "has no disk with target '" + req.disk + "'");
  xmlNodePtr source = xml_child(disk, "source");
  std::string active = xml_attr(source, "file");
  if (active.empty() && !xml_attr(source, "volume").empty())
    active = volume_path(conn.get(), xml_attr(source, "pool"), xml_attr(source, "volume"));
  if (active.empty())
    throw Error("domain " + req.domain, "disk " + req.disk + " is not a file or pool volume; cannot merge it offline");

  // A journal left by an interrupted run of this same merge takes precedence.
  qcow2::Chain chain = qcow2::Chain::open(active, [&] {
    qcow2::ChainOptions o;
    o.allowed_backing_dirs = req.merge.allowed_backing_dirs;
    return o;
  }());
  std::vector<std::string> layers;
  for (size_t i = 0; i < chain.depth(); ++i) layers.push_back(canonical(chain.layer(i).path));

  std::string top = req.top ? canonical(*req.top) : layers[0];
  std::optional<std::string> base = req.base ? std::optional<std::string>(canonical(*req.base)) : std::nullopt;
  Journal journal;
  {
    // The journal lives beside the base; look for one next to each candidate base.
    for (size_t i = 1; i < layers.size(); ++i) {
      Journal j;
      j.path = engine::checkpoint_path(layers[i]) + ".domain";
      if (j.load() && j.domain_uuid == uuid && j.disk == req.disk) {
        journal = j;
        top = j.top;
        base = j.base;
        res.finished_earlier_run = true;
        note("finishing an interrupted merge of " + j.top + " into " + j.base);
        break;
      }
    }
  }
  // Interrupted after the definition was switched: the active layer is already the base.
  if (res.finished_earlier_run && layers[0] == *base) {
    res.top = top;
    res.base = *base;
  } else {
    auto it = std::find(layers.begin(), layers.end(), top);
    if (it == layers.end()) throw Error(top, "is not in the chain of domain " + req.domain + " disk " + req.disk);
    const size_t t = size_t(it - layers.begin());
    size_t b = t + 1;
    if (base) {
      auto bi = std::find(layers.begin(), layers.end(), *base);
      if (bi == layers.end() || size_t(bi - layers.begin()) <= t)
        throw Error(*base, "is not below " + top + " in the chain of domain " + req.domain);
      b = size_t(bi - layers.begin());
    }
    if (b >= layers.size()) throw Error(top, "has no backing file: nothing to merge into");
    res.top = top;
    res.base = layers[b];
    std::vector<std::string> merged(layers.begin() + long(t), layers.begin() + long(b));

    // Snapshot metadata that points at merged files would describe states that no longer
    // exist: remove it the way `virsh snapshot-delete` of an external snapshot leaves things.
    // Decide before writing anything; refuse what cannot be kept consistent.
    virDomainSnapshotPtr* snaps = nullptr;
    int ns = virDomainListAllSnapshots(dom.get(), &snaps, 0);
    std::vector<Snap> affected;
    std::vector<std::string> problems;
    for (int i = 0; i < ns; ++i) {
      Snap s(snaps[i]);
      CStr sx(virDomainSnapshotGetXMLDesc(s.get(), 0));
      if (!sx) continue;
      Doc sd = parse_xml(sx.get(), "snapshot");
      xmlNodePtr disks = xml_child(xmlDocGetRootElement(sd.get()), "disks");
      bool hit = false;
      for (xmlNodePtr d = disks ? disks->children : nullptr; d; d = d->next) {
        if (d->type != XML_ELEMENT_NODE || xml_attr(d, "name") != req.disk) continue;
        const std::string f = canonical(xml_attr(xml_child(d, "source"), "file"));
        // The snapshot's overlay, or the state it captured (the overlay's backing file), merged.
        auto pos = std::find(layers.begin(), layers.end(), f);
        if (pos != layers.end()) {
          const size_t k = size_t(pos - layers.begin());
          hit = (k >= t && k < b) || (k + 1 >= t && k + 1 <= b);
        }
      }
      if (!hit) continue;
      const std::string name = virDomainSnapshotGetName(s.get());
      if (xml_child(xmlDocGetRootElement(sd.get()), "memory") &&
          xml_attr(xml_child(xmlDocGetRootElement(sd.get()), "memory"), "snapshot") == "external")
        problems.push_back("snapshot '" + name + "' has saved memory state that needs the merged disk state");
      affected.push_back(std::move(s));
    }
    std::free(snaps);
    if (!problems.empty()) {
      std::string all;
      for (auto& p : problems) all += (all.empty() ? "" : "; ") + p;
      throw Error("domain " + req.domain, "cannot keep the snapshot list consistent: " + all + " (nothing written)");
    }
    for (auto& s : affected) note(std::string("snapshot metadata to remove: ") + virDomainSnapshotGetName(s.get()));

    if (req.dry_run) return res;
    journal = Journal{engine::checkpoint_path(res.base) + ".domain", uuid, req.disk, res.top, res.base};
    journal.save();

    req.merge.top = res.top;
    req.merge.base = res.base;
    if (t > 0) req.merge.rebase = {layers[t - 1]};
    if (req.make_governor) req.merge.governor = req.make_governor(res.base);
    req.merge.on_checkpoint = [inner = req.merge.on_checkpoint](uint64_t done) {
      if (inner) inner(done);
      test_kill_point("data-window");
    };
    res.merge = engine::merge(req.merge);
    test_kill_point("data-merged");

    for (auto& s : affected) {
      const std::string name = virDomainSnapshotGetName(s.get());
      if (virDomainSnapshotDelete(s.get(), VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY) == 0)
        res.snapshot_metadata_removed.push_back(name);
      else
        note("could not remove metadata of snapshot '" + name + "': " + last_libvirt_error());
    }
    test_kill_point("snapshots-removed");

    // The definition: when TOP was the active layer, the disk now runs on BASE.
    if (t == 0) {
      qcow2::Chain bchain = qcow2::Chain::open(res.base, [&] {
        qcow2::ChainOptions o;
        o.allowed_backing_dirs = req.merge.allowed_backing_dirs;
        o.allowed_backing_dirs.push_back(fs::path(res.base).parent_path().string());
        return o;
      }());
      xmlNodePtr src = xml_child(disk, "source");
      if (!xml_attr(src, "volume").empty()) {
        xmlUnsetProp(src, BAD_CAST "pool");
        xmlUnsetProp(src, BAD_CAST "volume");
        xmlSetProp(disk, BAD_CAST "type", BAD_CAST "file");
      }
      xmlSetProp(src, BAD_CAST "file", BAD_CAST res.base.c_str());
      if (xmlNodePtr drv = xml_child(disk, "driver"))
        xmlSetProp(drv, BAD_CAST "type", BAD_CAST qcow2::to_string(bchain.top().format));
      // libvirt re-detects the chain below the new source.
      while (xmlNodePtr bs = xml_child(disk, "backingStore")) {
        xmlUnlinkNode(bs);
        xmlFreeNode(bs);
      }
      const std::string newxml = dump(doc.get());
      Dom redefined(virDomainDefineXML(conn.get(), newxml.c_str()));
      if (!redefined)
        throw Error("domain " + req.domain, "merge done, but redefining the domain failed: " + last_libvirt_error() +
                                                "; run the same command again");
      res.definition_updated = true;
    }
    test_kill_point("defined");
  }
  for (auto& p : pools_holding(conn.get(), res.base)) {
    if (virStoragePoolRefresh(p.get(), 0) == 0) res.pools_refreshed.push_back(virStoragePoolGetName(p.get()));
  }
  if (!journal.path.empty()) fs::remove(journal.path);
  return res;
}

}  // namespace qcommit::cli
