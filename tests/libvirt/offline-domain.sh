#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_domain: offline merges of a shut-off domain's external snapshot chain through
# libvirt (qcommit merge --domain/--disk and --pool/--vol) against a real libvirtd.
# Checks: the running domain is refused; each merge keeps the guest view (qemu-img compare),
# leaves clean images, redefines the disk, prunes snapshot metadata like snapshot-delete would,
# refreshes the pool; the domain still starts afterwards.
# usage: offline-domain.sh QCOMMIT
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
tag=qct-$$-$RANDOM
dir=/var/lib/libvirt/images/$tag
dom=$tag-dom
pool=$tag-pool
cleanup() {
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
  virsh -q undefine "$dom" --snapshots-metadata >/dev/null 2>&1 || true
  virsh -q pool-destroy "$pool" >/dev/null 2>&1 || true
  virsh -q pool-undefine "$pool" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
mkdir -p "$dir"
cd "$dir"
fails=()
fail() { echo "FAIL: $*" >&2; fails+=("$*"); }

virsh -q pool-define-as "$pool" dir --target "$dir" >/dev/null
virsh -q pool-start "$pool" >/dev/null
qemu-img create -q -f qcow2 base.qcow2 64M
qemu-io -c 'write -P 1 0 8M' base.qcow2 >/dev/null
define_disk_domain "$dom" "$dir/base.qcow2"
virsh -q start "$dom" >/dev/null
for s in s1 s2 s3; do virsh -q snapshot-create-as "$dom" "$s" --disk-only --atomic >/dev/null; done
# A running domain is refused, naming the way out.
rc=0
"$QCOMMIT" merge --domain "$dom" --disk vda --budget off 2>err.txt || rc=$?
[[ $rc != 0 ]] && grep -q "qcommit live" err.txt || fail "running domain not refused clearly: rc=$rc $(cat err.txt)"
virsh -q destroy "$dom" >/dev/null
# Data in every layer, overlapping.
qemu-io -c 'write -P 2 1M 2M' base.s1 >/dev/null
qemu-io -c 'write -P 3 2M 2M' -c 'write -z 6M 1M' base.s2 >/dev/null
qemu-io -c 'write -P 4 3M 64k' base.s3 >/dev/null
qemu-img convert -O raw base.s3 view0.raw

# 1. The active layer into its backing file (the default).
"$QCOMMIT" merge --domain "$dom" --disk vda --budget off >out1.txt 2>&1 || fail "merge 1 failed: $(cat out1.txt)"
src=$(vda_source "$dom")
[[ $src == "$dir/base.s2" ]] || fail "disk source after merge 1 is '$src', expected base.s2"
qemu-img compare -q view0.raw base.s2 || fail "view changed by merge 1"
qemu-img check -q base.s2 || fail "base.s2 not clean"
snaps=$(virsh -q snapshot-list "$dom" --name | xargs)
[[ $snaps == "s1 s2" ]] || fail "snapshot list after merge 1 is '$snaps', expected 's1 s2'"

# 2. A non-active range: s1's overlay into base.qcow2; the active layer is rebased.
"$QCOMMIT" merge --domain "$dom" --disk vda --top "$dir/base.s1" --base "$dir/base.qcow2" --budget off \
  >out2.txt 2>&1 || fail "merge 2 failed: $(cat out2.txt)"
qemu-img compare -q view0.raw base.s2 || fail "view changed by merge 2"
backing=$(qemu-img info --output=json base.s2 | jq -r '."full-backing-filename"')
[[ $(realpath "$backing") == "$dir/base.qcow2" ]] || fail "base.s2 backs onto '$backing' after merge 2"
qemu-img check -q base.qcow2 || fail "base.qcow2 not clean"
snaps=$(virsh -q snapshot-list "$dom" --name | xargs)
[[ -z $snaps ]] || fail "snapshot list after merge 2 is '$snaps', expected empty (all merged states)"

# 3. Through the pool: the volume base.s2 into base.qcow2; then the definition still names base.s2,
#    so only the pool view changes; vol-list agrees with the files.
"$QCOMMIT" merge --pool "$pool" --vol base.s2 --budget off --allow-backing-dir "$dir" >out3.txt 2>&1 ||
  fail "pool merge failed: $(cat out3.txt)"
qemu-img compare -q view0.raw base.qcow2 || fail "view changed by the pool merge"
virsh -q vol-list "$pool" | awk '{print $1}' | sort | xargs >vols.txt
[[ $(cat vols.txt) == *base.qcow2*base.s1*base.s2* ]] || fail "vol-list disagrees with the files: $(cat vols.txt)"
alloc=$(virsh vol-info --pool "$pool" base.qcow2 --bytes | awk '/Allocation/{print $2}')
[[ $alloc == $(($(stat -c '%b * %B' base.qcow2))) ]] || fail "vol-info allocation $alloc not refreshed (file has $(($(stat -c '%b * %B' base.qcow2))))"

# The domain boots from its merged chain.
virsh -q start "$dom" >/dev/null || fail "domain does not start after the merges"
virsh -q destroy "$dom" >/dev/null 2>&1 || true

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.offline_domain: OK"
