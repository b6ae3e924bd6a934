#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.file_safety: the forms of a merge that go through libvirt open nothing beside the images
# in a way a planted symlink, FIFO or hard link could turn against them (hostile.file_safety does
# the same for the commands on files; tests/hostile/strace_writes.py judges the strace log):
#   qcommit live DOM vda --pivot (two-phase: qcommit makes the fresh overlay, qemu-img writes it
#       through qcommit's descriptor), on a running TCG domain, no qcommitd;
#   qcommit merge --domain DOM --disk vda on the same chain once the domain is shut off.
# Each ends with base.qcow2 holding the guest's view. About 30 s.
# usage: file-safety.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
judge=$(cd "$(dirname "$0")/../hostile" && pwd)/strace_writes.py
command -v strace >/dev/null || { echo "strace not installed: skipped"; exit 77; }
lv_setup libvirt.file_safety qfs

# traced NAME ARGS...: qcommit ARGS under strace (exit 0 required), its openings judged; then vda
# must be on base.qcow2, which holds the guest's view.
traced() {
  local name=$1 rc=0
  shift
  strace -f -qq -s 4096 -e trace=open,openat,creat -o "trace-$name.log" \
    timeout 180 "$QCOMMIT" "$@" >"out-$name" 2>"err-$name" </dev/null || rc=$?
  [[ $rc == 0 ]] || fail "$name: exit $rc: $(head -c 300 "err-$name")"
  python3 "$judge" "trace-$name.log" --allowed "$dir/base.qcow2" --allowed "$dir/top.qcow2" \
    >"verdict-$name" || fail "$name: $(head -c 600 "verdict-$name")"
  echo "  $name: every opening for writing was safe"
  vda_is "$dir/base.qcow2" || fail "$name: vda is not on base.qcow2"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
  view_kept view-before.raw base.qcow2 "$name"
}

start_domain 64M "$dir/base.qcow2=write -P 1 0 16M" "$dir/top.qcow2=write -P 2 8M 16M"
traced live live "$dom" vda --pivot --max-rate 32M --socket "$dir/none.sock"
# The offline form: a fresh top over the merged base, the domain shut off on it.
virsh -q undefine "$dom" >/dev/null
qemu-img create -q -f qcow2 -b "$dir/base.qcow2" -F qcow2 top.qcow2
qio -f qcow2 top.qcow2 'write -P 3 4M 8M'
qemu-img convert -O raw top.qcow2 view-before.raw
define_disk_domain "$dom" "$dir/top.qcow2"
traced merge-domain merge --domain "$dom" --disk vda --budget off
echo "libvirt.file_safety: passed"
