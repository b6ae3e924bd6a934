#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_domain: offline merges of a shut-off domain's external snapshot chain through
# libvirt (qcommit merge --domain/--disk and --pool/--vol) against a real libvirtd.
# Checks: the running domain is refused; each merge keeps the guest view (qemu-img compare),
# leaves clean images, redefines the disk, prunes snapshot metadata like snapshot-delete would,
# refreshes the pool; the domain still starts afterwards.
# usage: offline-domain.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
lv_setup libvirt.offline_domain qct
pool=$tag-pool
dir_pool "$pool" "$dir"
snapshot_chain 64M
# A running domain is refused, naming the way out.
try "$QCOMMIT" merge --domain "$dom" --disk vda --budget off
[[ $rc != 0 ]] && grep -q "qcommit live" err.txt || soft_fail "running domain not refused clearly: rc=$rc $(cat err.txt)"
virsh -q destroy "$dom" >/dev/null
# Data in every layer, overlapping.
qio -f qcow2 base.s1 'write -P 2 1M 2M'
qio -f qcow2 base.s2 'write -P 3 2M 2M' 'write -z 6M 1M'
qio -f qcow2 base.s3 'write -P 4 3M 64k'
qemu-img convert -O raw base.s3 view0.raw
snapshots_are() { snaps=$(virsh -q snapshot-list "$dom" --name | xargs); [[ $snaps == "$1" ]]; }

# 1. The active layer into its backing file (the default).
"$QCOMMIT" merge --domain "$dom" --disk vda --budget off >out1.txt 2>&1 || soft_fail "merge 1 failed: $(cat out1.txt)"
vda_is "$dir/base.s2" || soft_fail "disk source after merge 1 is '$(vda_source "$dom")', expected base.s2"
same_view view0.raw base.s2 || soft_fail "view changed by merge 1"
qemu-img check -q base.s2 || soft_fail "base.s2 not clean"
snapshots_are "s1 s2" || soft_fail "snapshot list after merge 1 is '$snaps', expected 's1 s2'"

# 2. A non-active range: s1's overlay into base.qcow2; the active layer is rebased.
"$QCOMMIT" merge --domain "$dom" --disk vda --top "$dir/base.s1" --base "$dir/base.qcow2" --budget off \
  >out2.txt 2>&1 || soft_fail "merge 2 failed: $(cat out2.txt)"
same_view view0.raw base.s2 || soft_fail "view changed by merge 2"
backing=$(qemu-img info --output=json base.s2 | jq -r '."full-backing-filename"')
[[ $(realpath "$backing") == "$dir/base.qcow2" ]] || soft_fail "base.s2 backs onto '$backing' after merge 2"
qemu-img check -q base.qcow2 || soft_fail "base.qcow2 not clean"
snapshots_are "" || soft_fail "snapshot list after merge 2 is '$snaps', expected empty (all merged states)"

# 3. Through the pool: the volume base.s2 into base.qcow2; then the definition still names base.s2,
#    so only the pool view changes; vol-list agrees with the files.
"$QCOMMIT" merge --pool "$pool" --vol base.s2 --budget off --allow-backing-dir "$dir" >out3.txt 2>&1 ||
  soft_fail "pool merge failed: $(cat out3.txt)"
same_view view0.raw base.qcow2 || soft_fail "view changed by the pool merge"
virsh -q vol-list "$pool" | awk '{print $1}' | sort | xargs >vols.txt
[[ $(cat vols.txt) == *base.qcow2*base.s1*base.s2* ]] || soft_fail "vol-list disagrees with the files: $(cat vols.txt)"
alloc_refreshed "$pool" base.qcow2

# The domain boots from its merged chain.
virsh -q start "$dom" >/dev/null || soft_fail "domain does not start after the merges"
virsh -q destroy "$dom" >/dev/null 2>&1 || true
finish "libvirt.offline_domain: OK"
