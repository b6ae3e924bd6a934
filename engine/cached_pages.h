// SPDX-License-Identifier: GPL-2.0-or-later
// Before an interrupted merge is resumed, BASE is read from its storage, not from the page cache
// (engine/merge.cpp, MergeJob).
#pragma once

#include <string>

namespace qcommit::engine {

// A run that finds BASE's checkpoint reads BASE from its storage, not from the page cache. After a
// failed writeback (EIO; ENOSPC on a thin or network volume) the kernel keeps the pages it could
// not write as clean, cached pages: the interrupted run's metadata would be read back as if it
// were on disk, and a leak repair judged on it could free clusters that the on-disk tables still
// use. So: write back what is still dirty, drop every cached page, and check that none is left.
void drop_cached_pages(const std::string& path);

}  // namespace qcommit::engine
