// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/domain/domain_merge.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "engine/image_lock.h"
#include "plugin/domain/definition.h"
#include "plugin/hypervisor/libvirt_handles.h"
#include "plugin/host/xml.h"
#include "qcow2/chain.h"
#include "qcow2/error.h"

namespace qcommit::plugin {

namespace fs = std::filesystem;
using qcow2::Error;

namespace {

// --- RAII for libvirt and libxml2 handles ----------------------------------------------------
using Conn = lv::Conn;
using Dom = lv::Domain;
using Snap = lv::Snapshot;
using Pool = lv::Pool;
using CStr = lv::CString;
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

// The <disk> element of the domain XML `doc` whose <target dev=...> is `dev`.
xmlNodePtr find_domain_disk(xmlDocPtr doc, const std::string& dev) {
  for (xmlNodePtr d : xml::select(doc, "/domain/devices/disk"))
    if (xml::attr(xml::child(d, "target"), "dev") == dev) return d;
  return nullptr;
}

qcow2::ChainOptions chain_options(const std::vector<std::string>& allowed_dirs) {
  qcow2::ChainOptions o;
  o.allowed_backing_dirs = allowed_dirs;
  return o;
}

using Note = std::function<void(const std::string&)>;

// --- A volume of a pool as TOP (no domain) ---------------------------------------------------
DomainMergeResult merge_pool_volume(virConnectPtr conn, DomainMergeRequest& req, const Note& note) {
  if (req.pool.empty() || req.volume.empty())
    throw Error("", "give --domain DOM --disk DEV, or --pool POOL --vol NAME");
  DomainMergeResult res;
  const std::string top = volume_path(conn, req.pool, req.volume);
  req.merge.top = top;
  if (req.base) req.merge.base = *req.base;
  res.top = top;
  if (req.dry_run) {
    res.plan = engine::plan_merge(req.merge);
    res.base = res.plan->base;
    res.would_delete = req.merge.delete_merged;
    return res;
  }
  if (req.make_governor) req.merge.governor = req.make_governor(top, {});
  res.merge = engine::merge(req.merge);
  res.base = res.merge.base;
  if (Pool p = find_pool(conn, req.pool))
    refresh_pool(p.get(), res, note);
  else
    note("could not refresh storage pool " + req.pool + ": " + pool_lookup_error());
  // BASE may live in another pool (an overlay in a dir pool on a logical volume).
  refresh_pools_holding(conn, res.base, res, note);
  return res;
}

// --- A shut-off domain's disk ----------------------------------------------------------------

// How often a domain that is shutting down is asked whether it is shut off yet.
constexpr std::chrono::milliseconds kShutdownRecheckInterval{100};

// Where a domain stands, from one look at libvirt's state (state and activity asked apart could
// disagree while it goes down).
enum class Power { kOff, kGoingDown, kOn };

[[nodiscard]] Power power(virDomainPtr dom) {
  int state = 0, reason = 0;
  if (virDomainGetState(dom, &state, &reason, 0) == 0) {
    if (state == VIR_DOMAIN_SHUTOFF) return Power::kOff;
    // "in shutdown", or paused on the way there.
    if (state == VIR_DOMAIN_SHUTDOWN ||
        (state == VIR_DOMAIN_PAUSED && reason == VIR_DOMAIN_PAUSED_SHUTTING_DOWN))
      return Power::kGoingDown;
  }
  return virDomainIsActive(dom) == 1 ? Power::kOn : Power::kOff;
}

// The merge of a shut-off domain's disk chain, one step per member, in the order run() calls
// them:
//   open_domain      the domain, shut off (one that is shutting down is waited for)
//   open_chain       the disk's chain, as its definition names it
//   resume_journal   an interrupted run's journal, which takes precedence, or else
//   choose_layers    TOP and BASE from the request, and the snapshot metadata to remove
//   (journal save)   the journal, into the definition, before the first write
//   merge_data       the engine's copy, running finish() with its locks still held; or, when an
//   finish_locked    interrupted run merged the data already, finish() under locks of our own
//   finish           snapshot metadata, definition, merged files (each after ensure_inactive)
// then the pools are refreshed and the journal removed.
class DomainMerge {
 public:
  DomainMerge(virConnectPtr conn, DomainMergeRequest& req, const Note& note)
      : conn_(conn), req_(req), note_(note), where_("domain " + req.domain) {}

