#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.merge_delete_users: `qcommit merge TOP --delete` against a real libvirtd never orphans a
# user of TOP that libvirt knows, and refuses before anything is written (exit 1, the user named,
# every file unchanged, no checkpoint; --dry-run the same):
#   (1) an image in another storage pool's directory backed by TOP (the engine alone scans only
#       TOP's own directory: this one is found through libvirt's pools);
#   (2) a shut-off domain whose disk is TOP;
#   (3) a shut-off domain whose disk is an overlay, outside every pool, backed by TOP;
# and once no user is left the same merge deletes TOP (no user made up from the pools or domains
# that remain). About 5 s.
# usage: merge-delete-users.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
lv_setup libvirt.merge_delete_users qdu  # $dir: TOP and BASE (no pool)
pool_dir=$dir-b         # another pool's directory
other=/var/tmp/$tag-c   # outside every pool
on_exit 'rm -rf "$pool_dir" "$other"'
mkdir -p "$pool_dir" "$other"
dir_pool "$tag-pool" "$pool_dir"
layers 16M base.qcow2='write -P 1 0 4M' top.qcow2='write -P 2 2M 4M'
qemu-img convert -O raw top.qcow2 view.raw

# refused LABEL USER_TEXT: the merge and its dry run refuse, naming USER_TEXT, nothing changed.
refused() {
  local label=$1 user=$2
  sha256sum "$dir"/*.qcow2 >"$dir/sums"
  try "$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete
  [[ $rc == 1 ]] || soft_fail "($label) exit $rc, not 1: $(cat err.txt)"
  grep -qF -- "$user" err.txt || soft_fail "($label) the error does not name $user: $(cat err.txt)"
  [[ $(wc -l <err.txt) == 1 ]] || soft_fail "($label) the error is not one line: $(cat err.txt)"
  sha256sum --quiet -c "$dir/sums" || soft_fail "($label) files changed although the merge was refused"
  [[ ! -e .base.qcow2.qcommit-merge ]] || soft_fail "($label) a checkpoint was written"
  try "$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete --dry-run
  [[ $rc == 1 ]] || soft_fail "($label) --dry-run exited $rc, not 1"
  grep -qF -- "would refuse --delete: $user" out.txt || soft_fail "($label) --dry-run does not show $user: $(cat out.txt)"
}

# (1) An image in another pool's directory.
qemu-img create -q -f qcow2 -b "$dir/top.qcow2" -F qcow2 "$pool_dir/clone.qcow2"
refused 1 "image $pool_dir/clone.qcow2"
rm -f "$pool_dir/clone.qcow2"

# (2) A shut-off domain whose disk is TOP.
define_disk_domain "$dom" "$dir/top.qcow2"
refused 2 "domain $dom (disk vda"
virsh -q undefine "$dom" >/dev/null

# (3) A shut-off domain on an overlay of TOP outside every pool.
qemu-img create -q -f qcow2 -b "$dir/top.qcow2" -F qcow2 "$other/overlay.qcow2"
define_disk_domain "$tag-dom2" "$other/overlay.qcow2"
refused 3 "domain $tag-dom2 (disk vda, through $other/overlay.qcow2)"
virsh -q undefine "$tag-dom2" >/dev/null
rm -f "$other/overlay.qcow2"

# No user left: deleted.
"$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete >out-ok.txt 2>err-ok.txt ||
  soft_fail "(4) with no user left the merge exited $?: $(cat err-ok.txt)"
[[ ! -e top.qcow2 ]] || soft_fail "(4) TOP not deleted"
same_view view.raw base.qcow2 || soft_fail "(4) BASE does not show TOP's view"
finish "libvirt.merge_delete_users: all passed"
