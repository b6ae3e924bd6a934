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
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
tag=qdu-$$-$RANDOM
dir=/var/lib/libvirt/images/$tag         # TOP and BASE (no pool)
pool_dir=/var/lib/libvirt/images/$tag-b  # another pool's directory
other=/var/tmp/$tag-c                    # outside every pool
pool=$tag-pool
dom=$tag-dom
dom2=$tag-dom2
cleanup() {
  virsh -q undefine "$dom" >/dev/null 2>&1 || true
  virsh -q undefine "$dom2" >/dev/null 2>&1 || true
  virsh -q pool-destroy "$pool" >/dev/null 2>&1 || true
  virsh -q pool-undefine "$pool" >/dev/null 2>&1 || true
  rm -rf "$dir" "$pool_dir" "$other"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$dir" "$pool_dir" "$other"
cd "$dir"
fails=()
fail() { echo "FAIL: $*" >&2; fails+=("$*"); }

virsh -q pool-define-as "$pool" dir --target "$pool_dir" >/dev/null
virsh -q pool-start "$pool" >/dev/null
qemu-img create -q -f qcow2 base.qcow2 16M
qemu-io -f qcow2 -c 'write -P 1 0 4M' base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2
qemu-io -f qcow2 -c 'write -P 2 2M 4M' top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
checkpoint=.base.qcow2.qcommit-merge

# refused LABEL USER_TEXT: the merge and its dry run refuse, naming USER_TEXT, nothing changed.
refused() {
  local label=$1 user=$2 rc=0
  sha256sum "$dir"/*.qcow2 >"$dir/sums"
  "$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete >"out-$label.txt" 2>"err-$label.txt" || rc=$?
  [[ $rc == 1 ]] || fail "($label) exit $rc, not 1: $(cat "err-$label.txt")"
  grep -qF -- "$user" "err-$label.txt" || fail "($label) the error does not name $user: $(cat "err-$label.txt")"
  [[ $(wc -l <"err-$label.txt") == 1 ]] || fail "($label) the error is not one line: $(cat "err-$label.txt")"
  sha256sum --quiet -c "$dir/sums" || fail "($label) files changed although the merge was refused"
  [[ ! -e $checkpoint ]] || fail "($label) a checkpoint was written"
  rc=0
  "$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete --dry-run >"dry-$label.txt" 2>"dryerr-$label.txt" || rc=$?
  [[ $rc == 1 ]] || fail "($label) --dry-run exited $rc, not 1"
  grep -qF -- "would refuse --delete: $user" "dry-$label.txt" || fail "($label) --dry-run does not show $user: $(cat "dry-$label.txt")"
}

# (1) An image in another pool's directory.
qemu-img create -q -f qcow2 -b "$dir/top.qcow2" -F qcow2 "$pool_dir/clone.qcow2"
refused 1 "image $pool_dir/clone.qcow2"
rm -f "$pool_dir/clone.qcow2"

# (2) A shut-off domain whose disk is TOP.
define_disk_domain "$dom" "$dir/top.qcow2" "$other"
refused 2 "domain $dom (disk vda"
virsh -q undefine "$dom" >/dev/null

# (3) A shut-off domain on an overlay of TOP outside every pool.
qemu-img create -q -f qcow2 -b "$dir/top.qcow2" -F qcow2 "$other/overlay.qcow2"
define_disk_domain "$dom2" "$other/overlay.qcow2" "$other"
refused 3 "domain $dom2 (disk vda, through $other/overlay.qcow2)"
virsh -q undefine "$dom2" >/dev/null
rm -f "$other/overlay.qcow2"

# No user left: deleted.
rc=0
"$QCOMMIT" merge "$dir/top.qcow2" --budget off --delete >out-ok.txt 2>err-ok.txt || rc=$?
[[ $rc == 0 ]] || fail "(4) with no user left the merge exited $rc: $(cat err-ok.txt)"
[[ ! -e top.qcow2 ]] || fail "(4) TOP not deleted"
qemu-img compare -q view.raw base.qcow2 || fail "(4) BASE does not show TOP's view"

if ((${#fails[@]})); then
  echo "${#fails[@]} failed" >&2
  exit 1
fi
echo "libvirt.merge_delete_users: all passed"
