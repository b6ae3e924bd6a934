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
# The guest's view must be intact.  libvirtd is left running whatever happens.
# usage: daemon-libvirtd-restart.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
restart_test_init libvirt.daemon_libvirtd_restart qlr

status_json() { qstatus --output=json; }
# job_field FIELD: FIELD of the governed job on vda, "" when there is none.
job_field() { status_json | jq -r --arg f "$1" '[.jobs[] | select(.disk == "vda")][0][$f] // ""'; }
connected() { [[ $(status_json | jq -r .connected) == "$1" ]]; }
adopted() { id=$(job_field id); [[ -n $id ]]; }
# The job's speed is set, not the operator's 1 MiB/s.
speed_reset() { bw=$(job_bandwidth); [[ -n $bw && $bw != 1048576 ]]; }

# 160 MiB at most 8 MiB/s: 20 s or more.
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=8M\n'
start_domain 512M base.qcow2='write -P 1 0 32M' mid.qcow2='write -P 2 16M 160M' top.qcow2
virsh -q blockcommit "$dom" vda --top "$dir/mid.qcow2" --base "$dir/base.qcow2" --bandwidth 1 >/dev/null
wait_until 10 adopted || fail "qcommitd did not adopt the commit"
sleep 1
echo "governing the commit as job $id; stopping libvirtd"

stop_libvirtd || fail "libvirtd did not stop"
down_at=$(date +%s.%N)
wait_until 3 connected false || fail "qcommitd still says it is connected with libvirtd stopped"
sleep 3
gone "$dpid" && fail "qcommitd exited while libvirtd was down"
[[ $(job_field id) == "$id" ]] || fail "the job was dropped while libvirtd was down: $(status_json)"
ensure_libvirtd || fail "libvirtd did not come back"
up_at=$(date +%s.%N)
echo "libvirtd down for $(echo "$up_at - $down_at" | bc) s; waiting for qcommitd to reconnect"

# Back-off at most 5 s between attempts, plus libvirtd's own reconnect to QEMU.
wait_until 15 connected true || fail "qcommitd did not reconnect within 15 s"
echo "reconnected $(echo "$(date +%s.%N) - $up_at" | bc) s after libvirtd came back"
# The same job, governed again: its speed is set anew (a lost speed would show as 1 MiB/s, the
# --bandwidth it started with, only if qcommitd had never set it; here: set after the reconnect).
[[ $(job_field id) == "$id" ]] || fail "the job was not kept as job $id after the reconnect: $(status_json)"
n=$(grep -c "governing commit job on domain" d.log || true)
[[ $n == 1 ]] || fail "$n 'governing' lines in qcommitd's log, expected 1"
# Governed again: an operator's speed (1 MiB/s) is replaced by qcommitd's within a few ticks.
virsh -q blockjob "$dom" vda --bandwidth 1 >/dev/null || fail "the job ended before the test could see it governed again"
wait_until 3 speed_reset || fail "qcommitd did not set the job's speed after the reconnect (still $bw)"

# The end, as libvirt tells it.
wait_until 90 no_blockjob || fail "the commit did not finish in 90 s"
sleep 0.5
state=$(status_json | jq -r --arg id "$id" '[.released[] | select(.id == ($id | tonumber))][0].state // ""')
[[ $state == completed ]] || fail "released job $id shows state '$state', expected completed: $(status_json)"
grep -c "governing commit job on domain" d.log | grep -qx 1 || fail "the job was adopted more than once: $(grep governing d.log)"
qstatus >table.txt
grep -E "^$dom +vda +commit .* completed [0-9]+ s ago" table.txt || fail "the table does not show the end: $(cat table.txt)"
virsh -q dumpxml "$dom" | grep -q "mid.qcow2" && fail "mid is still in the chain"
virsh -q destroy "$dom" >/dev/null
view_kept view-before.raw top.qcow2
qemu-img check -q base.qcow2 || fail "base.qcow2 is not clean"
echo "libvirt.daemon_libvirtd_restart: OK"
