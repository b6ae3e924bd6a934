// SPDX-License-Identifier: GPL-2.0-or-later
#include "engine/merge.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "engine/base_fingerprint.h"
#include "engine/cached_pages.h"
#include "engine/checkpoint.h"
#include "engine/merge_checks.h"
#include "engine/copy_pool.h"
#include "engine/image_lock.h"
#include "engine/node_wait.h"
#include "engine/proc_walk.h"
#include "engine/rebase.h"
#include "engine/storage_kind.h"
#include "engine/window_copier.h"
#include "qcow2/chain.h"
#include "qcow2/check.h"
#include "qcow2/error.h"
#include "qcow2/unique_fd.h"
#include "qcow2/writer.h"

namespace qcommit::engine {

namespace fs = std::filesystem;
using qcow2::Chain;
using qcow2::Error;
using qcow2::Format;
using qcow2::IoError;
using qcow2::MapEntry;

namespace {

// Same inode, or the same block device through two nodes (/dev/vg/lv, /dev/mapper/vg-lv).
// Not fs::equivalent: libstdc++'s refuses device files (ENOTSUP), so a BASE on a logical volume
// or loop device was "not in the backing chain".
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  if (S_ISBLK(sa.st_mode) && S_ISBLK(sb.st_mode)) return sa.st_rdev == sb.st_rdev;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// BASE as the result names it: as QEMU names it, unless that name has "." or ".." components
// ("vms/../templates/base.qcow2"), then the path the kernel resolved (as `qcommit info` shows
// it). A block device keeps its name (/dev/vg/lv, not the /dev/dm-N it leads to).
std::string display_name(const qcow2::Layer& layer) {
  for (const auto& part : fs::path(layer.path))
    if ((part == "." || part == "..") && !layer.real_path.empty() && !layer.real_path.starts_with("/dev/"))
      return layer.real_path;
  return layer.path;
}

// Where a re-run of the merge a checkpoint belongs to may go on from: the checkpoint's offset if
// BASE is still in the state that the commits up to it left (engine/base_fingerprint.h), else 0:
// BASE was replaced, rolled back or restored since, and the copy starts over.
uint64_t resumable_offset(const Checkpoint& cp, const qcow2::Layer& base) {
  if (cp.done == 0 || cp.base_state != base_fingerprint(base, cp.done)) return 0;
  return cp.done;
}

// Which merge a checkpoint belongs to: the layers above BASE (as they are now) and BASE.
std::string merge_identity(Chain& chain, size_t base_depth) {
  std::string identity;
  for (size_t i = 0; i < base_depth; ++i) identity += layer_identity(chain.layer(i).path) + " | ";
  return identity + fs::weakly_canonical(chain.layer(base_depth).path).string();
}

// Where BASE is in TOP's chain (opened read-only with the options' backing directories).
size_t base_depth_in(Chain& chain, const MergeOptions& opt) {
  if (chain.depth() < 2) throw Error(opt.top, "image has no backing file: nothing to merge into");
  if (!opt.base) return 1;
  for (size_t i = 1; i < chain.depth(); ++i)
    if (same_file(chain.layer(i).path, *opt.base)) return i;
  throw Error(*opt.base, "is not in the backing chain of " + opt.top);
}

// The extents the layers above BASE provide, from guest offset `from` on, merged like qemu-img map.
std::vector<MapEntry> extents_above(Chain& chain, size_t base_depth, uint64_t from, uint64_t& total) {
  const uint64_t top_size = chain.virtual_size();
  std::vector<MapEntry> extents;
  total = 0;
  for (uint64_t off = from; off < top_size;) {
    MapEntry e = chain.status(off, top_size - off, 0, base_depth);
    off += e.length;
    if (!e.data && !e.zero) continue;  // BASE (or below) provides it
    if (!extents.empty() && qcow2::mergeable(extents.back(), e))
      extents.back().length += e.length;
    else
      extents.push_back(e);
    total += e.length;
  }
  return extents;
}

// Grows BASE to `new_size` so that nothing TOP shows changes, at any instant. Past BASE's end
// TOP reads zeros (QEMU reads nothing from a backing file past its end); once BASE is larger, its
// unallocated grown clusters would read BASE's own backing file instead, and TOP (and a re-run's
// plan, which takes them as provided by BASE) would see that file's bytes. So, as QEMU does when
// it grows an image that has a backing file, the part of the grown range that BASE's backing file
// covers is made to read as zeros in the same commit that grows BASE: the writer puts the zero
// flags (zero data on v2) in L2 tables that are durable before the header names the new size.
// Ranges the layers above BASE provide data for are left alone: TOP shows its own data there,
// and the copy (or a re-run's) writes them. A raw BASE has no backing file: truncate reads zeros.
// Returns the bytes made to read as zeros.
uint64_t grow_base(Chain& chain, size_t base_depth, qcow2::Writer* writer, uint64_t new_size,
                   const std::vector<MapEntry>& extents_above_base) {
  qcow2::Layer& base = chain.layer(base_depth);
  const uint64_t old_size = base.virtual_size();
  if (!writer) {
    base.raw->truncate(new_size);
    return 0;
  }
  writer->grow(new_size);
  const uint64_t below_size = chain.depth() > base_depth + 1 ? chain.layer(base_depth + 1).virtual_size() : 0;
  const uint64_t shadow_end = std::min(new_size, below_size);  // where BASE's backing file shows
  uint64_t zeroed = 0;
  qcow2::ViewReader base_view = [&](uint64_t o, std::span<uint8_t> out) { chain.read(o, out, base_depth); };
  auto zero = [&](uint64_t from, uint64_t to) {
    if (from >= to) return;
    writer->write_zeroes(from, to - from, base_view);
    zeroed += to - from;
  };
  uint64_t pos = old_size;
  for (const MapEntry& e : extents_above_base) {
    if (pos >= shadow_end) break;
    if (!e.data) continue;  // zero extents are zeroed here too: they must read as zeros anyway
    const uint64_t s = e.start, t = e.start + e.length;
    if (t <= pos) continue;
    zero(pos, std::min(s, shadow_end));
    pos = std::max(pos, t);
  }
  zero(pos, shadow_end);
  writer->commit();
  return zeroed;
}

// `merge TOP --base BASE --delete` again after a run that stopped while deleting the merged layers
// (TOP first): TOP is gone, and BASE's checkpoint, written by this user, lists TOP among the names
// being deleted. TOP's view can no longer be compared with BASE's, so the rest are deleted under
// this rule, and only under it:
//   - the list was written only after verify_base_holds_view() found BASE showing TOP's view, in a
//     run holding every lock: BASE held TOP's data when TOP went;
//   - what is left (intermediates, a symlink's target) shows nothing to anyone but through TOP,
//     unless another image or a domain uses it: asked again (find_layer_users), such a layer is
//     left in place and reported;
//   - each file left must still be the layer recorded (check_left_are_merged_layers);
//   - BASE must still be consistent (check_base_consistent).
// A refusal names the file, deletes nothing and keeps the checkpoint. Nothing else is trusted
// from a checkpoint to decide what to delete.
std::optional<MergeResult> finish_interrupted_delete(const MergeOptions& opt) {
  struct stat st {};
  if (!opt.delete_merged || !opt.base || ::lstat(opt.top.c_str(), &st) == 0 || errno != ENOENT) return std::nullopt;
  const std::string cp_path = checkpoint_path(*opt.base);
  const auto cp = load_checkpoint(cp_path);
  const std::string top = fs::absolute(opt.top).string();
  if (!cp || std::find(cp->deleting.begin(), cp->deleting.end(), top) == cp->deleting.end()) return std::nullopt;
  std::vector<std::string> left;
  for (const auto& p : cp->deleting)
    if (::lstat(p.c_str(), &st) == 0) left.push_back(p);
  check_left_are_merged_layers(*cp, left);
  check_base_consistent(*opt.base);
  MergeResult res;
  res.top = opt.top;
  res.base = *opt.base;
  res.resumed = true;
  res.resumed_from = cp->done;
  LayerUserQuery q{left, {*opt.base}};
  q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
  if (const auto users = find_layer_users(q, opt.find_users); !users.empty()) {
    for (const auto& p : left) res.not_deleted.push_back({p, "still used by " + describe_users(users)});
    return res;
  }
  unlink_names(left, res.deleted, res.not_deleted, opt.on_write_point);
  if (!res.not_deleted.empty()) return res;  // the checkpoint lists what is left
  if (opt.on_write_point) opt.on_write_point("checkpoint");
  remove_checkpoint(cp_path);
  return res;
}

}  // namespace

std::string MergeOptions::validate() const {
  if (top.empty()) return "no TOP image given";
  if (io_threads == 0 || io_threads > 64) return "io_threads must be 1..64";
  if (inflight_bytes < kChunkBytes) return "inflight_bytes must be at least one chunk (2 MiB)";
  if (window_bytes < kChunkBytes) return "window_bytes must be at least 2 MiB";
  return "";
}

namespace {

// One merge, as named steps over the state they share. Steps run in the order of run(); nothing is
// written before begin_checkpoint().
class MergeJob {
 public:
  explicit MergeJob(const MergeOptions& options) : opt(options) { res.top = opt.top; }

