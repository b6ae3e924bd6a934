#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.doctor_qmp: `qcommit doctor --qmp SOCKET` reads a QEMU that libvirt does not manage through
# the QMP adapter. A real QEMU (paused, TCG) named dq with iothreads iot1 and iot2 and the disks
#   vda   -blockdev: file node aio=native, O_DIRECT, qcow2 with a backing file; virtio-blk on iot1
#   vdb   -blockdev: O_DIRECT, no aio (QEMU's default: threads); virtio-blk on the main loop
#   drv3  -drive cache=none,aio=native; scsi-hd on a virtio-scsi controller on iot2
#   drv4  -drive without a cache mode (the host page cache); virtio-blk on the main loop
#   sdh   hot-plugged over QMP (blockdev-add, device_add): O_DIRECT, scsi-hd on the same controller
# must each get their cache mode, io mode (from QEMU's command line; not known for sdh), iothread
# and the filesystem of their layers; qcommitd is said to be skipped, the QEMU version caveat
# comes from query-version, and a second QEMU without iothreads is said to have none. Usage
# errors: --qmp with a DOMAIN or with --connect (exit 2), a socket nobody serves (exit 1, one line).
# About 2 s.
# usage: doctor-qmp.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QMP=$(realpath "$(dirname "$0")/../qmp/qmp.py")
setup cli.doctor_qmp

for d in base vdb drv3 drv4 sdh solo; do image $d.qcow2 16M; done
overlay vda.qcow2 base.qcow2

start_qemu "$work/q.sock" -name dq -object iothread,id=iot1 -object iothread,id=iot2 \
  -blockdev "driver=file,filename=$work/vda.qcow2,node-name=vda-file,aio=native,cache.direct=on" \
  -blockdev driver=qcow2,file=vda-file,node-name=vda-fmt,cache.direct=on \
  -device virtio-blk-pci,drive=vda-fmt,id=vda,iothread=iot1,write-cache=on \
  -blockdev "{\"driver\": \"qcow2\", \"node-name\": \"vdb-fmt\", \"cache\": {\"direct\": true},
              \"file\": {\"driver\": \"file\", \"filename\": \"$work/vdb.qcow2\", \"cache\": {\"direct\": true}}}" \
  -device '{"driver": "virtio-blk-pci", "drive": "vdb-fmt", "id": "vdb", "write-cache": "on"}' \
  -device virtio-scsi-pci,id=scsi0,iothread=iot2 \
  -drive "file=$work/drv3.qcow2,if=none,id=drv3,format=qcow2,cache=none,aio=native" \
  -device scsi-hd,drive=drv3,id=sd3,bus=scsi0.0 \
  -drive "file=$work/drv4.qcow2,if=none,id=drv4,format=qcow2" -device virtio-blk-pci,drive=drv4,id=vd4
"$QMP" q.sock blockdev-add "{\"driver\": \"qcow2\", \"node-name\": \"sdh-fmt\", \"cache\": {\"direct\": true},
  \"file\": {\"driver\": \"file\", \"filename\": \"$work/sdh.qcow2\", \"aio\": \"native\", \"cache\": {\"direct\": true}}}" >/dev/null
"$QMP" q.sock device_add '{"driver": "scsi-hd", "drive": "sdh-fmt", "id": "sdh", "bus": "scsi0.0", "write-cache": "on"}' >/dev/null

# Findings first, exit status after: a doctor without --qmp fails on what it does not say.
rc=0; "$QCOMMIT" doctor --qmp q.sock --output=json >doctor.json 2>doctor.err || rc=$?
"$QCOMMIT" doctor --qmp q.sock >doctor.txt 2>&1 || true
on=$(findmnt -n -o FSTYPE,TARGET -T "$work" | awk '{print $1 " at " $2}')