  [[nodiscard]] DomainMergeResult run() {
    open_domain();
    open_chain();
    if (!resume_journal()) choose_layers();
    if (req_.dry_run) return dry_run();
    if (!res_.finished_earlier_run) journal_.save(dom_.get());
    if (t_)
      merge_data();
    else
      finish_locked();
    // Pools and journal: libvirt's view only, nothing a starting domain runs on.
    refresh_pools_holding(conn_, res_.base, res_, note_);
    MergeJournal::remove(dom_.get());
    return std::move(res_);
  }

 private:
  void open_domain();
  void wait_until_shut_off();
  [[nodiscard]] std::pair<xmlNodePtr, std::string> read_disk_source();
  void open_chain();
  [[nodiscard]] std::optional<size_t> index_of(const std::string& p) const;
  [[nodiscard]] bool resume_journal();
  void choose_layers();
  [[nodiscard]] std::vector<std::string> snapshots_to_remove() const;
  [[nodiscard]] engine::MergePlan plan_of(size_t ti, size_t bi) const;
  [[nodiscard]] DomainMergeResult dry_run();
  void ensure_inactive() const;
  void merge_data();
  void finish_locked();
  void finish(engine::MergeResult& merged);
  void remove_snapshot_metadata();
  void redefine_disk();
  void delete_merged_files(engine::MergeResult& merged);

