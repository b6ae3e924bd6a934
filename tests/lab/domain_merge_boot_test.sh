#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# ctest lab.domain_merge_boot: offline `qcommit merge --domain` / `--pool --vol` of a chain the
# guest itself wrote, on the lab's FUSE storage, then the guest boots again and reads it back.
#
# The test guest (lab.mode=pattern, tests/lab/guest/probe.c) runs on base.raw. It writes pattern
# phase 0; then three times: `virsh snapshot-create-as --disk-only` while it runs (s1, s2, s3 on
# the lab mount) and the next phase (known patterns at known offsets, fsynced, CRC-32 of the
# region read back printed on the console). Shut off; the chain's view is saved and checked
# against the regenerated patterns (tests/lab/boot_verify.py). Then, one range at a time:
#   1. merge --domain --top s1 --base base.raw  (below the active layer)
#   2. merge --domain                           (the active layer s3 into s2)
#   3. merge --pool P --vol s2.qcow2            (P: a `dir` pool whose target is the FUSE mount,
#                                                the stand-in for NFS: no netfs in containers)
#   4. merge --domain                           (s2 into base.raw: the disk becomes raw)
# After each: qemu-img compare with the saved view, qemu-img check, domblklist, the dumpxml
# <backingStore> chain = the files' chain, snapshot-list (metadata of merged states gone), and
# after 1 (chain rewritten below the active layer) and 4 (disk moved onto the raw base) the guest
# boots from the merged chain and prints the same CRC it printed after writing its last phase
# (TCG boots take 10-35 s each, so not after every step). Run under `flock /tmp/qcommit-lab.lock` (shared lab).
# usage: domain_merge_boot_test.sh QCOMMIT
set -euo pipefail
here=$(dirname "$0")
QCOMMIT=$(realpath "$1")
source "$here/lab.sh"

kDiskSize=64M
kBootS=180  # TCG boot of the busybox guest: ~10 s idle, much more on a loaded host
kPhases=3


"$LAB_SOURCE_DIR/scripts/lab-cleanup" >&2
lab_init dmboot
pool=$LAB_ID-pool
cmd_sock=/tmp/$LAB_ID.cmd.sock  # short: a unix socket path under the build dir may exceed 107 bytes
cleanup() {
  virsh -q destroy "$LAB_DOM" >/dev/null 2>&1 || true
  virsh -q undefine "$LAB_DOM" --snapshots-metadata >/dev/null 2>&1 || true
  virsh -q pool-destroy "$pool" >/dev/null 2>&1 || true
  virsh -q pool-undefine "$pool" >/dev/null 2>&1 || true
  rm -f "$cmd_sock"
  lab_teardown
}
trap cleanup EXIT
lab_storage_start --bandwidth 50M
lab_storage_set 5G  # correctness, not latency: fast storage

base=$LAB_MNT/base.raw
truncate -s "$kDiskSize" "$base"
cp "$LAB_CACHE/vmlinuz" "$LAB_CACHE/initramfs.cpio.gz" "$LAB_DIR/"
: >"$LAB_DIR/console.log"
cat >"$LAB_DIR/domain.xml" <<EOF
<domain type='qemu'>
  <name>$LAB_DOM</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>$LAB_DIR/vmlinuz</kernel>
    <initrd>$LAB_DIR/initramfs.cpio.gz</initrd>
    <cmdline>console=ttyS0 quiet panic=1 lab.mode=pattern</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='$base'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='file'>
      <source path='$LAB_DIR/console.log' append='on'/>
      <target port='0'/>
    </serial>
    <serial type='unix'>
      <source mode='bind' path='$cmd_sock'/>
      <target port='1'/>
    </serial>
    <memballoon model='none'/>
  </devices>
</domain>
EOF
virsh -q define "$LAB_DIR/domain.xml" >/dev/null
LAB_DOM_DEFINED=1

# wait_line REGEX FROM_LINE TIMEOUT_S: echoes the first console line after FROM_LINE matching.
wait_line() {
  local re=$1 from=$2 deadline=$((SECONDS + $3)) line
  while ((SECONDS < deadline)); do
    line=$(tail -n +"$((from + 1))" "$LAB_DIR/console.log" | tr -d '\r' | grep -E -m1 "$re" || true)
    [[ -n $line ]] && { echo "$line"; return 0; }
    if tail -n +"$((from + 1))" "$LAB_DIR/console.log" | grep -q "LAB ERROR"; then
      fail "guest: $(grep -m1 'LAB ERROR' "$LAB_DIR/console.log" | tr -d '\r')"
    fi
    virsh -q domstate "$LAB_DOM" 2>/dev/null | grep -q running || fail "guest $LAB_DOM is not running"
    sleep 0.2
  done
  fail "no console line matching '$re' within $3 s (see $LAB_DIR/console.log)"
}
console_lines() { wc -l <"$LAB_DIR/console.log"; }
# guest COMMAND: one line to the guest's command port (ttyS1).
guest() {
  python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall((sys.argv[2] + "\n").encode())
s.close()' "$cmd_sock" "$1"
}
# boot: starts the domain and echoes the CRC the guest reads at boot.
boot() {
  local from t0=$SECONDS
  from=$(console_lines)
  virsh -q start "$LAB_DOM" >/dev/null || fail "domain does not start"
  local line
  line=$(wait_line '^LAB SUM ' "$from" "$kBootS")
  lab_log "guest booted in $((SECONDS - t0)) s: $line"
  echo "${line##* }"
}
shutoff() {
  virsh -q destroy "$LAB_DOM" >/dev/null 2>&1 || true
  wait_until 10 _lab_shut_off "$LIBVIRT_DEFAULT_URI" "$LAB_DOM" || fail "domain does not shut off"
}