expect_finding doctor.json "domain dq disk vda" "ok cache=none (O_DIRECT)"
expect_finding doctor.json "domain dq disk vda" "ok iothread iot1 |"
expect_finding doctor.json "domain dq disk vda" "ok 2 layers, on $on |"
no_finding doctor.json "domain dq disk vda" "io mode"
expect_finding doctor.json "domain dq disk vdb" "ok cache=none (O_DIRECT)"
expect_finding doctor.json "domain dq disk vdb" "info io mode is 'threads' | with O_DIRECT, aio=native keeps"
expect_finding doctor.json "domain dq disk vdb" \
  "info no iothread: the disk shares QEMU's main loop | QEMU has iothreads but none serves this disk"
expect_finding doctor.json "domain dq disk drv3" "ok cache=none (O_DIRECT)"
expect_finding doctor.json "domain dq disk drv3" "ok iothread iot2 |"
no_finding doctor.json "domain dq disk drv3" "io mode"
expect_finding doctor.json "domain dq disk drv4" "warn cache mode is writeback (cache.direct=off) |"
expect_finding doctor.json "domain dq disk drv4" "ok 1 layer, on $on |"
expect_finding doctor.json "domain dq disk sdh" "skip io mode not known |"
expect_finding doctor.json "domain dq disk sdh" "ok iothread iot2 |"
[[ $(jq '[.findings[] | select(.subject | startswith("domain dq disk "))] | map(.subject) | unique | length' doctor.json) == 5 ]] ||
  fail "not five disks: $(jq -c '[.findings[].subject] | unique' doctor.json)"
expect_finding doctor.json qcommitd "skip not checked (--qmp) | qcommitd governs the block jobs of libvirt's domains"
[[ -z $(findings doctor.json libvirt) ]] || fail "a libvirt finding with --qmp: $(findings doctor.json libvirt)"
version=$(qemu-system-x86_64 --version | sed -nE 's/^QEMU emulator version ([0-9]+)\.([0-9]+).*/\1 \2/p')
read -r major minor <<<"$version"
if ((major < 8 || (major == 8 && minor < 1))); then
  expect_finding doctor.json "QEMU $major.$minor" "info lowering a block job's speed"
fi
grep -qx "\[skip\] qcommitd: not checked (--qmp)" doctor.txt || fail "human output: $(cat doctor.txt)"
grep -qx "\[ok  \] domain dq disk vda: iothread iot1" doctor.txt || fail "human output: $(cat doctor.txt)"
[[ $rc == 0 && ! -s doctor.err ]] || fail "doctor --qmp: exit $rc, $(cat doctor.err)"
stop "$qemu_pid"

# A QEMU without iothreads; its name from the socket's file name.
start_qemu "$work/solo.sock" -drive "file=$work/solo.qcow2,if=none,id=solo,format=qcow2,cache=none" \
  -device virtio-blk-pci,drive=solo,id=vd0
"$QCOMMIT" doctor --qmp solo.sock --output=json >solo.json
expect_finding solo.json "domain solo disk solo" \
  "info no iothread: the disk shares QEMU's main loop | QEMU has no iothread;"
expect_finding solo.json "domain solo disk solo" "info io mode is 'threads'"

try "$QCOMMIT" doctor --qmp solo.sock vm1
[[ $rc == 2 ]] && grep -q "no DOMAIN with it" err.txt || fail "--qmp with a DOMAIN: rc $rc, $(cat err.txt)"
try "$QCOMMIT" doctor --qmp solo.sock -c test:///default
[[ $rc == 2 ]] && grep -q -- "--qmp and --connect exclude each other" err.txt || fail "--qmp with --connect: rc $rc, $(cat err.txt)"
stop "$qemu_pid"
fails_with 1 "$work/solo.sock: cannot connect" "$QCOMMIT" doctor --qmp "$work/solo.sock"
[[ ! -s out.txt ]] || fail "--qmp on a socket nobody serves: $(cat out.txt)"
echo "cli.doctor_qmp: OK"
