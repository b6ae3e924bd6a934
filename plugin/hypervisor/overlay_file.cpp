// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/hypervisor/overlay_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <exception>

#include "common/safe_file.h"
#include "plugin/hypervisor/block_job_control.h"
#include "plugin/host/process.h"

namespace qcommit::plugin {

namespace {
// As qemu-img creates images (0644 less the umask): QEMU, under libvirt another user, opens it.
constexpr unsigned kOverlayMode = 0644;
}  // namespace

void refuse_existing_overlay(const std::string& what, const std::string& path) {
  struct stat sb{};
  if (::lstat(path.c_str(), &sb) == 0)
    throw BlockJobError(what + ": the file exists; refusing to overwrite it");
}

// A guest's first write into a cluster of the fresh overlay allocates it: cluster write,
// refcount block write, flush, L2 write, flush -- each of them may wait behind a commit chunk of
// the merge (lab, cache=none: ~10 ms each).  With lazy refcounts the refcount write and its
// flush go (the refcounts are rebuilt from the L2 tables if QEMU dies; the overlay is committed
// and dropped at the end anyway).  -u: the backing file is the running guest's active layer,
// which qemu-img must not open.
//
// The file is created here, exclusively (O_EXCL|O_NOFOLLOW: nothing planted at the name is
// followed or reused), and qemu-img writes the overlay into that very file through
// /proc/<pid>/fd/<n>, so no name lookup of qemu-img's can be diverted. Afterwards the name must
// still lead to that file; on any failure it is removed only if it still does.
std::string create_fresh_overlay(const std::string& path, const std::string& backing,
                                 const std::string& backing_format, std::uint64_t size) {
  safe_file::Opened file = safe_file::create_new(path, 0, kOverlayMode);
  if (!file.ok()) return path + ": " + file.problem;
  const std::string through = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(file.fd.get());
  ProcessResult r;
  try {
    r = run_process({"qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F",
                     backing_format, "-o", "lazy_refcounts=on,cluster_size=64k", through,
                     std::to_string(size)});
  } catch (const std::exception& e) {
    (void)safe_file::remove_if_same(path, file.fd.get());
    return e.what();
  }
  if (r.exit_code == 0) {
    struct stat named {}, made {};
    if (::lstat(path.c_str(), &named) == 0 && ::fstat(file.fd.get(), &made) == 0 &&
        named.st_dev == made.st_dev && named.st_ino == made.st_ino)
      return "";
    return path + ": replaced by something else while the overlay was made; refusing to use it";
  }
  (void)safe_file::remove_if_same(path, file.fd.get());
  std::string& err = r.output;
  while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
  return err.empty() ? "qemu-img create failed" : err;
}

}  // namespace qcommit::plugin
