// SPDX-License-Identifier: GPL-2.0-or-later
// The users of the layers `merge --delete` would remove that libvirt knows: qcow2 images in the
// directories of its storage pools whose chains pass through a layer, and domains (running or
// not) whose disk source or <backingStore> chain names one. Filled into
// engine::MergeOptions::find_users; the engine scans the layers' own directories itself.
#pragma once

#include <string>
#include <vector>

#include "engine/layer_users.h"

namespace qcommit::cli {

// Asks libvirt at `uri` (read-only) each time it is called; nothing when libvirt does not answer.
// `merged_domain`: the domain whose disk the merge itself redefines (--domain), not a user.
[[nodiscard]] engine::FindLayerUsers libvirt_layer_users(std::string uri, std::string merged_domain);

// The directories where the host at `uri` (read-only) keeps images: the target directories of
// its active storage pools and the directories of the files its domains' disks (running or not)
// and their <backingStore> chains name. Empty when libvirt does not answer.
[[nodiscard]] std::vector<std::string> libvirt_image_directories(const std::string& uri);

}  // namespace qcommit::cli