# --- The guest writes; snapshots between its phases ---------------------------------------
boot >/dev/null
from=$(console_lines)
guest "W 0"
line=$(wait_line '^LAB WROTE 0 ' "$from" 120)
for k in $(seq "$kPhases"); do
  virsh -q snapshot-create-as "$LAB_DOM" "s$k" --disk-only --atomic \
    --diskspec "vda,snapshot=external,file=$LAB_MNT/s$k.qcow2" >/dev/null
  from=$(console_lines)
  guest "W $k"
  line=$(wait_line "^LAB WROTE $k " "$from" 120)
done
crc=${line##* }
lab_log "guest wrote phases 0..$kPhases, region CRC $crc"
[[ $(virsh -q snapshot-list "$LAB_DOM" --name | xargs) == "s1 s2 s3" ]] || fail "snapshot-list after the snapshots"
shutoff
sync
qemu-img convert -O raw "$LAB_MNT/s3.qcow2" "$LAB_DIR/view0.raw"
host_crc=$(python3 "$here/boot_verify.py" "$LAB_DIR/view0.raw" "$kPhases") || fail "the chain does not hold the guest's patterns"
[[ $host_crc == "$crc" ]] || fail "host CRC of the chain's view $host_crc != guest's $crc"
for k in $(seq "$kPhases"); do
  # Each overlay holds data of its own (the guest wrote after each snapshot).
  n=$(qemu-img map --output=json "$LAB_MNT/s$k.qcow2" | jq '[.[] | select(.depth == 0 and .data)] | length')
  ((n > 0)) || fail "s$k.qcow2 holds no data of its own"
done

file_chain() { qemu-img info --backing-chain --output=json "$1" | jq -r '.[] | ."filename"' | xargs -n1 realpath; }
xml_chain() {
  virsh dumpxml --inactive "$LAB_DOM" | python3 -c '
import sys, xml.etree.ElementTree as ET
for disk in ET.parse(sys.stdin).getroot().iter("disk"):
    if disk.find("target").get("dev") != "vda":
        continue
    n = disk
    while n is not None and n.find("source") is not None:
        print(n.find("source").get("file") or n.find("source").get("dev"))
        n = n.find("backingStore")'
}
# check STEP ACTIVE "CHAIN FILES" "SNAPSHOTS"
check() {
  local step=$1 active=$2 chain=$3 snaps=$4 f want have
  have=$(virsh domblklist "$LAB_DOM" | awk '$1=="vda"{print $2}')
  [[ $have == "$LAB_MNT/$active" ]] || fail "$step: domblklist says vda is '$have', expected $LAB_MNT/$active"
  want=$(for f in $chain; do echo "$LAB_MNT/$f"; done | xargs)
  have=$(file_chain "$LAB_MNT/$active" | xargs)
  [[ $have == "$want" ]] || fail "$step: files' chain '$have', expected '$want'"
  have=$(xml_chain | xargs)
  [[ $have == "$want" ]] || fail "$step: dumpxml chain '$have', expected '$want'"
  have=$(virsh -q snapshot-list "$LAB_DOM" --name | xargs)
  [[ $have == "$snaps" ]] || fail "$step: snapshot-list '$have', expected '$snaps'"
  qemu-img compare -q "$LAB_DIR/view0.raw" "$LAB_MNT/$active" || fail "$step: the guest view changed"
  for f in $chain; do
    [[ $f == *.qcow2 ]] || continue
    qemu-img check -q "$LAB_MNT/$f" || fail "$step: qemu-img check $f not clean"
  done
}
merge() {
  local step=$1
  shift
  lab_log "$step: qcommit merge $*"
  "$QCOMMIT" merge "$@" --budget off >"$LAB_DIR/$step.out" 2>&1 || fail "$step: merge failed: $(cat "$LAB_DIR/$step.out")"
}
boot_check() {
  local got
  got=$(boot)
  [[ $got == "$crc" ]] || fail "$1: the guest reads CRC $got from the merged chain, it wrote $crc"
  shutoff
}

merge m1 --domain "$LAB_DOM" --disk vda --top "$LAB_MNT/s1.qcow2" --base "$base"
check m1 s3.qcow2 "s3.qcow2 s2.qcow2 base.raw" "s3"
boot_check m1

merge m2 --domain "$LAB_DOM" --disk vda
check m2 s2.qcow2 "s2.qcow2 base.raw" ""

virsh -q pool-define-as "$pool" dir --target "$LAB_MNT" >/dev/null
virsh -q pool-start "$pool" >/dev/null
merge m3 --pool "$pool" --vol s2.qcow2
check m3 s2.qcow2 "s2.qcow2 base.raw" ""
qemu-img compare -q -f raw "$LAB_DIR/view0.raw" "$base" || fail "m3: base.raw does not hold the view"
grep -q "refreshed storage pool $pool" "$LAB_DIR/m3.out" || fail "m3: pool not refreshed: $(cat "$LAB_DIR/m3.out")"
alloc=$(virsh vol-info --pool "$pool" base.raw --bytes | awk '/Allocation/{print $2}')
[[ $alloc == $(($(stat -c '%b * %B' "$base"))) ]] || fail "m3: vol-info allocation of base.raw $alloc != the file's"

merge m4 --domain "$LAB_DOM" --disk vda
check m4 base.raw "base.raw" ""
virsh dumpxml --inactive "$LAB_DOM" | grep -q "<driver name='qemu' type='raw'/>" || fail "m4: disk driver is not raw"
grep -q "refreshed storage pool $pool" "$LAB_DIR/m4.out" || fail "m4: pool holding base.raw not refreshed"
boot_check m4

echo "PASS lab.domain_merge_boot: guest CRC $crc read back after each merge ($SECONDS s)"
