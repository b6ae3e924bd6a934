#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.daemon_commit_base: qcommitd watches the image a non-active commit writes into.
# libvirt names no base for `virsh blockcommit --top T --base B` (no <mirror> element); with B an
# intermediate image, the bottom image is the wrong guess.  A running TCG domain on the chain
# base <- mid <- mid2 <- top, a commit of mid2 into mid under qcommitd: `qcommit status` must show
# mid as the job's target (and its pool), and the job must finish with the guest view intact.
# usage: daemon-commit-base.sh QCOMMIT QCOMMITD
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
daemon_test_init libvirt.daemon_commit_base qcb
qemu-img create -q -f qcow2 base.qcow2 256M
qemu-io -c 'write -P 1 0 32M' base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2
qemu-io -c 'write -P 2 16M 32M' mid.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 mid2.qcow2
qemu-io -c 'write -P 3 40M 64M' mid2.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b mid2.qcow2 -F qcow2 top.qcow2
qemu-img convert -O raw top.qcow2 view-before.raw
# A ceiling that keeps the 64 MiB copy running for a few seconds.
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=16M\n'
define_disk_domain "$dom" "$dir/top.qcow2" "$dir"
virsh -q start "$dom" >/dev/null
# 1 MiB/s until qcommitd adopts the job and sets its own speed.
virsh -q blockcommit "$dom" vda --top "$dir/mid2.qcow2" --base "$dir/mid.qcow2" --bandwidth 1 >/dev/null
target=
for ((i = 0; i < 100; i++)); do
  target=$("$QCOMMIT" status --socket "$dir/d.sock" --output=json |
    python3 -c 'import json,sys; j=[x for x in json.load(sys.stdin)["jobs"] if x["disk"]=="vda"]; print(j[0]["target"] if j else "")')
  [[ -n $target ]] && break
  sleep 0.1
done
echo "governed commit --top mid2 --base mid: target $target"
[[ $target == "$dir/mid.qcow2" ]] || fail "target '$target', expected $dir/mid.qcow2"
# The job finishes (libvirt drops it from the chain) under the daemon.
for ((i = 0; i < 600; i++)); do
  virsh -q blockjob "$dom" vda --info 2>/dev/null | grep -q . || break
  sleep 0.1
done
virsh -q blockjob "$dom" vda --info 2>/dev/null | grep -q . && fail "the commit did not finish in 60 s"
virsh -q dumpxml "$dom" | grep -q "mid2.qcow2" && fail "mid2 is still in the chain"
virsh -q destroy "$dom" >/dev/null
qemu-img compare -q top.qcow2 view-before.raw || fail "the guest view changed"
qemu-img check -q mid.qcow2 || fail "mid.qcow2 is not clean"
echo "libvirt.daemon_commit_base: OK"
