#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_logical / libvirt.offline_blockdev: offline merges into a raw BASE on a block
# device, against a real libvirtd.
#   lvm:  BASE is a raw volume of a libvirt `logical` pool on a loop-backed volume group.
#         Exits 77 (ctest SKIP) with the reason when the machine cannot (no lvm2 tools, no
#         device-mapper in the kernel: containers often have neither).
#   loop: BASE is a loop device itself (what an LV is to qcommit, without device-mapper).
# Both: qcow2 overlays in a `dir` pool on top (ov1 -b BASE -F raw, ov2 -b ov1);
#   1. qcommit merge --pool DIRPOOL --vol ov1.qcow2: BASE == ov1's view, ov2's view unchanged,
#      the pools refreshed (vol-info allocation of ov1 = the file's);
#   2. qcommit merge --domain DOM --disk vda --base BASE (ov2 and ov1 into BASE): BASE == ov2's
#      view, the disk becomes <disk type='block'> raw on BASE with an empty <backingStore/>
#      chain (domblklist, dumpxml), and the domain starts on it.
# usage: offline-blockdev.sh QCOMMIT lvm|loop
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
mode=$2
declare -A name=([lvm]=libvirt.offline_logical [loop]=libvirt.offline_blockdev)
lv_setup "${name[$mode]}" qcb
[[ $(id -u) == 0 ]] || skip "needs root (losetup)"
[[ -e /dev/loop-control ]] || skip "no /dev/loop-control: this machine cannot create loop devices"
[[ $mode != lvm ]] || command -v vgcreate >/dev/null || skip "lvm2 is not installed (apt-get install lvm2)"
dpool=$tag-dir lpool=$tag-lvm vg=${tag//-/_} img=/var/tmp/$tag.pv loop=''
export LVM_SUPPRESS_FD_WARNINGS=1
undo_loop() {
  [[ $mode != lvm || -z $loop ]] || { vgremove -q -f "$vg"; pvremove -q "$loop"; } >/dev/null 2>&1
  [[ -z $loop ]] || losetup -d "$loop"
  rm -f "$img"
}
on_exit undo_loop

truncate -s 192M "$img"
loop=$(losetup --find --show "$img") || skip "losetup refused: $(losetup --find --show "$img" 2>&1)"
if [[ $mode == lvm ]]; then
  pvcreate -q "$loop" >/dev/null
  vgcreate -q "$vg" "$loop" >/dev/null
  virsh -q pool-define-as "$lpool" logical --source-name "$vg" --target "/dev/$vg" >/dev/null
  lv_pools+=("$lpool")
  virsh -q pool-start "$lpool" >/dev/null
  if ! err=$(virsh -q vol-create-as "$lpool" base 128M --format raw 2>&1); then
    dm=$(dmsetup version 2>&1 | tr '\n' ' ' || true)
    dmsetup version >/dev/null 2>&1 && fail "vol-create-as in a logical pool: $err"
    skip "no device-mapper in this kernel, so no logical volumes: virsh vol-create-as: $(echo "$err" | tr '\n' ' ' | head -c 300); dmsetup: $dm"
  fi
  base=$(virsh vol-path --pool "$lpool" base)
else
  base=$loop
fi
[[ -b $base ]] || fail "$base is not a block device"
echo "BASE: $base ($mode)"

dir_pool "$dpool" "$dir"
qio -f raw "$base" 'write -P 1 0 8M' 'write -P 9 100M 1M'
qemu-img create -q -f qcow2 -b "$base" -F raw ov1.qcow2
qemu-img create -q -f qcow2 -b "$dir/ov1.qcow2" -F qcow2 ov2.qcow2
qio -f qcow2 ov1.qcow2 'write -P 2 1M 2M' 'write -z 100M 64k'
qio -f qcow2 ov2.qcow2 'write -P 3 2M 2M' 'write -z 6M 1M' 'write -P 4 127M 1M'
qemu-img convert -O raw ov1.qcow2 view1.raw
qemu-img convert -O raw ov2.qcow2 view2.raw
virsh -q pool-refresh "$dpool" >/dev/null

# 1. A volume of the dir pool into its raw block-device backing file.
"$QCOMMIT" merge --pool "$dpool" --vol ov1.qcow2 --budget off >out1.txt 2>&1 || soft_fail "pool merge failed: $(cat out1.txt)"
qemu-img compare -q -f raw -F raw view1.raw "$base" || soft_fail "BASE differs from ov1's view after the pool merge"
same_view view2.raw ov2.qcow2 || soft_fail "ov2's view changed by the pool merge"
grep -q "refreshed storage pool $dpool" out1.txt || soft_fail "pool $dpool not refreshed: $(cat out1.txt)"
if [[ $mode == lvm ]]; then
  cap=$(virsh vol-info --pool "$lpool" base --bytes | awk '/Capacity/{print $2}')
  [[ $cap == $((128 * 1024 * 1024)) ]] || soft_fail "vol-info of the logical volume says capacity '$cap'"
fi
alloc_refreshed "$dpool" ov1.qcow2

# 2. The domain's chain into BASE: the disk moves onto the block device.
define_disk_domain "$dom" "$dir/ov2.qcow2"
"$QCOMMIT" merge --domain "$dom" --disk vda --base "$base" --budget off >out2.txt 2>&1 ||
  soft_fail "domain merge failed: $(cat out2.txt)"
qemu-img compare -q -f raw -F raw view2.raw "$base" || soft_fail "BASE differs from ov2's view after the domain merge"
vda_is "$base" || soft_fail "domblklist says vda is '$(vda_source "$dom")', expected $base"
[[ $(vda_xml --inactive) == "block raw:dev=$base end" ]] ||
  soft_fail "definition after the merge: $(vda_xml --inactive), expected block raw:dev=$base end"
if virsh -q start "$dom" >start.err 2>&1; then
  live=$(vda_xml)
  [[ $live == "block raw:dev=$base"* ]] || soft_fail "the started domain runs on '$live'"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
else
  soft_fail "domain does not start on $base: $(cat start.err)"
fi
left=$(find "$dir" "$(dirname "$base")" -maxdepth 1 -name '*.qcommit-merge*' 2>/dev/null | xargs)
[[ -z $left ]] || soft_fail "checkpoint files left behind: $left"
no_journal || soft_fail "merge journal left in the definition"
finish "libvirt.offline_blockdev ($mode): OK"
