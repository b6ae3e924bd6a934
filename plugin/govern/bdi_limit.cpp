// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/govern/bdi_limit.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "common/safe_file.h"
#include "common/unique_fd.h"
#include "common/units.h"

namespace qcommit::plugin {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxBdiNameBytes = 64;
constexpr std::size_t kMaxAttrBytes = 64;              // one number and a newline
constexpr std::size_t kMaxStateFileBytes = 64 * 1024;  // a few lines per governed storage
constexpr const char* kStateHeader = "# qcommitd: bdi attributes to restore (bdi_limit.h)\n";

// A bdi's name as the kernel forms them ("8:0", "0:45", "0:45-fuseblk", "btrfs-1"): never a path.
bool valid_bdi_name(const std::string& n) {
  if (n.empty() || n.size() > kMaxBdiNameBytes || n == "." || n == "..") return false;
  for (const char c : n)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != ':' && c != '-' && c != '_' &&
        c != '.')
      return false;
  return true;
}

std::string errno_text(int err) {
  return std::strerror(err);
}

std::optional<std::uint64_t> parse_number(const std::string& s) {
  if (s.empty() || s == "-") return std::nullopt;
  std::uint64_t v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    if (v > (UINT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

std::string number_or_dash(const std::optional<std::uint64_t>& v) {
  return v ? std::to_string(*v) : "-";
}

// The whole of a small file (at most `max` bytes), without following a link at its name.
// `own_only`: only a regular file of the effective user that nobody else may write (a record
// someone else planted where the state file goes is not acted on: EPERM).
std::optional<std::string> read_small(const std::string& path, std::size_t max, int& err,
                                      bool own_only = false) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (!fd.valid()) {
    err = errno;
    return std::nullopt;
  }
  struct stat st {};
  if (own_only && (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
                   st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0)) {
    err = EPERM;
    return std::nullopt;
  }
  std::string text(max + 1, '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
      return std::nullopt;
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got > max) {
    err = EFBIG;
    return std::nullopt;
  }
  text.resize(got);
  return text;
}

bool write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
  }
  return true;
}

bool changes(const BdiSaved& s) {
  return s.strict_limit || s.ratio;
}

}  // namespace

std::string BdiSysfs::attr_path(const std::string& bdi, const std::string& attr) const {
  return root_ + "/class/bdi/" + bdi + "/" + attr;
}

std::optional<std::string> BdiSysfs::find(std::uint64_t dev, std::string& why) const {
  const auto d = static_cast<dev_t>(dev);
  const std::string num = std::to_string(major(d)) + ":" + std::to_string(minor(d));
  std::error_code ec;
  const fs::path block = fs::path(root_) / "dev" / "block" / num;
  std::string name = num;
  if (fs::exists(block, ec)) {
    // A partition's bdi is its disk's: the directory above the partition's.
    fs::path link = block / "bdi";
    if (!fs::is_symlink(link, ec) && fs::exists(block / "partition", ec))
      link = block / ".." / "bdi";
    const fs::path target = fs::read_symlink(link, ec);
    if (ec) {
      why = "block device " + num + " has no bdi in sysfs";
      return std::nullopt;
    }
    name = target.filename().string();
  }
  if (!valid_bdi_name(name) || !fs::is_directory(fs::path(root_) / "class" / "bdi" / name, ec)) {
    why = "no bdi found for device " + num + " (its filesystem has none of its own)";
    return std::nullopt;
  }
  return name;
}

std::optional<std::uint64_t> BdiSysfs::read(const std::string& bdi, const std::string& attr,
                                            std::string& why) const {
  const std::string path = attr_path(bdi, attr);
  int err = 0;
  std::optional<std::string> text = read_small(path, kMaxAttrBytes, err);
  if (!text) {
    why = path + ": " + errno_text(err);
    return std::nullopt;
  }
  while (!text->empty() && (text->back() == '\n' || text->back() == ' ')) text->pop_back();
  const std::optional<std::uint64_t> v = parse_number(*text);
  if (!v) why = path + ": not a number";
  return v;
}

bool BdiSysfs::write(const std::string& bdi, const std::string& attr, std::uint64_t value,
                     std::string& why) const {
  const std::string path = attr_path(bdi, attr);
  // No O_CREAT: an attribute the kernel does not have is not made.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid() || !write_all(fd.get(), std::to_string(value) + "\n")) {
    why = path + ": " + errno_text(errno);
    return false;
  }
  return true;
}

