#include "cli/domain_merge.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <libxml/xpath.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>

#include "qcow2/chain.h"
#include "plugin/xml.h"
#include "engine/image_lock.h"
#include "plugin/libvirt_handles.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace fs = std::filesystem;
using qcow2::Error;

namespace {

// --- RAII for libvirt and libxml2 handles ----------------------------------------------------
using Conn = plugin::lv::Conn;
using Dom = plugin::lv::Domain;
using Snap = plugin::lv::Snapshot;
using Pool = plugin::lv::Pool;
using Vol = plugin::lv::Vol;
using CStr = plugin::lv::CString;
namespace xml = plugin::xml;
using Doc = xml::Doc;

// Test-only seams at named points of a domain merge, in order: data-window (after the first
// committed window of the copy), data-merged (the copy and the switch done, the images still
// locked), snapshots-removed, defined (before the merged files are deleted). Not for production
// use.
//  - QCOMMIT_TEST_KILL_AT=<point>: this process SIGKILLs itself there, so tests can crash it
//    between the steps a re-run must finish (tests/libvirt/offline-domain-crash.sh).
//  - QCOMMIT_TEST_STOP_AT=<point>: it stops itself there (SIGSTOP) until sent SIGCONT, so a test
//    can act in that moment, e.g. start the domain (tests/libvirt/domain-started-during-merge.sh).
void test_kill_point(const char* point) {
  const char* at = std::getenv("QCOMMIT_TEST_KILL_AT");
  if (at && std::strcmp(at, point) == 0) ::kill(::getpid(), SIGKILL);
  const char* stop = std::getenv("QCOMMIT_TEST_STOP_AT");
  if (stop && std::strcmp(stop, point) == 0) ::kill(::getpid(), SIGSTOP);
}

std::string last_libvirt_error() {
  const virError* e = virGetLastError();
  return e && e->message ? e->message : "unknown libvirt error";
}

Doc parse_xml(const std::string& text, const std::string& what) {
  Doc d = xml::parse(text);
  if (!d) throw Error(what, "cannot parse libvirt XML");
  return d;
}

// The <disk> element of the domain XML `doc` whose <target dev=...> is `dev`.
xmlNodePtr find_domain_disk(xmlDocPtr doc, const std::string& dev) {
  for (xmlNodePtr d : xml::select(doc, "/domain/devices/disk"))
    if (xml::attr(xml::child(d, "target"), "dev") == dev) return d;
  return nullptr;
}

std::string canonical(const std::string& p) {
  std::error_code ec;
  auto c = fs::weakly_canonical(p, ec);
  return ec ? p : c.string();
}

// Why a pool lookup found nothing: "no such storage pool" when libvirt says so, else libvirt's
// own words (access denied, connection lost).
std::string pool_lookup_error() {
  const virError* e = virGetLastError();
  if (!e || e->code == VIR_ERR_NO_STORAGE_POOL)
    return "no such storage pool (virsh pool-list --all lists them)";
  return last_libvirt_error();
}

// 32 hexadecimal digits, with or without dashes between them (as libvirt writes UUIDs).
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

// The pool named `pool`, or whose UUID it is; null when there is none. The UUID is looked up
// only for a string that is one (libvirt's error for a name otherwise says "uuidstr ... must
// be a valid UUID").
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

// Active pools whose target directory contains `file`.
std::vector<Pool> pools_holding(virConnectPtr conn, const std::string& file) {
  std::vector<Pool> out;
  virStoragePoolPtr* pools = nullptr;
  const int n = virConnectListAllStoragePools(conn, &pools, VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE);
  for (Pool& p : plugin::lv::take_list<Pool>(pools, n)) {
    CStr xml(virStoragePoolGetXMLDesc(p.get(), 0));
    if (!xml) continue;
    Doc d = parse_xml(xml.get(), "pool");
    xmlNodePtr path = xml::first(d.get(), "/pool/target/path");
    if (!path) continue;
    std::string dir = canonical(xml::text(path));
    auto rel = fs::path(canonical(file)).lexically_relative(dir);
    if (!rel.empty() && *rel.begin() != "..") out.push_back(std::move(p));
  }
  return out;
}

bool is_block_device(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISBLK(st.st_mode);
}

// Points the <source> of a <disk> or <backingStore> element at `path` (a file or a block device).
void set_source(xmlNodePtr element, xmlNodePtr source, const std::string& path) {
  const bool block = is_block_device(path);
  xmlSetProp(element, BAD_CAST "type", BAD_CAST(block ? "block" : "file"));
  for (const char* a : {"file", "dev", "pool", "volume"}) xmlUnsetProp(source, BAD_CAST a);
  xmlSetProp(source, BAD_CAST(block ? "dev" : "file"), BAD_CAST path.c_str());
}

// Replaces the disk's <backingStore> chain with the layers below the top of `chain`, ended by an
// empty <backingStore/>. libvirt takes an inactive definition's chain as written instead of
// probing the files, so a chain that still names a merged layer keeps reading through it, or the
// domain fails to start once that file is gone.
void set_backing_store(xmlNodePtr disk, const qcow2::Chain& chain) {
  while (xmlNodePtr bs = xml::child(disk, "backingStore")) {
    xmlUnlinkNode(bs);
    xmlFreeNode(bs);
  }
  xmlNodePtr parent = disk;
  for (size_t i = 1; i < chain.depth(); ++i) {
    const qcow2::Layer& l = chain.layer(i);
    xmlNodePtr bs = xmlNewChild(parent, nullptr, BAD_CAST "backingStore", nullptr);
    xmlNodePtr fmt = xmlNewChild(bs, nullptr, BAD_CAST "format", nullptr);
    xmlSetProp(fmt, BAD_CAST "type", BAD_CAST qcow2::to_string(l.format));
    set_source(bs, xmlNewChild(bs, nullptr, BAD_CAST "source", nullptr), l.path);
    parent = bs;
  }
  xmlNewChild(parent, nullptr, BAD_CAST "backingStore", nullptr);
}

// The journal: what a re-run needs to finish an interrupted merge, kept in the domain's own
// definition (<metadata>, namespace kJournalUri) before the first write. There it survives a
// reboot whatever BASE is (a file, a logical volume under /dev), goes with the domain, and the
// redefinition of the disk carries it along. Paths are as the chain names them (what goes into
// the definition); compare them canonically.
constexpr const char* kJournalUri = "urn:qcommit:domain-merge";
constexpr const char* kJournalKey = "qcommit";

struct Journal {
  std::string disk, top, base;
  bool switch_source = false;          // TOP was the active layer: the disk moves to BASE
  bool delete_merged = false;          // --delete: remove `merged` once the definition is updated
  std::vector<std::string> merged;     // TOP and the intermediates
  std::vector<std::string> snapshots;  // snapshot metadata of merged states, to remove

