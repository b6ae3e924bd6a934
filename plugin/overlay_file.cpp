// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/overlay_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <exception>

#include "plugin/live.h"
#include "plugin/process.h"

namespace qcommit::plugin {

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
std::string create_fresh_overlay(const std::string& path, const std::string& backing,
                                 const std::string& backing_format, std::uint64_t size) {
  ProcessResult r;
  try {
    r = run_process({"qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F",
                     backing_format, "-o", "lazy_refcounts=on,cluster_size=64k", path,
                     std::to_string(size)});
  } catch (const std::exception& e) {
    return e.what();
  }
  if (r.exit_code == 0) return "";
  ::unlink(path.c_str());
  std::string& err = r.output;
  while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
  return err.empty() ? "qemu-img create failed" : err;
}

}  // namespace qcommit::plugin