  MergeResult run() {
    lock_chain();
    find_checkpoint();
    prepare_children();
    refuse_orphaning_delete();
    plan_and_check();
    refuse_before_writing();
    report_resume();
    if (opt.governor) opt.governor->begin(Clock::now());
    try {
      open_base_writer();
      begin_checkpoint();
      remove_base_bitmaps();  // first: bitmap metadata found inconsistent refuses before BASE grows
      grow_base_to_top();
      copy();
      switch_children();
      finish();
    } catch (const std::exception& e) {
      if (!out_of_space(e)) throw;
      throw_no_space(e);
    }
    return res;
  }

 private:
  void progress(const Progress& p) {
    if (opt.on_progress) opt.on_progress(p);
  }
  void point(std::string_view name) {
    if (opt.on_write_point) opt.on_write_point(name);
  }

  // 1-2. Finds BASE in TOP's chain (read-only) and takes the locks: nobody writes TOP and the
  // intermediates, nobody uses BASE. Everything the merge uses is then read again under the locks
  // (a QEMU that wrote TOP and exited in between leaves the first reading stale), BASE from its
  // storage when an interrupted run left a checkpoint (drop_cached_pages).
  void lock_chain() {
    std::vector<std::string> locked_paths;
    {
      qcow2::ChainOptions popts;
      popts.allowed_backing_dirs = opt.allowed_backing_dirs;
      popts.await_missing = node_waiter();
      Chain probe = Chain::open(opt.top, popts);
      base_depth = base_depth_in(probe, opt);
      for (size_t i = 0; i <= base_depth; ++i) {
        locked_paths.push_back(probe.layer(i).path);
        const std::string& path = probe.layer(i).path;
        locks.push_back(i < base_depth ? ImageLock::reader(path, opt.lock_wait, opt.on_lock_wait)
                                       : ImageLock::writer(path, opt.lock_wait, opt.on_lock_wait));
      }
    }
    if (fs::exists(checkpoint_path(locked_paths[base_depth]))) drop_cached_pages(locked_paths[base_depth]);
    qcow2::ChainOptions copts;
    copts.writable_depth = base_depth;
    copts.allowed_backing_dirs = opt.allowed_backing_dirs;
    chain.emplace(Chain::open(opt.top, copts));
    for (size_t i = 0; i <= base_depth; ++i)
      if (chain->depth() <= i || !same_file(chain->layer(i).path, locked_paths[i]))
        throw Error(opt.top, "its backing chain changed while the merge took its locks; run it again");
    for (size_t i = 0; i < base_depth; ++i) res.merged_layers.push_back(chain->layer(i).path);
    base = &chain->layer(base_depth);
    res.base = display_name(*base);
    top_size = chain->virtual_size();
  }