  // False when the domain has none.
  bool load(virDomainPtr dom) {
    CStr xml(virDomainGetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, kJournalUri, VIR_DOMAIN_AFFECT_CONFIG));
    if (!xml) return false;
    Doc d = parse_xml(xml.get(), "domain-merge journal");
    xmlNodePtr root = xmlDocGetRootElement(d.get());
    if (!root || xmlStrcmp(root->name, BAD_CAST "merge") != 0 || xml::attr(root, "version") != "2")
      throw Error(std::string("domain ") + virDomainGetName(dom),
                  "has a qcommit merge journal this version cannot read (remove it: virsh metadata DOMAIN " +
                      std::string(kJournalUri) + " --config --remove)");
    using xml::text;
    disk = xml::attr(root, "disk");
    switch_source = xml::attr(root, "switch-source") == "yes";
    delete_merged = xml::attr(root, "delete-merged") == "yes";
    for (xmlNodePtr n = root->children; n; n = n->next) {
      if (n->type != XML_ELEMENT_NODE) continue;
      const std::string name = reinterpret_cast<const char*>(n->name);
      if (name == "top") top = text(n);
      else if (name == "base") base = text(n);
      else if (name == "merged") merged.push_back(text(n));
      else if (name == "snapshot") snapshots.push_back(text(n));
    }
    return true;
  }

