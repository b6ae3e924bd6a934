// SPDX-License-Identifier: GPL-2.0-or-later
// Who still uses a layer that `merge --delete` would remove: qcow2 images whose backing chain
// passes through it. Found by reading image headers only (magic, backing file name), never
// opening anything but regular files, resolving backing names as qcow2::resolve_backing does
// (QEMU's way). libvirt's domains are found by the caller (MergeOptions::find_users): the engine
// knows no libvirt.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace qcommit::engine {

// The merged layers and the images that are not their users although their chains pass through
// them: the chain's own layers (TOP, intermediates, BASE) and the children the merge rebases.
struct LayerUserQuery {
  std::vector<std::string> layers;  // TOP and intermediates, as the chain names them
  std::vector<std::string> ignore;
};

// One user of one layer: `user` says what it is ("image /p/snap2.qcow2", "domain vm2 (disk vdb)").
struct LayerUser {
  std::string layer;
  std::string user;
};

using FindLayerUsers = std::function<std::vector<LayerUser>(const LayerUserQuery&)>;

// The merged layer whose file `image`'s backing chain reaches first (headers only, at most
// qcow2::kMaxChainDepth deep), or nullopt: no such layer, the chain reaches an ignored image
// first, or it cannot be followed (a name that is not a local file, a missing file, a special
// file). `image` itself is compared too: a domain's disk that is a layer.
[[nodiscard]] std::optional<std::string> layer_reached_from(const std::string& image,
                                                            const LayerUserQuery& q);

// Every qcow2 image directly in one of `dirs` (not in subdirectories) whose chain reaches a
// merged layer, except the ignored ones.
[[nodiscard]] std::vector<LayerUser> image_users_in(const std::vector<std::string>& dirs,
                                                    const LayerUserQuery& q);

// The images in the directory of each merged layer that use it, then what `more` finds (the
// caller's: libvirt's pools and domains), each user once.
[[nodiscard]] std::vector<LayerUser> find_layer_users(const LayerUserQuery& q,
                                                      const FindLayerUsers& more);

// "image /p/snap2.qcow2 (backed by /p/snap1.qcow2), domain vm2 (disk vdb)": the users as one
// line, for an error message.
[[nodiscard]] std::string describe_users(const std::vector<LayerUser>& users);

}  // namespace qcommit::engine
