#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.live_libvirtd_restart: `qcommit live` (no qcommitd: a socket nobody serves) waits out a
# libvirtd restart and says so, with --max-rate in force. A running TCG domain on base <- top
# (40 MiB of data in top), its metadata policy ceiling 1G, a direct active commit with --pivot at
# --max-rate 4M:
#   * every progress event's speed, and QEMU's speed while the job runs, is at most 4 MiB/s (on
#     this host the governor keeps this job near its floor whatever the cap, so this part is weak;
#     plugin.governor.max_rate_caps_every_speed shows the cap where the governor runs free);
#   * the disk ends on base.qcow2 with the guest's view.
# Meanwhile this host's libvirtd (libvirtd -d; never a chroot's) is stopped for 2 s and started
# again: live says once that it waits for the connection (a "wait" event for "connection"), and
# carries on to the pivot.  libvirtd is left running whatever happens.
# And --max-rate below 64K is refused (exit 2, one line).
# usage: live-libvirtd-restart.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
restart_test_init libvirt.live_libvirtd_restart qllr
cap=$((4 * 1024 * 1024))
layers 256M base.qcow2='write -P 1 0 16M' top.qcow2='write -P 2 8M 40M'
qemu-img convert -O raw top.qcow2 view-before.raw
define_disk_domain "$dom" "$dir/top.qcow2"
virsh -q metadata "$dom" https://qcommit.dev/xmlns/1 --key qcommit --config \
  --set '<policy ceiling="1G"/>' >/dev/null
virsh -q start "$dom" >/dev/null

fails_with 2 "" "$QCOMMIT" live "$dom" vda --max-rate 16K --daemon-socket "$dir/none.sock"

t0=$(date +%s.%N)
"$QCOMMIT" live "$dom" vda --strategy direct --pivot --max-rate 4M --daemon-socket "$dir/none.sock" \
  --output=json >events 2>err &
lpid=$!
wait_until 10 grep -qs '"progress"' events || fail "no progress from qcommit live: $(cat err)"
stop_libvirtd || fail "libvirtd did not stop"
sleep 2
ensure_libvirtd || fail "libvirtd did not come back"
echo "libvirtd restarted during the merge"
qemu_max=0
while ! gone "$lpid"; do
  bw=$(job_bandwidth)
  [[ -n $bw ]] && ((bw > qemu_max)) && qemu_max=$bw
  sleep 0.2
done
wait "$lpid" || fail "qcommit live failed (exit $?): $(cat err) $(tail -n 3 events)"
took=$(echo "$(date +%s.%N) - $t0" | bc)
top_speed=$(jq -s 'map(select(.event == "progress") | .speed_bytes_per_s // 0) | max // 0' events)
echo "40 MiB at --max-rate 4M: ${took} s; largest progress speed $top_speed, largest QEMU speed $qemu_max bytes/s"
n=$(jq -s 'map(select(.event == "wait" and .for == "connection")) | length' events)
[[ $n == 1 ]] || fail "$n wait events for the connection, expected 1: $(grep wait events | head -3)"
jq -se 'map(select(.event == "wait"))[0] | .uri == "qemu:///system" and has("timeout-s") == false' events >/dev/null ||
  fail "the connection's wait event does not name the URI (qemu:///system, no timeout): $(grep wait events | head -3)"
jq -se 'map(select(.event == "progress")) | length >= 2' events >/dev/null || fail "fewer than 2 progress events: $(head -c 400 events)"
[[ $(echo "$top_speed <= $cap" | bc) == 1 ]] || fail "a progress event shows speed $top_speed > $cap"
((qemu_max <= cap)) || fail "QEMU ran the job at $qemu_max bytes/s > $cap"
[[ $(vda_source "$dom") == */base.qcow2 ]] || fail "vda is on '$(vda_source "$dom")', not base.qcow2, after the pivot"
virsh -q destroy "$dom" >/dev/null
view_kept view-before.raw base.qcow2
echo "libvirt.live_libvirtd_restart: OK"