  // BASE's storage is full: what is left to write from the checkpoint on (BASE's tables as they
  // are on disk, the room an interrupted run leaves in its file) and what is free now. The
  // estimate is best effort: without it the error still names BASE and the way to resume.
  [[noreturn]] void throw_no_space(const std::exception& e) {
    std::optional<uint64_t> from;
    try {
      if (const auto cp = load_checkpoint(cp_path); cp && cp->identity == identity) from = cp->done;
    } catch (const std::exception&) {
    }
    SpaceNeed need;
    try {
      uint64_t bytes = 0;
      need = space_need_on_disk(*chain, base_depth,
                                extents_above(*chain, base_depth, from.value_or(0), bytes));
    } catch (const std::exception&) {
    }
    const auto* io = dynamic_cast<const IoError*>(&e);
    const auto* err = dynamic_cast<const Error*>(&e);
    const std::string cause =
        err ? (err->file() == base->path ? err->problem() : err->what()) : e.what();
    throw NoSpaceError(base->path, cause, io ? io->error_number() : ENOSPC, need, from);
  }

  // A backing file under /dev/ that does not exist yet (udev still creating an LV's node) is
  // waited for until the --wait budget, counted from the start of the merge, is spent.
  [[nodiscard]] std::function<bool(const std::string&)> node_waiter() const {
    if (opt.lock_wait <= Duration::zero()) return nullptr;
    const LockClock::time_point deadline = deadline_after(LockClock::now(), opt.lock_wait);
    return [this, deadline](const std::string& path) {
      return wait_for_node(path, deadline, opt.on_lock_wait);
    };
  }