  void save(virDomainPtr dom) const {
    Doc d(xmlNewDoc(BAD_CAST "1.0"));
    xmlNodePtr root = xmlNewDocNode(d.get(), nullptr, BAD_CAST "merge", nullptr);
    xmlDocSetRootElement(d.get(), root);
    xmlSetProp(root, BAD_CAST "version", BAD_CAST "2");
    xmlSetProp(root, BAD_CAST "disk", BAD_CAST disk.c_str());
    xmlSetProp(root, BAD_CAST "switch-source", BAD_CAST(switch_source ? "yes" : "no"));
    xmlSetProp(root, BAD_CAST "delete-merged", BAD_CAST(delete_merged ? "yes" : "no"));
    xmlNewTextChild(root, nullptr, BAD_CAST "top", BAD_CAST top.c_str());
    xmlNewTextChild(root, nullptr, BAD_CAST "base", BAD_CAST base.c_str());
    for (const auto& m : merged) xmlNewTextChild(root, nullptr, BAD_CAST "merged", BAD_CAST m.c_str());
    for (const auto& n : snapshots) xmlNewTextChild(root, nullptr, BAD_CAST "snapshot", BAD_CAST n.c_str());
    xmlChar* out = nullptr;
    int len = 0;
    xmlDocDumpMemory(d.get(), &out, &len);
    // Without the XML declaration: libvirt wants one element.
    std::string x(reinterpret_cast<char*>(out), size_t(len));
    xmlFree(out);
    x.erase(0, x.find("<merge"));
    if (virDomainSetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, x.c_str(), kJournalKey, kJournalUri,
                             VIR_DOMAIN_AFFECT_CONFIG) != 0)
      throw Error(std::string("domain ") + virDomainGetName(dom),
                  "cannot record the merge journal in its definition (nothing written): " + last_libvirt_error());
  }

  static void remove(virDomainPtr dom) {
    if (virDomainSetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, nullptr, nullptr, kJournalUri,
                             VIR_DOMAIN_AFFECT_CONFIG) != 0)
      throw Error(std::string("domain ") + virDomainGetName(dom),
                  "merge done, but removing its journal from the definition failed: " + last_libvirt_error());
  }
};

qcow2::ChainOptions chain_options(const std::vector<std::string>& allowed_dirs) {
  qcow2::ChainOptions o;
  o.allowed_backing_dirs = allowed_dirs;
  return o;
}

// Refreshes `pool` once per merge so vol-list/vol-info show the files as they are now. A failure
// leaves the data merged and only libvirt's cached view stale: say so, naming the way out.
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

}  // namespace

