#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.daemon_first_speed: a plain `virsh blockcommit --active` (no --bandwidth: QEMU starts the
# job unlimited) under qcommitd.  `qcommit status --output=json` must show the job's time to
# govern (from QEMU's JOB_STATUS_CHANGE event, or the poll) within kMaxTimeToGovernMs, a speed
# QEMU has (libvirt's bandwidth of the job equals the status's speed), and the monitor event
# registration must not have tainted the domain (its QEMU log names no taint).  The status's
# steps of that time: the speed call taken within it, and for a job an event announced, its scan
# begun and the job listed before the speed call (each null for a job the poll found but the
# speed call).
# usage: daemon-first-speed.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
lv_setup libvirt.daemon_first_speed qfs
# Discovery is bounded by the 0.5 s poll; the rest is a few libvirt calls (generous for a busy
# 2-core CI machine).
kMaxTimeToGovernMs=1500
# A ceiling that keeps the 256 MiB copy running for seconds once governed.
start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=16M\n'
start_domain 1G base.qcow2 top.qcow2='write -P 5 0 256M'
virsh -q blockcommit "$dom" vda --active >/dev/null
governed() {  # $status: the figures of the job on vda once it has a time to govern
  status=$(qstatus --output=json | python3 -c 'import json,sys
j=[x for x in json.load(sys.stdin)["jobs"] if x["disk"]=="vda"]
if j and j[0].get("time_to_govern_ms") is not None:
    x=j[0]; f=lambda k: "-" if x[k] is None else "%.3f" % x[k]
    print(x["found_by"], "%.1f" % x["time_to_govern_ms"], x["speed_bytes_per_s"], x["copied_before_governed_bytes"],
          f("scan_began_after_ms"), f("job_listed_after_ms"), f("speed_taken_after_ms"))')
  [[ -n $status ]]
}
wait_until 30 governed || fail "no time to govern in qcommit status after 30 s"
read -r found_by ttg speed copied scan listed taken <<<"$status"
echo "governed ${ttg} ms after it was found by $found_by, speed $speed B/s, $copied bytes copied by then; steps: scan began $scan, job listed $listed, speed taken $taken ms"
[[ $found_by == event || $found_by == poll ]] || fail "found_by '$found_by'"
[[ $taken != - ]] && awk -v s="$taken" -v t="$ttg" 'BEGIN {exit !(s >= 0 && s <= t + 0.1)}' ||
  fail "speed taken after $taken ms, outside the time to govern ($ttg ms)"
if [[ $found_by == event ]]; then
  [[ $scan != - && $listed != - ]] &&
    awk -v a="$scan" -v b="$listed" -v c="$taken" 'BEGIN {exit !(a >= 0 && a <= b && b <= c)}' ||
    fail "event steps out of order or before QEMU's event (its timestamp put on the daemon's clock): scan began $scan, job listed $listed, speed taken $taken ms"
else
  [[ $scan == - && $listed == - ]] || fail "a job the poll found has steps before its listing: $scan, $listed"
fi
awk -v t="$ttg" -v m="$kMaxTimeToGovernMs" 'BEGIN {exit !(t <= m)}' || fail "time to govern $ttg ms > $kMaxTimeToGovernMs ms"
((speed > 0)) || fail "the status claims speed $speed"
bw=$(virsh -q blockjob "$dom" vda --raw --bytes | awk -F= '$1 ~ /bandwidth/ {print $2}')
((bw > 0)) || fail "libvirt reports bandwidth '$bw' for the governed job"
grep -q "after the job was found ($found_by)" d.log || fail "no time-to-govern line in the daemon log"
grep -i taint "/var/log/libvirt/qemu/$dom.log" >taint.txt 2>/dev/null && fail "the domain was tainted: $(cat taint.txt)"
virsh -q blockjob "$dom" vda --abort >/dev/null
virsh -q destroy "$dom" >/dev/null
view_kept view-before.raw top.qcow2
echo "libvirt.daemon_first_speed: OK"