  virConnectPtr conn_;
  DomainMergeRequest& req_;
  const Note& note_;
  const std::string where_;  // "domain NAME", what errors name
  Dom dom_;
  Doc doc_;                                  // the domain's inactive definition, as last read
  std::string active_;                       // the disk's active layer
  std::vector<std::string> paths_, layers_;  // its chain as named; canonical, for comparisons
  std::optional<size_t> t_, b_;  // TOP (none once an interrupted run merged it) and BASE in it
  MergeJournal journal_;
  DomainMergeResult res_;
};

void DomainMerge::open_domain() {
  dom_.reset(virDomainLookupByName(conn_, req_.domain.c_str()));
  if (!dom_) throw Error(where_, "not found: " + last_libvirt_error());
  wait_until_shut_off();
}

// A running domain is refused at once; one that is shutting down is waited for, up to the
// request's lock_wait (--wait), and the wait said once through on_lock_wait. A domain that comes
// back to running meanwhile (a reboot) is refused like one that never stopped.
void DomainMerge::wait_until_shut_off() {
  const engine::LockClock::duration wait = req_.merge.lock_wait;
  const auto deadline = engine::deadline_after(engine::LockClock::now(), wait);
  bool told = false;
  for (Power p = power(dom_.get()); p != Power::kOff; p = power(dom_.get())) {
    if (p == Power::kOn)
      throw Error(where_, "is running; merge its disks live with 'qcommit live " + req_.domain +
                              " " + req_.disk + "' (or shut it off first)");
    const auto now = engine::LockClock::now();
    if (now >= deadline)
      throw Error(where_, told
                              ? "is still shutting down after " + engine::wait_duration_text(wait) +
                                    " (--wait); run the same command again once it is shut off"
                              : "is shutting down (--wait 0: not waited for); run the same "
                                "command again once it is shut off");
    if (!told && req_.merge.on_lock_wait) {
      engine::WaitNotice n;
      n.what = engine::WaitFor::kDomainShutdown;
      n.message = "waiting up to " + engine::wait_duration_text(wait) + " for domain " +
                  req_.domain + " to shut off (it is shutting down)";
      n.timeout = wait;
      n.domain = req_.domain;
      req_.merge.on_lock_wait(n);
    }
    told = true;
    std::this_thread::sleep_for(
        std::min<engine::LockClock::duration>(kShutdownRecheckInterval, deadline - now));
  }
}

// The <disk> of the request in the domain's inactive definition (read anew into doc_), and the
// path of its active layer.
std::pair<xmlNodePtr, std::string> DomainMerge::read_disk_source() {
  CStr text(virDomainGetXMLDesc(dom_.get(), VIR_DOMAIN_XML_INACTIVE));
  if (!text) throw Error(where_, "cannot read its definition: " + last_libvirt_error());
  doc_ = parse_xml(text.get(), where_);
  const xmlNodePtr disk = find_domain_disk(doc_.get(), req_.disk);
  if (!disk) throw Error(where_, "has no disk with target '" + req_.disk + "'");
  const xmlNodePtr source = xml::child(disk, "source");
  std::string path = xml::attr(source, "file");
  if (path.empty()) path = xml::attr(source, "dev");
  if (path.empty() && !xml::attr(source, "volume").empty())
    path = volume_path(conn_, xml::attr(source, "pool"), xml::attr(source, "volume"));
  if (path.empty())
    throw Error(where_, "disk " + req_.disk +
                            " is not a file, block device or pool volume; cannot merge it offline");
  return {disk, path};
}

void DomainMerge::open_chain() {
  active_ = read_disk_source().second;
  const qcow2::Chain chain =
      qcow2::Chain::open(active_, chain_options(req_.merge.allowed_backing_dirs));
  for (size_t i = 0; i < chain.depth(); ++i) {
    paths_.push_back(chain.layer(i).path);
    layers_.push_back(canonical_path(paths_.back()));
  }
}

std::optional<size_t> DomainMerge::index_of(const std::string& p) const {
  const auto it = std::find(layers_.begin(), layers_.end(), canonical_path(p));
  if (it == layers_.end()) return std::nullopt;
  return size_t(it - layers_.begin());
}

// A journal left by an interrupted run takes precedence (one per domain: finish it first). Where
// the data stands: TOP still above BASE in the chain means the copy (or the switch of the
// definition) has not happened; re-running the merge is safe either way (the engine resumes from
// its checkpoint, or copies TOP's data again into a BASE that already holds it).
bool DomainMerge::resume_journal() {
  if (!journal_.load(dom_.get())) return false;
  if (journal_.disk != req_.disk)
    throw Error(where_, "has an interrupted merge of disk " + journal_.disk +
                            " to finish first: run this command with --disk " + journal_.disk);
  res_.finished_earlier_run = true;
  note_("finishing an interrupted merge of " + journal_.top + " into " + journal_.base);
  b_ = index_of(journal_.base);
  if (!b_)
    throw Error(where_, "its merge journal names BASE " + journal_.base +
                            ", which is not in the chain of disk " + req_.disk +
                            " (virsh metadata " + req_.domain + " " + kJournalUri +
                            " --config shows it)");
  t_ = index_of(journal_.top);
  if (!t_ || *t_ >= *b_) t_.reset();  // data merged and TOP out of the chain
  res_.top = journal_.top;
  res_.base = journal_.base;
  return true;
}

// TOP and BASE as the request names them (TOP: the active layer, BASE: TOP's backing file, by
// default), and the journal of this merge.
void DomainMerge::choose_layers() {
  t_ = req_.top ? index_of(*req_.top) : std::optional<size_t>(0);
  if (!t_)
    throw Error(*req_.top, "is not in the chain of domain " + req_.domain + " disk " + req_.disk);
  b_ = *t_ + 1;
  if (req_.base) {
    b_ = index_of(*req_.base);
    if (!b_ || *b_ <= *t_)
      throw Error(*req_.base,
                  "is not below " + paths_[*t_] + " in the chain of domain " + req_.domain);
  }
  if (*b_ >= paths_.size()) throw Error(paths_[*t_], "has no backing file: nothing to merge into");
  res_.top = paths_[*t_];
  res_.base = paths_[*b_];
  journal_.disk = req_.disk;
  journal_.top = res_.top;
  journal_.base = res_.base;
  journal_.switch_source = *t_ == 0;
  journal_.delete_merged = req_.merge.delete_merged;
  journal_.merged.assign(paths_.begin() + long(*t_), paths_.begin() + long(*b_));
  journal_.snapshots = snapshots_to_remove();
}

// Snapshot metadata that points at merged files would describe states that no longer exist:
// removed the way `virsh snapshot-delete` of an external snapshot leaves things. Decided before
// anything is written; what cannot be kept consistent is refused.
std::vector<std::string> DomainMerge::snapshots_to_remove() const {
  virDomainSnapshotPtr* snaps = nullptr;
  const int ns = virDomainListAllSnapshots(dom_.get(), &snaps, 0);
  std::vector<std::string> affected, problems;
  for (Snap& s : lv::take_list<Snap>(snaps, ns)) {
    CStr sx(virDomainSnapshotGetXMLDesc(s.get(), 0));
    if (!sx) continue;
    const Doc sd = parse_xml(sx.get(), "snapshot");
    bool hit = false;
    for (const xmlNodePtr d : xml::children(xml::child(xml::root(sd.get()), "disks"))) {
      if (xml::attr(d, "name") != req_.disk) continue;
      // The snapshot's overlay, or the state it captured (the overlay's backing file), merged.
      if (auto k = index_of(xml::attr(xml::child(d, "source"), "file")))
        hit = (*k >= *t_ && *k < *b_) || (*k + 1 >= *t_ && *k + 1 <= *b_);
    }
    if (!hit) continue;
    const std::string name = virDomainSnapshotGetName(s.get());
    const xmlNodePtr memory = xml::child(xml::root(sd.get()), "memory");
    if (memory && xml::attr(memory, "snapshot") == "external")
      problems.push_back("snapshot '" + name +
                         "' has saved memory state that needs the merged disk state");
    affected.push_back(name);
  }
  if (!problems.empty()) {
    std::string all;
    for (auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    throw Error(where_, "cannot keep the snapshot list consistent: " + all + " (nothing written)");
  }
  for (auto& s : affected) note_("snapshot metadata to remove: " + s);
  return affected;
}

// The engine's read-only plan of the merge of layers ti..bi-1 into bi (TOP's child, if any,
// rebased).
engine::MergePlan DomainMerge::plan_of(size_t ti, size_t bi) const {
  engine::MergeOptions m = req_.merge;
  m.top = paths_[ti];
  m.base = paths_[bi];
  m.rebase.clear();
  if (ti > 0) m.rebase = {paths_[ti - 1]};
  return engine::plan_merge(m);
}

// What a dry run reports; nothing is written.
DomainMergeResult DomainMerge::dry_run() {
  if (t_) res_.plan = plan_of(*t_, *b_);
  res_.would_update_definition = journal_.switch_source;
  res_.would_delete = journal_.delete_merged;
  return std::move(res_);
}

// The steps after the copy change what a starting domain would run on (its snapshot list, its
// definition, the files). They run while every image of the merge is locked the way QEMU locks
// images (a QEMU that starts now cannot open TOP, BASE or TOP's child), and each one only after
// asking libvirt again whether the domain is still shut off: it was checked once at the start,
// and nothing stops anyone from starting it while the data is copied.
void DomainMerge::ensure_inactive() const {
  const int running = virDomainIsActive(dom_.get());
  if (running == 0) return;
  if (running == 1)
    throw Error(where_,
                "was started during the merge; stopped before changing more (the data is "
                "merged): shut it off and run the same command again to finish");
  throw Error(where_, "cannot tell whether it was started during the merge (" +
                          last_libvirt_error() + "); run the same command again");
}

// The data. The engine runs finish() after the copy and the switch, with its locks still held;
// it deletes nothing itself (the definition names TOP until the definition is updated).
void DomainMerge::merge_data() {
  engine::MergeOptions& m = req_.merge;
  m.top = paths_[*t_];
  m.base = paths_[*b_];
  m.rebase.clear();
  if (*t_ > 0) m.rebase = {paths_[*t_ - 1]};
  m.delete_merged = false;
  if (req_.make_governor) m.governor = req_.make_governor(paths_[*t_], paths_[*b_]);
  m.on_checkpoint = [inner = m.on_checkpoint](uint64_t done) {
    if (inner) inner(done);
    test_kill_point("data-window");
  };
  m.while_locked = [this](engine::MergeResult& merged) { finish(merged); };
  res_.merge = engine::merge(m);
}

// The data was merged by an interrupted run: TOP's child (or the definition) is on BASE already.
// The same locks as the engine's for the rest: BASE and the disk's active layer for writing, and
// the merged files that are still there (about to be deleted).
void DomainMerge::finish_locked() {
  std::vector<engine::ImageLock> locks;
  std::vector<std::string> locked;  // canonical: one lock per file (OFD locks of one process conflict)
  auto lock = [&](const std::string& p) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return;
    const std::string c = canonical_path(p);
    if (std::find(locked.begin(), locked.end(), c) != locked.end()) return;
    locks.push_back(engine::ImageLock::writer(p));
    locked.push_back(c);
  };
  lock(journal_.base);
  lock(active_);
  for (const auto& p : journal_.merged) lock(p);
  finish(res_.merge);
  // A kill between the engine's last step and its cleanup leaves its checkpoint: removed last.
  std::error_code ec;
  fs::remove(engine::checkpoint_path(journal_.base), ec);
}

void DomainMerge::finish(engine::MergeResult& merged) {
  test_kill_point("data-merged");
  remove_snapshot_metadata();
  test_kill_point("snapshots-removed");
  redefine_disk();
  test_kill_point("defined");
  if (journal_.delete_merged) delete_merged_files(merged);
}

// Snapshot metadata of merged states (those an interrupted run removed are gone already).
void DomainMerge::remove_snapshot_metadata() {
  ensure_inactive();
  for (const auto& name : journal_.snapshots) {
    Snap s(virDomainSnapshotLookupByName(dom_.get(), name.c_str(), 0));
    if (!s) continue;
    if (virDomainSnapshotDelete(s.get(), VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY) == 0)
      res_.snapshot_metadata_removed.push_back(name);
    else
      note_("could not remove metadata of snapshot '" + name + "': " + last_libvirt_error());
  }
}

// The definition: the disk runs on BASE when TOP was the active layer, and its <backingStore>
// chain is the files' chain after the merge.
void DomainMerge::redefine_disk() {
  ensure_inactive();
  auto [disk, source_path] = read_disk_source();
  const std::string new_active = journal_.switch_source ? journal_.base : source_path;
  qcow2::ChainOptions o = chain_options(req_.merge.allowed_backing_dirs);
  o.allowed_backing_dirs.push_back(fs::path(new_active).parent_path().string());
  qcow2::Chain after = qcow2::Chain::open(new_active, o);
  if (journal_.switch_source) {
    set_source(disk, xml::child(disk, "source"), new_active);
    if (const xmlNodePtr drv = xml::child(disk, "driver"))
      xml::set_attr(drv, "type", qcow2::to_string(after.top().format));
  }
  set_backing_store(disk, after);
  const std::string definition = xml::dump(doc_.get());
  Dom redefined(virDomainDefineXML(conn_, definition.c_str()));
  if (!redefined)
    throw Error(where_, "merge done, but redefining the domain failed: " + last_libvirt_error() +
                            "; run the same command again");
  res_.definition_updated = true;
}

// Merged files, now that the definition no longer names them. The engine locks TOP and the
// intermediates for reading only, and lets others read them too: a process that opened one so
// meanwhile (another domain's QEMU reading it as a backing file, a backup) would be left on a
// deleted file. Nothing is deleted while any other process has one open.
void DomainMerge::delete_merged_files(engine::MergeResult& merged) {
  ensure_inactive();
  for (const auto& p : journal_.merged) {
    const std::string holders = engine::describe_holders(p);
    if (!holders.empty())
      throw Error(p, "is open in " + holders +
                         "; not deleted (the merge is done): close it and run the same command "
                         "again to delete it");
  }
  for (const auto& p : journal_.merged) {
    std::error_code ec;
    if (fs::remove(p, ec))
      merged.deleted.push_back(p);
    else if (ec)  // never passed over silently: the merge then exits 4 naming it
      merged.not_deleted.push_back({p, ec.message()});
  }
}

}  // namespace

DomainMergeResult merge_domain(DomainMergeRequest req, const Note& note) {
  // libvirt's default handler prints every error to stderr, also those that are expected (no
  // merge journal in the definition); errors that matter reach the user through
  // last_libvirt_error() in the messages.
  virSetErrorFunc(nullptr, [](void*, virErrorPtr) {});
  Conn conn(virConnectOpen(req.uri.c_str()));
  if (!conn) throw Error(req.uri, "cannot connect to libvirt: " + last_libvirt_error());
  if (req.domain.empty()) return merge_pool_volume(conn.get(), req, note);
  return DomainMerge(conn.get(), req, note).run();
}

}  // namespace qcommit::plugin
