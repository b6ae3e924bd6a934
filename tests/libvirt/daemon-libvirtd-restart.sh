#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.daemon_libvirtd_restart: libvirtd restarts while qcommitd governs a block job.
# A running TCG domain on base <- mid <- top, `virsh blockcommit --top mid --base base` under a
# qcommitd whose ceiling keeps the copy running for several seconds.  libvirtd is stopped (SIGTERM:
# QEMU and its job run on) for about 3 s and started again with `libvirtd -d`, as this host runs it
# (no systemd).  qcommitd must:
#   * keep running, say it is not connected, and keep the job (QEMU still runs it);
#   * reconnect by itself once libvirtd is back, and govern the same job again: the same adoption
#     id, one "governing" line in its log, its speed set again (not left where it was);
#   * show the job's end as libvirt reports it: `qcommit status` says "completed", in JSON
#     ("state") and in the table, for a while after the end.
# The guest's view must be intact.  libvirtd is left running whatever happens (the EXIT trap).
# usage: daemon-libvirtd-restart.sh QCOMMIT QCOMMITD
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
host_libvirtd >/dev/null || { echo "libvirtd is not running as a daemon of its own (libvirtd -d); skipped" >&2; exit 77; }
daemon_test_init libvirt.daemon_libvirtd_restart qlr
trap 'ensure_libvirtd || true; daemon_test_cleanup' EXIT

status_json() { "$QCOMMIT" status --socket "$dir/d.sock" --output=json; }
# job_field FIELD: FIELD of the governed job on vda, "" when there is none.
job_field() { status_json | jq -r --arg f "$1" '[.jobs[] | select(.disk == "vda")][0][$f] // ""'; }

qemu-img create -q -f qcow2 base.qcow2 512M
qemu-io -c 'write -P 1 0 32M' base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2
qemu-io -c 'write -P 2 16M 160M' mid.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2
qemu-img convert -O raw top.qcow2 view-before.raw
# 160 MiB at most 8 MiB/s: 20 s or more.
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=8M\n'
define_disk_domain "$dom" "$dir/top.qcow2" "$dir"
virsh -q start "$dom" >/dev/null
virsh -q blockcommit "$dom" vda --top "$dir/mid.qcow2" --base "$dir/base.qcow2" --bandwidth 1 >/dev/null
id=
for ((i = 0; i < 100; i++)); do
  id=$(job_field id)
  [[ -n $id ]] && break
  sleep 0.1
done
[[ -n $id ]] || fail "qcommitd did not adopt the commit"
sleep 1
echo "governing the commit as job $id; stopping libvirtd"

lv=$(host_libvirtd)
kill -TERM "$lv"
for ((i = 0; i < 100; i++)); do kill -0 "$lv" 2>/dev/null || break; sleep 0.1; done
kill -0 "$lv" 2>/dev/null && fail "libvirtd did not stop"
down_at=$(date +%s.%N)
connected=true
for ((i = 0; i < 30; i++)); do
  connected=$(status_json | jq -r .connected)
  [[ $connected == false ]] && break
  sleep 0.1
done
[[ $connected == false ]] || fail "qcommitd still says it is connected with libvirtd stopped"
sleep 3
kill -0 "$dpid" 2>/dev/null || fail "qcommitd exited while libvirtd was down"
[[ $(job_field id) == "$id" ]] || fail "the job was dropped while libvirtd was down: $(status_json)"
ensure_libvirtd || fail "libvirtd did not come back"
up_at=$(date +%s.%N)
echo "libvirtd down for $(echo "$up_at - $down_at" | bc) s; waiting for qcommitd to reconnect"

# Back-off at most 5 s between attempts, plus libvirtd's own reconnect to QEMU.
for ((i = 0; i < 150; i++)); do
  [[ $(status_json | jq -r .connected) == true ]] && break
  sleep 0.1
done
[[ $(status_json | jq -r .connected) == true ]] || fail "qcommitd did not reconnect within 15 s"
back_at=$(date +%s.%N)
echo "reconnected $(echo "$back_at - $up_at" | bc) s after libvirtd came back"
# The same job, governed again: its speed is set anew (a lost speed would show as 1 MiB/s, the
# --bandwidth it started with, only if qcommitd had never set it; here: set after the reconnect).
[[ $(job_field id) == "$id" ]] || fail "the job was not kept as job $id after the reconnect: $(status_json)"
n=$(grep -c "governing commit job on domain" d.log || true)
[[ $n == 1 ]] || fail "$n 'governing' lines in qcommitd's log, expected 1"
# Governed again: an operator's speed (1 MiB/s) is replaced by qcommitd's within a few ticks.
virsh -q blockjob "$dom" vda --bandwidth 1 >/dev/null || fail "the job ended before the test could see it governed again"
bw=
for ((i = 0; i < 30; i++)); do
  sleep 0.1
  bw=$(virsh -q blockjob "$dom" vda --info --bytes 2>/dev/null | sed -n 's/.*Bandwidth limit: \([0-9]*\).*/\1/p')
  [[ -n $bw && $bw != 1048576 ]] && break
done
[[ -n $bw && $bw != 1048576 ]] || fail "qcommitd did not set the job's speed after the reconnect (still $bw)"

# The end, as libvirt tells it.
for ((i = 0; i < 900; i++)); do
  virsh -q blockjob "$dom" vda --info 2>/dev/null | grep -q . || break
  sleep 0.1
done
virsh -q blockjob "$dom" vda --info 2>/dev/null | grep -q . && fail "the commit did not finish in 90 s"
sleep 0.5
state=$(status_json | jq -r --arg id "$id" '[.released[] | select(.id == ($id | tonumber))][0].state // ""')
[[ $state == completed ]] || fail "released job $id shows state '$state', expected completed: $(status_json)"
grep -c "governing commit job on domain" d.log | grep -qx 1 || fail "the job was adopted more than once: $(grep governing d.log)"
"$QCOMMIT" status --socket "$dir/d.sock" >table.txt
grep -E "^$dom +vda +commit .* completed [0-9]+ s ago" table.txt || fail "the table does not show the end: $(cat table.txt)"
virsh -q dumpxml "$dom" | grep -q "mid.qcow2" && fail "mid is still in the chain"
virsh -q destroy "$dom" >/dev/null
qemu-img compare -q top.qcow2 view-before.raw || fail "the guest view changed"
qemu-img check -q base.qcow2 || fail "base.qcow2 is not clean"
echo "libvirt.daemon_libvirtd_restart: OK"