  // 3. The checkpoint of an interrupted run of this same merge (same layers, same BASE).
  void find_checkpoint() {
    identity = merge_identity(*chain, base_depth);
    cp_path = checkpoint_path(base->path);
    old_cp = load_checkpoint(cp_path);
    resuming = old_cp && old_cp->identity == identity;
    resume_from = resuming ? resumable_offset(*old_cp, *base) : 0;
    res.base_changed = resuming && old_cp->done > 0 && resume_from == 0;
    res.resumed = resuming;
    res.resumed_from = resume_from;
  }

  // Each child is locked, opened for writing and its new backing name decided before anything is
  // written: a child that cannot be rebased (dirty, corrupt, read-only) stops the merge here, not
  // after the copy. The switch then writes through these same openings.
  void prepare_children() {
    for (const auto& child : opt.rebase) {
      qcow2::ChainOptions cho;
      cho.allowed_backing_dirs = opt.allowed_backing_dirs;
      cho.allowed_backing_dirs.push_back(fs::absolute(child).parent_path().string());
      Chain c = Chain::open(child, cho);
      // Already on BASE: rebased by this merge before it was interrupted (its checkpoint is there
      // until every child is done); rebased again, it stays the same.
      const bool rebased_before = resuming && c.depth() >= 2 && same_file(c.layer(1).path, base->path);
      if (!rebased_before && (c.depth() < 2 || !same_file(c.layer(1).path, chain->layer(0).path)))
        throw Error(child, "its backing file is not " + opt.top + "; refusing to rebase it");
      locks.push_back(ImageLock::writer(child, opt.lock_wait, opt.on_lock_wait));
      // Read again under the lock: what the child allocates decides what it is given as zeros.
      children.push_back(prepare_rebase(child, cho, rebased_before, *chain, base_depth));
    }
  }