DomainMergeResult merge_domain(DomainMergeRequest req, const std::function<void(const std::string&)>& note) {
  DomainMergeResult res;
  // libvirt's default handler prints every error to stderr, also those that are expected (no
  // merge journal in the definition); errors that matter reach the user through
  // last_libvirt_error() in the messages below.
  virSetErrorFunc(nullptr, [](void*, virErrorPtr) {});
  Conn conn(virConnectOpen(req.uri.c_str()));
  if (!conn) throw Error(req.uri, "cannot connect to libvirt: " + last_libvirt_error());

  // --- A volume of a pool as TOP (no domain) -------------------------------------------------
  if (req.domain.empty()) {
    if (req.pool.empty() || req.volume.empty()) throw Error("", "give --domain DOM --disk DEV, or --pool POOL --vol NAME");
    std::string top = volume_path(conn.get(), req.pool, req.volume);
    req.merge.top = top;
    if (req.base) req.merge.base = *req.base;
    res.top = top;
    if (req.dry_run) {
      res.plan = engine::plan_merge(req.merge);
      res.base = res.plan->base;
      res.would_delete = req.merge.delete_merged;
      return res;
    }
    if (req.make_governor) req.merge.governor = req.make_governor(top);
    res.merge = engine::merge(req.merge);
    res.base = res.merge.base;
    if (Pool p = find_pool(conn.get(), req.pool))
      refresh_pool(p.get(), res, note);
    else
      note("could not refresh storage pool " + req.pool + ": " + pool_lookup_error());
    // BASE may live in another pool (an overlay in a dir pool on a logical volume).
    refresh_pools_holding(conn.get(), res.base, res, note);
    return res;
  }

  // --- A shut-off domain's disk --------------------------------------------------------------
  Dom dom(virDomainLookupByName(conn.get(), req.domain.c_str()));
  if (!dom) throw Error("domain " + req.domain, "not found: " + last_libvirt_error());
  if (virDomainIsActive(dom.get()) == 1)
    throw Error("domain " + req.domain, "is running; merge its disks live with 'qcommit live " + req.domain +
                                            " " + req.disk + "' (or shut it off first)");
  auto read_disk_source = [&](Doc& doc) {
    CStr xml(virDomainGetXMLDesc(dom.get(), VIR_DOMAIN_XML_INACTIVE));
    if (!xml) throw Error("domain " + req.domain, "cannot read its definition: " + last_libvirt_error());
    doc = parse_xml(xml.get(), "domain " + req.domain);
    xmlNodePtr disk = find_domain_disk(doc.get(), req.disk);
    if (!disk) throw Error("domain " + req.domain, "has no disk with target '" + req.disk + "'");
    xmlNodePtr source = xml::child(disk, "source");
    std::string path = xml::attr(source, "file");
    if (path.empty()) path = xml::attr(source, "dev");
    if (path.empty() && !xml::attr(source, "volume").empty())
      path = volume_path(conn.get(), xml::attr(source, "pool"), xml::attr(source, "volume"));
    if (path.empty())
      throw Error("domain " + req.domain, "disk " + req.disk + " is not a file, block device or pool volume; cannot merge it offline");
    return std::pair{disk, path};
  };
  Doc doc;
  const std::string active = read_disk_source(doc).second;

  qcow2::Chain chain = qcow2::Chain::open(active, chain_options(req.merge.allowed_backing_dirs));
  std::vector<std::string> paths, layers;  // as the chain names them; canonical, for comparisons
  for (size_t i = 0; i < chain.depth(); ++i) {
    paths.push_back(chain.layer(i).path);
    layers.push_back(canonical(paths.back()));
  }
  auto index_of = [&](const std::string& p) -> std::optional<size_t> {
    auto it = std::find(layers.begin(), layers.end(), canonical(p));
    if (it == layers.end()) return std::nullopt;
    return size_t(it - layers.begin());
  };

  // What a dry run reports: the engine's read-only plan of the merge of layers ti..bi-1 into bi
  // (TOP's child, if any, rebased).
  auto plan_of = [&](size_t ti, size_t bi) {
    engine::MergeOptions m = req.merge;
    m.top = paths[ti];
    m.base = paths[bi];
    m.rebase.clear();
    if (ti > 0) m.rebase = {paths[ti - 1]};
    return engine::plan_merge(m);
  };

  // A journal left by an interrupted run takes precedence (one per domain: finish it first).
  Journal journal;
  if (journal.load(dom.get())) {
    if (journal.disk != req.disk)
      throw Error("domain " + req.domain, "has an interrupted merge of disk " + journal.disk +
                                              " to finish first: run this command with --disk " + journal.disk);
    res.finished_earlier_run = true;
    note("finishing an interrupted merge of " + journal.top + " into " + journal.base);
  }

  // Where the data stands: TOP still above BASE in the chain means the copy (or the switch of
  // the definition) has not happened; re-running the merge is safe either way (the engine
  // resumes from its checkpoint, or copies TOP's data again into a BASE that already holds it).
  std::optional<size_t> t, b;
  if (res.finished_earlier_run) {
    b = index_of(journal.base);
    if (!b)
      throw Error("domain " + req.domain, "its merge journal names BASE " + journal.base +
                                              ", which is not in the chain of disk " + req.disk + " (virsh metadata " +
                                              req.domain + " " + kJournalUri + " --config shows it)");
    t = index_of(journal.top);
    if (!t || *t >= *b) t.reset();  // data merged and TOP out of the chain
    res.top = journal.top;
    res.base = journal.base;
    if (req.dry_run) {
      if (t) res.plan = plan_of(*t, *b);
      res.would_update_definition = journal.switch_source;
      res.would_delete = journal.delete_merged;
      return res;
    }
  } else {
    t = req.top ? index_of(*req.top) : std::optional<size_t>(0);
    if (!t) throw Error(*req.top, "is not in the chain of domain " + req.domain + " disk " + req.disk);
    b = *t + 1;
    if (req.base) {
      b = index_of(*req.base);
      if (!b || *b <= *t) throw Error(*req.base, "is not below " + paths[*t] + " in the chain of domain " + req.domain);
    }
    if (*b >= paths.size()) throw Error(paths[*t], "has no backing file: nothing to merge into");
    res.top = paths[*t];
    res.base = paths[*b];

    // Snapshot metadata that points at merged files would describe states that no longer
    // exist: remove it the way `virsh snapshot-delete` of an external snapshot leaves things.
    // Decide before writing anything; refuse what cannot be kept consistent.
    virDomainSnapshotPtr* snaps = nullptr;
    const int ns = virDomainListAllSnapshots(dom.get(), &snaps, 0);
    std::vector<std::string> affected, problems;
    for (Snap& s : plugin::lv::take_list<Snap>(snaps, ns)) {
      CStr sx(virDomainSnapshotGetXMLDesc(s.get(), 0));
      if (!sx) continue;
      Doc sd = parse_xml(sx.get(), "snapshot");
      xmlNodePtr disks = xml::child(xmlDocGetRootElement(sd.get()), "disks");
      bool hit = false;
      for (xmlNodePtr d = disks ? disks->children : nullptr; d; d = d->next) {
        if (d->type != XML_ELEMENT_NODE || xml::attr(d, "name") != req.disk) continue;
        // The snapshot's overlay, or the state it captured (the overlay's backing file), merged.
        if (auto k = index_of(xml::attr(xml::child(d, "source"), "file")))
          hit = (*k >= *t && *k < *b) || (*k + 1 >= *t && *k + 1 <= *b);
      }
      if (!hit) continue;
      const std::string name = virDomainSnapshotGetName(s.get());
      xmlNodePtr memory = xml::child(xmlDocGetRootElement(sd.get()), "memory");
      if (memory && xml::attr(memory, "snapshot") == "external")
        problems.push_back("snapshot '" + name + "' has saved memory state that needs the merged disk state");
      affected.push_back(name);
    }
    if (!problems.empty()) {
      std::string all;
      for (auto& p : problems) all += (all.empty() ? "" : "; ") + p;
      throw Error("domain " + req.domain, "cannot keep the snapshot list consistent: " + all + " (nothing written)");
    }
    for (auto& s : affected) note("snapshot metadata to remove: " + s);

    if (req.dry_run) {
      res.plan = plan_of(*t, *b);
      res.would_update_definition = *t == 0;
      res.would_delete = req.merge.delete_merged;
      return res;
    }
    journal.disk = req.disk;
    journal.top = res.top;
    journal.base = res.base;
    journal.switch_source = *t == 0;
    journal.delete_merged = req.merge.delete_merged;
    journal.merged.assign(paths.begin() + long(*t), paths.begin() + long(*b));
    journal.snapshots = affected;
    journal.save(dom.get());
  }

  // Steps 2 to 4 change what a starting domain would run on (its snapshot list, its definition,
  // the files). They run while every image of the merge is locked the way QEMU locks images (a
  // QEMU that starts now cannot open TOP, BASE or TOP's child), and each one only after asking
  // libvirt again whether the domain is still shut off: it was checked once at the start, and
  // nothing stops anyone from starting it while the data is copied.
  auto ensure_inactive = [&] {
    const int running = virDomainIsActive(dom.get());
    if (running == 0) return;
    if (running == 1)
      throw Error("domain " + req.domain,
                  "was started during the merge; stopped before changing more (the data is merged): shut it "
                  "off and run the same command again to finish");
    throw Error("domain " + req.domain, "cannot tell whether it was started during the merge (" +
                                            last_libvirt_error() + "); run the same command again");
  };
  auto finish = [&](engine::MergeResult& merged) {
    test_kill_point("data-merged");

    // 2. Snapshot metadata of merged states (those an interrupted run removed are gone already).
    ensure_inactive();
    for (const auto& name : journal.snapshots) {
      Snap s(virDomainSnapshotLookupByName(dom.get(), name.c_str(), 0));
      if (!s) continue;
      if (virDomainSnapshotDelete(s.get(), VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY) == 0)
        res.snapshot_metadata_removed.push_back(name);
      else
        note("could not remove metadata of snapshot '" + name + "': " + last_libvirt_error());
    }
    test_kill_point("snapshots-removed");

    // 3. The definition: the disk runs on BASE when TOP was the active layer, and its
    // <backingStore> chain is the files' chain after the merge.
    ensure_inactive();
    {
      auto [disk, source_path] = read_disk_source(doc);
      const std::string new_active = journal.switch_source ? journal.base : source_path;
      qcow2::Chain after = qcow2::Chain::open(new_active, [&] {
        qcow2::ChainOptions o = chain_options(req.merge.allowed_backing_dirs);
        o.allowed_backing_dirs.push_back(fs::path(new_active).parent_path().string());
        return o;
      }());
      if (journal.switch_source) {
        set_source(disk, xml::child(disk, "source"), new_active);
        if (xmlNodePtr drv = xml::child(disk, "driver"))
          xmlSetProp(drv, BAD_CAST "type", BAD_CAST qcow2::to_string(after.top().format));
      }
      set_backing_store(disk, after);
      const std::string newxml = xml::dump(doc.get());
      Dom redefined(virDomainDefineXML(conn.get(), newxml.c_str()));
      if (!redefined)
        throw Error("domain " + req.domain, "merge done, but redefining the domain failed: " + last_libvirt_error() +
                                                "; run the same command again");
      res.definition_updated = true;
    }
    test_kill_point("defined");

    // 4. Merged files, now that the definition no longer names them. The engine locks TOP and
    // the intermediates for reading only, and lets others read them too: a process that opened
    // one so meanwhile (another domain's QEMU reading it as a backing file, a backup) would be
    // left on a deleted file. Nothing is deleted while any other process has one open.
    if (journal.delete_merged) {
      ensure_inactive();
      for (const auto& p : journal.merged) {
        const std::string holders = engine::describe_holders(p);
        if (!holders.empty())
          throw Error(p, "is open in " + holders + "; not deleted (the merge is done): close it and run the same "
                         "command again to delete it");
      }
      for (const auto& p : journal.merged) {
        std::error_code ec;
        if (fs::remove(p, ec)) merged.deleted.push_back(p);
      }
    }
  };

  // 1. Data. The engine runs steps 2 to 4 (finish) after the copy and the switch, with its locks
  // still held; it deletes nothing itself (the definition names TOP until step 3).
  if (t) {
    req.merge.top = paths[*t];
    req.merge.base = paths[*b];
    req.merge.rebase.clear();
    if (*t > 0) req.merge.rebase = {paths[*t - 1]};
    req.merge.delete_merged = false;
    if (req.make_governor) req.merge.governor = req.make_governor(paths[*b]);
    req.merge.on_checkpoint = [inner = req.merge.on_checkpoint](uint64_t done) {
      if (inner) inner(done);
      test_kill_point("data-window");
    };
    req.merge.while_locked = finish;
    res.merge = engine::merge(req.merge);
  } else {
    // The data was merged by an interrupted run: TOP's child (or the definition) is on BASE
    // already. The same locks as the engine's for the rest: BASE and the disk's active layer for
    // writing, and the merged files that are still there (about to be deleted).
    std::vector<engine::ImageLock> locks;
    std::vector<std::string> locked;  // canonical: one lock per file (OFD locks of one process conflict)
    auto lock = [&](const std::string& p) {
      struct stat st {};
      if (::stat(p.c_str(), &st) != 0) return;
      const std::string c = canonical(p);
      if (std::find(locked.begin(), locked.end(), c) != locked.end()) return;
      locks.push_back(engine::ImageLock::writer(p));
      locked.push_back(c);
    };
    lock(journal.base);
    lock(active);
    for (const auto& p : journal.merged) lock(p);
    finish(res.merge);
    // A kill between the engine's last step and its cleanup leaves its checkpoint: removed last.
    std::error_code ec;
    fs::remove(engine::checkpoint_path(journal.base), ec);
  }

  // Pools and journal: libvirt's view only, nothing a starting domain runs on.
  refresh_pools_holding(conn.get(), res.base, res, note);
  Journal::remove(dom.get());
  return res;
}

}  // namespace qcommit::cli
