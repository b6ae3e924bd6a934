#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.live_beside_daemon: `qcommit live` on a host where qcommitd runs. A running TCG domain
# on base <- top, qcommitd on a private socket (its ceiling keeps each copy running a few seconds).
#  1. Somebody else's active commit runs on the disk: `--wait 0` refuses at once, one line naming
#     the job; with `--wait 30s` it is waited out (said once, a "wait" event) until its owner
#     aborts it 2 s later.
#  2. Then the two-phase merge with --pivot runs, governed by qcommitd: the plan names qcommitd,
#     progress events carry qcommitd's figures for the disk, qcommitd's log shows it adopted the
#     jobs, the disk ends on base.qcow2 and base.qcow2 holds the guest's view, clean.
# usage: live-beside-daemon.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
lv_setup libvirt.live_beside_daemon qlbd
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=16M\n'
start_domain 256M base.qcow2='write -P 1 0 32M' top.qcow2='write -P 2 16M 48M'

echo "case 1: somebody else's active commit on vda"
virsh -q blockcommit "$dom" vda --active --bandwidth 1 >/dev/null
fails_with 1 "the active-commit block job on $dom vda" "$QCOMMIT" live "$dom" vda --pivot --daemon-socket "$dir/d.sock" --wait 0
echo "  --wait 0 -> exit $rc: $(cat err.txt)"
# The owner aborts its job 2 s after qcommit live said it waits (or after 30 s, so that a
# qcommit live that never waits fails below instead of hanging here).
: >events
(wait_until 30 grep -q '"event": "wait"' events || true; sleep 2; virsh -q blockjob "$dom" vda --abort >/dev/null 2>&1 || true) &
aborter=$!

echo "case 2: waited out, then qcommit live --pivot under qcommitd"
rc=0 t0=$SECONDS
timeout 120 "$QCOMMIT" live "$dom" vda --pivot --daemon-socket "$dir/d.sock" --wait 30s \
  --output=json >events 2>err || rc=$?
wait "$aborter"
echo "  exit $rc in $((SECONDS - t0)) s; events: $(jq -r .event events | sort | uniq -c | tr -s ' \n' ' ')"
[[ $rc == 0 ]] || fail "qcommit live beside qcommitd: exit $rc: $(cat err)"
((SECONDS - t0 >= 2)) || fail "qcommit live did not wait for the foreign job"
grep -q "waiting up to 30s for the active-commit block job on $dom vda" events ||
  fail "the wait event does not name the job"
[[ $(jq -se 'map(select(.event == "wait" and .for == "block-job")) | length' events) == 1 ]] ||
  fail "expected exactly one wait event: $(cat events)"
jq -se --arg dom "$dom" 'map(select(.event == "wait"))[0] | .domain == $dom and .disk == "vda" and
  .job == "active-commit" and (.percent | type) == "number" and .["timeout-s"] == 30' events >/dev/null ||
  fail "the wait event does not say what it waits for (block-job, $dom vda, active-commit, 30 s): $(jq -c 'select(.event == "wait")' events)"
jq -se --arg s "$dir/d.sock" 'map(select(.event == "plan"))[0].governor == "qcommitd (\($s))"' events >/dev/null ||
  fail "the plan does not name qcommitd as the governor: $(head -n 2 events)"
# qcommitd's figures for this disk: a speed it set, a phase, and a percent from the job.
n=$(jq -se 'map(select(.event == "progress" and .speed_bytes_per_s > 0 and (.phase | length) > 0 and .percent != null)) | length' events)
echo "  progress events with qcommitd's speed, phase and percent: $n"
((n >= 2)) || fail "expected progress from qcommitd: $(grep progress events | head -n 3)"
# The non-active commit of TOP that qcommit live started ran under qcommitd (the short active
# commit of the fresh overlay may be ready and pivoted before qcommitd's next poll).
grep "governing .* job on domain $dom" d.log | sed 's/^/  qcommitd: /' | cut -c1-120
grep -q "governing commit job on domain $dom disk vda (target $dir/base.qcow2" d.log ||
  fail "qcommitd did not govern the commit qcommit live started"
live_done
ls ./*.qcommit-*.qcow2 >/dev/null 2>&1 && fail "the fresh overlay was left behind"
echo "libvirt.live_beside_daemon: OK"