  // 4. Plan: the extents the layers above BASE provide (with the original sizes), while the layers
  // are checked. The check reads every table of each layer, in its own thread on its own read-only
  // opening; nothing is written before its verdict. rand1t (1 TiB TOP, 2048 L2 tables): check
  // ~135 ms, planning ~110 ms.
  void plan_and_check() {
    const std::vector<std::string> to_check = layers_to_check(*chain, base_depth, old_cp.has_value());
    auto checked = std::async(std::launch::async, [&to_check, this] { check_layers(to_check, base->path); });
    progress({0, 0, seconds_since(t_start), 0, "plan"});
    try {
      extents = extents_above(*chain, base_depth, resume_from, total);
    } catch (...) {
      checked.get();  // a corrupt layer is reported as the check found it
      throw;
    }
    checked.get();  // throws if a layer is corrupt: nothing written yet
  }

  // 5. Every other refusal the merge can know of, before its first write.
  void refuse_before_writing() { engine::refuse_before_writing(*base, top_size); }

  void report_resume() {
    if (!resuming) return;
    Progress p{0, total, seconds_since(t_start), 0, "resume"};
    p.resume_offset = resume_from;
    progress(p);
  }

  // BASE's writer, after repairing what an interrupted run or lazy refcounts left.
  void open_base_writer() {
    if (!base->qcow2) return;
    qcow2::Image& img = *base->qcow2;
    if (img.dirty() || old_cp) {
      auto r = qcow2::check(img, img.dirty() ? qcow2::Repair::kAll : qcow2::Repair::kLeaks);
      if (r.corruptions > r.corruptions_fixed)
        throw qcow2::CorruptionError(base->path, "check found " + std::to_string(r.corruptions) +
                                                     " corruptions; refusing to merge into it");
      res.leaks_repaired = r.leaks_fixed;
    }
    writer = std::make_unique<qcow2::Writer>(img);
    writer->on_write_point = [this](qcow2::WritePoint wp) { point(qcow2::to_string(wp)); };
  }

  // The first write: from now on a re-run finds this merge's checkpoint.
  void begin_checkpoint() {
    point("checkpoint");
    save_checkpoint(cp_path, {identity, resume_from, base_fingerprint(*base, resume_from), {}});
  }

  // 5. BASE grows to TOP's size, the grown range reading as zeros from the same commit on.
  void grow_base_to_top() {
    if (top_size <= base->virtual_size()) return;
    point("grow");
    res.zeroed_bytes += grow_base(*chain, base_depth, writer.get(), top_size, extents);
    res.base_grown = true;
  }

  // Persistent bitmaps would be stale once BASE changes under them.
  void remove_base_bitmaps() {
    if (!writer) return;
    res.bitmaps_removed = writer->remove_bitmaps();
    writer->commit();
  }

  // 6. The copy, window by window.
  void copy() {
    done_bytes = copy_windows(opt, res, *chain, base_depth, writer.get(), cp_path, identity, total, t_start, extents);
  }

  // 7. Children now use BASE. Short and bounded: one commit per child, its header last, after
  // the zeros that keep its view past TOP's end (engine/rebase.h).
  void switch_children() {
    progress({done_bytes, total, seconds_since(t_start), 0, "switch"});
    const auto t_switch = Clock::now();
    const std::function<void(std::string_view)> at_point = [this](std::string_view name) { point(name); };
    for (RebaseTarget& child : children) {
      (void)switch_child(child, *chain, at_point);
      res.rebased.push_back(child.path);
    }
    res.switch_seconds = seconds_since(t_switch);
  }

  // 8. With every lock still held (a QEMU starting now cannot open TOP or BASE): the caller's own
  // steps, then the deletions, then the checkpoint, last: until it is gone a re-run of the same
  // command accepts children already rebased and finishes what is left.
  void finish() {
    if (opt.while_locked) opt.while_locked(res);
    if (opt.delete_merged) {
      verify_base_holds_view();
      delete_merged_layers();
    }
    if (!res.not_deleted.empty()) {  // kept: the same command again deletes what is left
      locks.clear();
      res.total_seconds = seconds_since(t_start);
      progress({done_bytes, total, res.total_seconds, 0, "done"});
      return;
    }
    point("checkpoint");
    remove_checkpoint(cp_path);
    locks.clear();
    res.total_seconds = seconds_since(t_start);
    progress({done_bytes, total, res.total_seconds, 0, "done"});
  }