std::optional<std::uint64_t> BdiSysfs::instance(const std::string& bdi) const {
  struct stat st {};
  const std::string dir = root_ + "/class/bdi/" + bdi;
  if (!valid_bdi_name(bdi) || ::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return std::nullopt;
  return static_cast<std::uint64_t>(st.st_ino);
}

std::string format_bdi_state(const std::vector<BdiSaved>& saved) {
  std::string out = kStateHeader;
  for (const BdiSaved& s : saved) {
    if (!changes(s)) continue;
    out += "bdi=" + s.bdi + " strict_limit=" + number_or_dash(s.strict_limit) + " " + s.ratio_attr +
           "=" + number_or_dash(s.ratio);
    if (s.instance) out += " instance=" + std::to_string(*s.instance);
    out += "\n";
  }
  return out;
}

// Fields after the three every record has: key=value each; `instance` is read, other keys (a
// later qcommitd's) are skipped, so a record stays restorable across versions.
static bool parse_later_fields(std::istringstream& fields, BdiSaved& s) {
  std::string f;
  while (fields >> f) {
    const std::size_t eq = f.find('=');
    if (eq == std::string::npos || eq == 0) return false;
    if (f.compare(0, eq, "instance") != 0) continue;
    s.instance = parse_number(f.substr(eq + 1));
    if (!s.instance) return false;
  }
  return true;
}

std::vector<BdiSaved> parse_bdi_state(const std::string& text) {
  std::vector<BdiSaved> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string bdi, strict, ratio;
    if (!(fields >> bdi >> strict >> ratio)) continue;
    if (bdi.rfind("bdi=", 0) != 0 || strict.rfind("strict_limit=", 0) != 0) continue;
    BdiSaved s;
    s.bdi = bdi.substr(4);
    const std::string strict_v = strict.substr(13);
    const std::size_t eq = ratio.find('=');
    if (eq == std::string::npos) continue;
    s.ratio_attr = ratio.substr(0, eq);
    const std::string ratio_v = ratio.substr(eq + 1);
    if (!valid_bdi_name(s.bdi) || (s.ratio_attr != "max_ratio_fine" && s.ratio_attr != "max_ratio"))
      continue;
    s.strict_limit = parse_number(strict_v);
    s.ratio = parse_number(ratio_v);
    if ((!s.strict_limit && strict_v != "-") || (!s.ratio && ratio_v != "-")) continue;
    if (!parse_later_fields(fields, s)) continue;
    out.push_back(std::move(s));
  }
  return out;
}

BdiLimits::~BdiLimits() {
  (void)release_all();
}

std::vector<std::string> BdiLimits::restore_recorded() {
  int err = 0;
  const std::optional<std::string> text =
      read_small(state_path_, kMaxStateFileBytes, err, /*own_only=*/true);
  if (!text) {
    if (err == ENOENT) return {};
    return {"bdi limits recorded in " + state_path_ + " not restored: " + errno_text(err)};
  }
  std::vector<std::string> lines;
  for (const BdiSaved& s : parse_bdi_state(*text))
    lines.push_back(restore(s) + " (left by a previous qcommitd)");
  if (::unlink(state_path_.c_str()) != 0 && errno != ENOENT)
    lines.push_back("cannot remove " + state_path_ + ": " + errno_text(errno));
  return lines;
}

BdiLimits::Outcome BdiLimits::limit(std::uint64_t holder, std::uint64_t dev,
                                    std::uint64_t max_bytes) {
  std::string why;
  const std::optional<std::string> bdi = sysfs_.find(dev, why);
  if (!bdi) return {false, "off: " + why};
  if (auto it = held_.find(*bdi); it != held_.end()) {
    it->second.holders.insert(holder);
    return {true, it->second.text};
  }
  Outcome out = apply(*bdi, std::max(max_bytes, kMinBdiMaxBytes));
  if (out.on) held_.at(*bdi).holders.insert(holder);
  return out;
}

