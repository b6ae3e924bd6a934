// SPDX-License-Identifier: GPL-2.0-or-later
// A kernel bound on the dirty pages of a storage device, for the target of a job that escaped
// governance (governor.h: an escaped job).  Linux 6.2 gave every backing device (bdi) a
// `max_bytes` (its share of the dirty limit, in bytes) and a `strict_limit` (that share applies
// even while the host as a whole is below its background threshold): with both set, a writer
// that dirties the device's pages beyond the bound waits in the kernel (balance_dirty_pages)
// instead of piling up page cache that a later fdatasync pushes to storage at once.
//
// Where the bdi of a target is (sysfs, below `root`, "/sys" on a host):
//  * a block device (an LV, a disk: TargetFile::device is its st_rdev) or a file on a filesystem
//    on one (its st_dev): root/dev/block/MAJ:MIN, whose `bdi` link names the bdi; a partition has
//    none of its own and uses its disk's (the directory above it);
//  * a filesystem without a block device (NFS, FUSE: an anonymous st_dev): root/class/bdi/MAJ:MIN.
// Nothing is written outside root/class/bdi/<that bdi>/, and nothing is created there.
//
// What a limit changed is recorded in a state file (the daemon's runtime directory) before the
// change: a process that dies with limits set leaves them there, and the next one to start
// restores them (restore_recorded) -- the runtime directory is a tmpfs, so no record outlives a
// reboot, after which device numbers may name other devices.  Within a boot an anonymous device
// number is given again once its mount is gone: a record names the registration it limited
// (BdiSaved::instance), and a bdi registered since under the same name is left as it is.  A
// record's fields after the first three are key=value, and keys a reader does not know are
// skipped.  A qcommitd from before `instance` reads only three fields: after a downgrade it
// drops a record with four, so limits set by the newer daemon that died stay until reboot.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace qcommit::plugin {

// The least max_bytes a limit sets, whatever it is asked for: the kernel throttles a
// strict-limited bdi's writers from about half its limit on, and the guests' own cached writes to
// the same storage count against it too, so a tighter bound would slow them more than it
// shortens any flush (16 MiB at 50 MB/s: 0.3 s of storage).
inline constexpr std::uint64_t kMinBdiMaxBytes = 16ull * 1024 * 1024;

// sysfs below `root`: finds a device's bdi and reads and writes its attributes.
class BdiSysfs {
 public:
  explicit BdiSysfs(std::string root) : root_(std::move(root)) {}
  // The bdi name of storage device `dev` (a dev_t); nullopt with `why` set when there is none.
  [[nodiscard]] std::optional<std::string> find(std::uint64_t dev, std::string& why) const;
  // root/class/bdi/<bdi>/<attr> as a number; nullopt with `why` set when absent or unreadable.
  [[nodiscard]] std::optional<std::uint64_t> read(const std::string& bdi, const std::string& attr,
                                                  std::string& why) const;
  // Writes `value` to root/class/bdi/<bdi>/<attr> (which must exist); false with `why` set.
  [[nodiscard]] bool write(const std::string& bdi, const std::string& attr, std::uint64_t value,
                           std::string& why) const;
  // Which registration of the device the bdi name stands for now: the inode of its sysfs
  // directory (nullopt: gone).  A device registered later under the same name (a FUSE or NFS
  // mount given the anonymous device number of one unmounted since) has another directory.
  [[nodiscard]] std::optional<std::uint64_t> instance(const std::string& bdi) const;

 private:
  [[nodiscard]] std::string attr_path(const std::string& bdi, const std::string& attr) const;
  std::string root_;
};

// A bdi's attributes as they were before a limit changed them: only those it changed.
struct BdiSaved {
  std::string bdi;
  std::optional<std::uint64_t> strict_limit;  // set: strict_limit was this
  std::string ratio_attr;                     // "max_ratio_fine" (exact) or "max_ratio"
  std::optional<std::uint64_t> ratio;         // set: max_bytes was written; ratio_attr was this
  // BdiSysfs::instance when the limit was set: restored only while the bdi is still that one
  // (nullopt: not known, as in a record from before it was kept).
  std::optional<std::uint64_t> instance;
};

// The limits one process set, per bdi, shared by the jobs (holders) on it: the first holder's
// limit sets it, the last one's release restores it.
class BdiLimits {
 public:
  BdiLimits(BdiSysfs sysfs, std::string state_path)
      : sysfs_(std::move(sysfs)), state_path_(std::move(state_path)) {}
  ~BdiLimits();  // restores what is still held
  BdiLimits(const BdiLimits&) = delete;
  BdiLimits& operator=(const BdiLimits&) = delete;

  // Restores the attributes a previous process recorded and did not restore (it died), and
  // removes the record.  One line per bdi for the log.
  [[nodiscard]] std::vector<std::string> restore_recorded();

  struct Outcome {
    bool on = false;
    std::string text;  // "on: bdi B, ..." or "off: why"
  };
  // Bounds the dirty pages of the bdi of `dev` to `max_bytes` for `holder` (a job's id): sets
  // strict_limit=1 and max_bytes where they are not as tight already.  Off (nothing changed)
  // when the bdi is not found, the kernel has no max_bytes (before 6.2), the state file cannot
  // be written or sysfs refuses a write.
  [[nodiscard]] Outcome limit(std::uint64_t holder, std::uint64_t dev, std::uint64_t max_bytes);
  // `holder` is done: a bdi it held alone gets its attributes back.  One line per bdi restored.
  [[nodiscard]] std::vector<std::string> release(std::uint64_t holder);
  [[nodiscard]] std::vector<std::string> release_all();

 private:
  struct Held {
    BdiSaved saved;
    std::string text;  // the Outcome text of its limit
    std::set<std::uint64_t> holders;
  };
  [[nodiscard]] Outcome apply(const std::string& bdi, std::uint64_t max_bytes);
  [[nodiscard]] std::string restore(const BdiSaved& s);
  [[nodiscard]] bool record(std::string& why);  // the state file after held_ (removed if empty)
  BdiSysfs sysfs_;
  std::string state_path_;
  std::map<std::string, Held> held_;  // by bdi
};

// The state file's text for `saved`, and back (entries that do not parse are skipped).
[[nodiscard]] std::string format_bdi_state(const std::vector<BdiSaved>& saved);
[[nodiscard]] std::vector<BdiSaved> parse_bdi_state(const std::string& text);

}  // namespace qcommit::plugin