  // TOP first; the checkpoint lists them first, for finish_interrupted_delete(). A layer that
  // another process has open (TOP is only read-locked, so a reader may have opened it) is not
  // deleted under it: such a reader (a monitoring agent's qemu-img info) is waited for within
  // --wait; one that keeps it open stops the merge, done but for the deletions, and the same
  // command again finishes them once the file is closed.
  //
  // Each layer goes by the names names_to_delete() gives (a symlink that named it, then the file
  // the chain resolved). A layer that has users (asked again here: one may have appeared since
  // refuse_orphaning_delete()) is not deleted, nor is any other then (their chains run through
  // the layers below); a name the kernel refuses to unlink is reported with its reason. Either
  // way the checkpoint stays and the same command again finishes the job.
  void delete_merged_layers() {
    for (const auto& p : res.merged_layers)
      if (const auto holders = wait_until_closed(p, opt.lock_wait, opt.on_lock_wait);
          !holders.empty())
        throw Error(p, "merged, but not deleted: it is open in " + describe(holders) +
                           "; run the same command again once it is closed");
    std::vector<std::string> names;
    for (size_t i = 0; i < base_depth; ++i)
      for (auto& n : names_to_delete(chain->layer(i).path, chain->layer(i).real_path)) names.push_back(n);
    if (const auto users = find_layer_users(layer_user_query(), opt.find_users); !users.empty()) {
      for (const auto& n : names) res.not_deleted.push_back({n, "still used by " + describe_users(users)});
      return;
    }
    Checkpoint deleting{identity, top_size, base_fingerprint(*base, top_size), {}};
    deleting.deleting = names;
    point("checkpoint");
    save_checkpoint(cp_path, deleting);
    unlink_names(names, res.deleted, res.not_deleted, opt.on_write_point);
  }

  // The merged layers, and the images whose chains pass through them without using them: the
  // chain's own layers down to BASE and the children rebased onto BASE.
  [[nodiscard]] LayerUserQuery layer_user_query() const {
    LayerUserQuery q;
    for (size_t i = 0; i < base_depth; ++i) q.layers.push_back(chain->layer(i).path);
    for (size_t i = 0; i <= base_depth; ++i) q.ignore.push_back(chain->layer(i).path);
    q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
    return q;
  }

  // 3b. --delete never orphans a user of a merged layer (another image backed by it, a domain
  // whose disk chain names it): refused before anything is written. Asked again right before the
  // unlinks (delete_merged_layers).
  void refuse_orphaning_delete() {
    if (!opt.delete_merged) return;
    if (const auto users = find_layer_users(layer_user_query(), opt.find_users); !users.empty())
      throw Error(users.front().layer, "--delete would leave its users without their backing file: " +
                                           describe_users(users) +
                                           "; nothing was written (name them with --rebase, or merge without --delete)");
  }

  // Asks the kernel to read ahead BASE's host ranges of a guest range (POSIX_FADV_WILLNEED).
  [[nodiscard]] std::function<void(uint64_t, uint64_t)> base_read_ahead() {
    auto* file = dynamic_cast<qcow2::FileDevice*>(base->qcow2 ? &base->qcow2->data_device() : base->raw.get());
    if (!file) return nullptr;
    return [this, fd = file->fd()](uint64_t off, uint64_t len) {
      for (uint64_t z = off, end = off + len; z < end;) {
        const MapEntry e = chain->status(z, end - z, base_depth);
        if (e.length == 0) return;
        if (e.offset && e.depth == base_depth)
          (void)::posix_fadvise(fd, off_t(*e.offset), off_t(e.length), POSIX_FADV_WILLNEED);
        z += e.length;
      }
    };
  }