// Reads what the bdi has, records what will change, then changes it: max_bytes first (strict
// with the old bound would throttle to it meanwhile).  A failed write undoes the others.
BdiLimits::Outcome BdiLimits::apply(const std::string& bdi, std::uint64_t max_bytes) {
  std::string why;
  const std::optional<std::uint64_t> strict = sysfs_.read(bdi, "strict_limit", why);
  const std::optional<std::uint64_t> cur_max =
      strict ? sysfs_.read(bdi, "max_bytes", why) : std::nullopt;
  if (!strict || !cur_max)
    return {false, "off: bdi " + bdi + " has no per-bdi byte limit (Linux 6.2 and later): " + why};
  BdiSaved s;
  s.bdi = bdi;
  s.instance = sysfs_.instance(bdi);
  s.ratio_attr = "max_ratio_fine";
  std::optional<std::uint64_t> ratio = sysfs_.read(bdi, s.ratio_attr, why);
  if (!ratio) {
    s.ratio_attr = "max_ratio";
    ratio = sysfs_.read(bdi, s.ratio_attr, why);
  }
  if (!ratio) return {false, "off: bdi " + bdi + ": " + why};
  if (*strict != 1) s.strict_limit = *strict;
  if (*cur_max > max_bytes) s.ratio = *ratio;
  const std::uint64_t bound = std::min(*cur_max, max_bytes);
  Held& h = held_[bdi];
  h.saved = s;
  if (!changes(s)) {
    h.text = "on: bdi " + bdi + " limited already: max_bytes " +
             units::mib_text(static_cast<double>(bound)) + ", strict_limit 1";
    return {true, h.text};
  }
  if (!record(why)) {
    held_.erase(bdi);
    std::string ignored;
    (void)record(ignored);
    return {false, "off: bdi " + bdi + ": cannot record its attributes: " + why};
  }
  if ((s.ratio && !sysfs_.write(bdi, "max_bytes", max_bytes, why)) ||
      (s.strict_limit && !sysfs_.write(bdi, "strict_limit", 1, why))) {
    (void)restore(s);
    held_.erase(bdi);
    std::string ignored;
    (void)record(ignored);
    return {false, "off: bdi " + bdi + ": " + why};
  }
  h.text = "on: bdi " + bdi + ": max_bytes " + units::mib_text(static_cast<double>(bound)) +
           ", strict_limit 1 (were " + units::mib_text(static_cast<double>(*cur_max)) + ", " +
           std::to_string(*strict) + ")";
  return {true, h.text};
}

std::string BdiLimits::restore(const BdiSaved& s) {
  if (s.instance) {
    const std::optional<std::uint64_t> now = sysfs_.instance(s.bdi);
    if (now != s.instance)
      return "bdi " + s.bdi + ": dirty limit not restored: the device it was set on is gone (" +
             s.bdi + " now names " + (now ? "another device" : "none") + "); left as it is";
  }
  std::string why;
  std::string done;
  bool ok = true;
  if (s.ratio) {
    ok = sysfs_.write(s.bdi, s.ratio_attr, *s.ratio, why);
    done = s.ratio_attr + " " + std::to_string(*s.ratio);
  }
  if (ok && s.strict_limit) {
    ok = sysfs_.write(s.bdi, "strict_limit", *s.strict_limit, why);
    done +=
        (done.empty() ? "" : ", ") + std::string("strict_limit ") + std::to_string(*s.strict_limit);
  }
  if (!ok) return "bdi " + s.bdi + ": dirty limit not restored: " + why;
  return "bdi " + s.bdi + ": dirty limit restored: " + done;
}

std::vector<std::string> BdiLimits::release(std::uint64_t holder) {
  std::vector<std::string> lines;
  bool released = false;
  for (auto it = held_.begin(); it != held_.end();) {
    if (!it->second.holders.erase(holder) || !it->second.holders.empty()) {
      ++it;
      continue;
    }
    if (changes(it->second.saved)) lines.push_back(restore(it->second.saved));
    it = held_.erase(it);
    released = true;
  }
  std::string why;
  if (released && !record(why)) lines.push_back("bdi limits: " + why);
  return lines;
}

std::vector<std::string> BdiLimits::release_all() {
  std::vector<std::string> lines;
  for (const auto& [bdi, h] : held_)
    if (changes(h.saved)) lines.push_back(restore(h.saved));
  const bool any = !held_.empty();
  held_.clear();
  std::string why;
  if (any && !record(why)) lines.push_back("bdi limits: " + why);
  return lines;
}

// The state file is replaced whole (written beside it, then renamed over it): a process that
// dies meanwhile leaves the previous record or the new one, never half of one.
bool BdiLimits::record(std::string& why) {
  std::vector<BdiSaved> saved;
  for (const auto& [bdi, h] : held_)
    if (changes(h.saved)) saved.push_back(h.saved);
  if (saved.empty()) {
    if (::unlink(state_path_.c_str()) == 0 || errno == ENOENT) return true;
    why = "cannot remove " + state_path_ + ": " + errno_text(errno);
    return false;
  }
  const std::string next = state_path_ + ".new";
  (void)::unlink(next.c_str());
  safe_file::Opened f = safe_file::create_new(next);
  if (!f.ok()) {
    why = next + ": " + f.problem;
    return false;
  }
  if (!write_all(f.fd.get(), format_bdi_state(saved)) || ::fsync(f.fd.get()) != 0 ||
      ::rename(next.c_str(), state_path_.c_str()) != 0) {
    why = state_path_ + ": " + errno_text(errno);
    (void)::unlink(next.c_str());
    return false;
  }
  return true;
}

}  // namespace qcommit::plugin
