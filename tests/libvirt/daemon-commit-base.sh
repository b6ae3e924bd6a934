#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.daemon_commit_base: qcommitd watches the image a non-active commit writes into.
# libvirt names no base for `virsh blockcommit --top T --base B` (no <mirror> element); with B an
# intermediate image, the bottom image is the wrong guess.  A running TCG domain on the chain
# base <- mid <- mid2 <- top, a commit of mid2 into mid under qcommitd: `qcommit status` must show
# mid as the job's target, and the job must finish with the guest view intact.
# usage: daemon-commit-base.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
lv_setup libvirt.daemon_commit_base qcb
# A ceiling that keeps the 64 MiB copy running for a few seconds.
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=16M\n'
start_domain 256M base.qcow2='write -P 1 0 32M' mid.qcow2='write -P 2 16M 32M' mid2.qcow2='write -P 3 40M 64M' top.qcow2
# 1 MiB/s until qcommitd adopts the job and sets its own speed.
virsh -q blockcommit "$dom" vda --top "$dir/mid2.qcow2" --base "$dir/mid.qcow2" --bandwidth 1 >/dev/null
vda_target() { target=$(qstatus --output=json | jq -r '[.jobs[] | select(.disk == "vda")][0].target // ""'); [[ -n $target ]]; }
wait_until 30 vda_target || true
echo "governed commit --top mid2 --base mid: target $target"
[[ $target == "$dir/mid.qcow2" ]] || fail "target '$target', expected $dir/mid.qcow2"
# The job finishes (libvirt drops it from the chain) under the daemon.
wait_until 60 no_blockjob || fail "the commit did not finish in 60 s"
virsh -q dumpxml "$dom" | grep -q "mid2.qcow2" && fail "mid2 is still in the chain"
virsh -q destroy "$dom" >/dev/null
view_kept view-before.raw top.qcow2
qemu-img check -q mid.qcow2 || fail "mid.qcow2 is not clean"
echo "libvirt.daemon_commit_base: OK"