  // Before any merged layer is deleted, whatever a checkpoint said about the copy: BASE must show
  // TOP's view on every range the layers above BASE provide (zero ranges read as zeros). A re-run
  // that trusted a checkpoint over a BASE changed since (an internal snapshot applied, an older
  // copy put back) would otherwise skip the copy and delete the only copy of TOP's data. A
  // difference deletes nothing and keeps the checkpoint.
  void verify_base_holds_view() {
    uint64_t bytes = 0;
    const std::vector<MapEntry> above = extents_above(*chain, base_depth, 0, bytes);
    if (const std::optional<uint64_t> at = first_view_difference(*chain, base_depth, above, base_read_ahead()))
      throw Error(base->path, "does not show TOP's data at guest offset " + std::to_string(*at) + " (" +
                                  qcow2::hex(*at) + "): not deleting the merged layers (nothing deleted, "
                                  "checkpoint kept)");
  }

  const MergeOptions& opt;
  MergeResult res;
  const Clock::time_point t_start = Clock::now();
  std::vector<ImageLock> locks;  // released last
  std::optional<Chain> chain;
  size_t base_depth = 0;
  qcow2::Layer* base = nullptr;
  uint64_t top_size = 0;
  std::string identity, cp_path;
  std::optional<Checkpoint> old_cp;
  bool resuming = false;
  uint64_t resume_from = 0;
  std::vector<RebaseTarget> children;
  std::vector<MapEntry> extents;
  uint64_t total = 0, done_bytes = 0;
  std::unique_ptr<qcow2::Writer> writer;
};

}  // namespace

MergeResult merge(const MergeOptions& opt) {
  if (auto err = opt.validate(); !err.empty()) throw Error(opt.top, err);
  if (auto finished = finish_interrupted_delete(opt)) return *finished;
  return MergeJob(opt).run();
}

MergePlan plan_merge(const MergeOptions& opt) {
  if (auto err = opt.validate(); !err.empty()) throw Error(opt.top, err);
  MergePlan p;
  qcow2::ChainOptions copts;
  copts.allowed_backing_dirs = opt.allowed_backing_dirs;
  Chain chain = Chain::open(opt.top, copts);
  p.base_depth = base_depth_in(chain, opt);
  for (size_t i = 0; i < p.base_depth; ++i) p.layers.push_back(chain.layer(i).path);
  qcow2::Layer& base = chain.layer(p.base_depth);
  p.base = base.path;
  p.base_format = qcow2::to_string(base.format);
  p.top_size = chain.virtual_size();
  p.base_size = base.virtual_size();
  // The checks the merge makes before it writes, with the same errors (and exit codes).
  const std::optional<Checkpoint> cp = load_checkpoint(checkpoint_path(base.path));
  check_layers(layers_to_check(chain, p.base_depth, cp.has_value()), base.path);
  refuse_before_writing(base, p.top_size);
  if (base.qcow2) {
    p.base_snapshots = base.qcow2->header().nb_snapshots;
    p.base_bitmaps = base.qcow2->bitmaps() ? base.qcow2->bitmaps()->nb_bitmaps : 0;
  }
  uint64_t total = 0;
  for (const MapEntry& e : extents_above(chain, p.base_depth, 0, total)) {
    ++p.extents;
    if (e.zero)
      p.zero_bytes += e.length;
    else
      p.data_bytes += e.length;
    if (e.compressed) p.compressed_bytes += e.length;
  }
  const std::string identity = merge_identity(chain, p.base_depth);
  if (cp && cp->identity == identity) p.resume_from = resumable_offset(*cp, base);
  p.rebase = opt.rebase;
  if (opt.delete_merged) {
    LayerUserQuery q{p.layers, {}};
    for (size_t i = 0; i <= p.base_depth; ++i) q.ignore.push_back(chain.layer(i).path);
    q.ignore.insert(q.ignore.end(), opt.rebase.begin(), opt.rebase.end());
    p.users = find_layer_users(q, opt.find_users);
  }
  // From where a run would start; an interrupted run's leftovers in BASE's file are reused.
  p.space = space_need(chain, p.base_depth,
                       extents_above(chain, p.base_depth, p.resume_from.value_or(0), total),
                       p.resume_from.has_value());
  return p;
}

}  // namespace qcommit::engine
