// SPDX-License-Identifier: GPL-2.0-or-later
// The fresh overlay of a two-phase live merge, made before the hypervisor is asked to use it.
#pragma once

#include <cstdint>
#include <string>

namespace qcommit::plugin {

// Throws BlockJobError (WHAT: the file exists...) when PATH exists: an overlay is never made over
// a file.
void refuse_existing_overlay(const std::string& what, const std::string& path);

// Creates PATH as a qcow2 v3 overlay of BACKING (format BACKING_FORMAT, SIZE bytes) with lazy
// refcounts, by running qemu-img.  Returns "" on success, else what went wrong (PATH is then
// removed).
[[nodiscard]] std::string create_fresh_overlay(const std::string& path, const std::string& backing,
                                               const std::string& backing_format, std::uint64_t size);

}  // namespace qcommit::plugin
