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
# Cleans up domain, pools, VG/PV and loop device on exit.
# usage: offline-blockdev.sh QCOMMIT lvm|loop
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
mode=$2
kSkip=77
skip() { echo "SKIP: $*"; exit "$kSkip"; }
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
[[ $(id -u) == 0 ]] || skip "needs root (losetup)"
[[ -e /dev/loop-control ]] || skip "no /dev/loop-control: this machine cannot create loop devices"
if [[ $mode == lvm ]]; then
  command -v vgcreate >/dev/null || skip "lvm2 is not installed (apt-get install lvm2)"
fi
tag=qcb-$$-$RANDOM
dir=/var/lib/libvirt/images/$tag
img=/var/tmp/$tag.pv
dom=$tag-dom
dpool=$tag-dir
lpool=$tag-lvm
vg=${tag//-/_}
loop=
export LVM_SUPPRESS_FD_WARNINGS=1
cleanup() {
  set +e
  virsh -q destroy "$dom" >/dev/null 2>&1
  virsh -q undefine "$dom" --snapshots-metadata >/dev/null 2>&1
  local p
  for p in "$dpool" "$lpool"; do
    virsh -q pool-destroy "$p" >/dev/null 2>&1
    virsh -q pool-undefine "$p" >/dev/null 2>&1
  done
  if [[ $mode == lvm && -n $loop ]]; then
    vgremove -q -f "$vg" >/dev/null 2>&1
    pvremove -q "$loop" >/dev/null 2>&1
  fi
  [[ -n $loop ]] && losetup -d "$loop"
  rm -rf "$dir" "$img"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
fails=()
fail() { echo "FAIL: $*" >&2; fails+=("$*"); }
size=128M

truncate -s 192M "$img"
loop=$(losetup --find --show "$img") || skip "losetup refused: $(losetup --find --show "$img" 2>&1)"
if [[ $mode == lvm ]]; then
  pvcreate -q "$loop" >/dev/null
  vgcreate -q "$vg" "$loop" >/dev/null
  virsh -q pool-define-as "$lpool" logical --source-name "$vg" --target "/dev/$vg" >/dev/null
  virsh -q pool-start "$lpool" >/dev/null
  if ! err=$(virsh -q vol-create-as "$lpool" base "$size" --format raw 2>&1); then
    dm=$(dmsetup version 2>&1 | tr '\n' ' ' || true)
    dmsetup version >/dev/null 2>&1 && { echo "FAIL: vol-create-as in a logical pool: $err" >&2; exit 1; }
    skip "no device-mapper in this kernel, so no logical volumes: virsh vol-create-as: $(echo "$err" | tr '\n' ' ' | head -c 300); dmsetup: $dm"
  fi
  base=$(virsh vol-path --pool "$lpool" base)
else
  base=$loop
fi
[[ -b $base ]] || { echo "FAIL: $base is not a block device" >&2; exit 1; }
echo "BASE: $base ($mode)"

mkdir -p "$dir"
cd "$dir"
virsh -q pool-define-as "$dpool" dir --target "$dir" >/dev/null
virsh -q pool-start "$dpool" >/dev/null
qemu-io -f raw -c 'write -P 1 0 8M' -c "write -P 9 100M 1M" "$base" >/dev/null
qemu-img create -q -f qcow2 -b "$base" -F raw ov1.qcow2
qemu-img create -q -f qcow2 -b "$dir/ov1.qcow2" -F qcow2 ov2.qcow2
qemu-io -c 'write -P 2 1M 2M' -c 'write -z 100M 64k' ov1.qcow2 >/dev/null
qemu-io -c 'write -P 3 2M 2M' -c 'write -z 6M 1M' -c 'write -P 4 127M 1M' ov2.qcow2 >/dev/null
qemu-img convert -O raw ov1.qcow2 view1.raw
qemu-img convert -O raw ov2.qcow2 view2.raw
virsh -q pool-refresh "$dpool" >/dev/null

# 1. A volume of the dir pool into its raw block-device backing file.
"$QCOMMIT" merge --pool "$dpool" --vol ov1.qcow2 --budget off >out1.txt 2>&1 || fail "pool merge failed: $(cat out1.txt)"
qemu-img compare -q -f raw -F raw view1.raw "$base" || fail "BASE differs from ov1's view after the pool merge"
qemu-img compare -q view2.raw ov2.qcow2 || fail "ov2's view changed by the pool merge"
grep -q "refreshed storage pool $dpool" out1.txt || fail "pool $dpool not refreshed: $(cat out1.txt)"
if [[ $mode == lvm ]]; then
  cap=$(virsh vol-info --pool "$lpool" base --bytes | awk '/Capacity/{print $2}')
  [[ $cap == $((128 * 1024 * 1024)) ]] || fail "vol-info of the logical volume says capacity '$cap'"
fi
alloc=$(virsh vol-info --pool "$dpool" ov1.qcow2 --bytes | awk '/Allocation/{print $2}')
[[ $alloc == $(($(stat -c '%b * %B' ov1.qcow2))) ]] || fail "vol-info allocation of ov1 $alloc != the file's"

# 2. The domain's chain into BASE: the disk moves onto the block device.
define_disk_domain "$dom" "$dir/ov2.qcow2"
"$QCOMMIT" merge --domain "$dom" --disk vda --base "$base" --budget off >out2.txt 2>&1 ||
  fail "domain merge failed: $(cat out2.txt)"
qemu-img compare -q -f raw -F raw view2.raw "$base" || fail "BASE differs from ov2's view after the domain merge"
src=$(vda_source "$dom")
[[ $src == "$base" ]] || fail "domblklist says vda is '$src', expected $base"
virsh dumpxml --inactive "$dom" | python3 -c '
import sys, xml.etree.ElementTree as ET
base = sys.argv[1]
disk = next(d for d in ET.parse(sys.stdin).getroot().iter("disk") if d.find("target").get("dev") == "vda")
problems = []
if disk.get("type") != "block": problems.append("type=%s" % disk.get("type"))
if disk.find("driver").get("type") != "raw": problems.append("driver type=%s" % disk.find("driver").get("type"))
if disk.find("source").get("dev") != base: problems.append("source=%s" % disk.find("source").attrib)
bs = disk.find("backingStore")
if bs is None or len(bs) != 0: problems.append("backingStore is not the empty terminator")
print("; ".join(problems))
sys.exit(1 if problems else 0)' "$base" >xml.txt || fail "definition after the merge: $(cat xml.txt)"
if virsh -q start "$dom" >start.err 2>&1; then
  live=$(virsh dumpxml "$dom" | python3 -c '
import sys, xml.etree.ElementTree as ET
disk = next(d for d in ET.parse(sys.stdin).getroot().iter("disk") if d.find("target").get("dev") == "vda")
print(disk.get("type"), disk.find("source").get("dev"))')
  [[ $live == "block $base" ]] || fail "the started domain runs on '$live'"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
else
  fail "domain does not start on $base: $(cat start.err)"
fi
left=$(find "$dir" "$(dirname "$base")" -maxdepth 1 -name '*.qcommit-merge*' 2>/dev/null | xargs)
[[ -z $left ]] || fail "checkpoint files left behind: $left"
! virsh -q metadata "$dom" urn:qcommit:domain-merge --config >/dev/null 2>&1 || fail "merge journal left in the definition"

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.offline_blockdev ($mode): OK"
