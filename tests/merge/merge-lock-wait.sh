#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.lock_wait: another process holding an image for a moment is waited out, not fatal.
#  (1) qemu-io holds BASE's shared read lock for 2 s: `qcommit merge` says once whom it waits for,
#      then merges (BASE shows TOP's view, qemu-img check clean) soon after the release;
#  (2) with --wait 1s and a 3 s holder: exit 1, one line naming the holder, nothing written;
#  (3) --wait 0: refused at once, as before;
#  (4) the same wait as a JSON event with --output=json: "for": "lock", the image's path, the
#      holder's pid and command, the conflict and the timeout; and progress events at least once
#      a second while it lasts.
#
# usage: merge-lock-wait.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.lock_wait

# chain_held MS: once the last holder is gone, a fresh chain, then qemu-io keeps BASE's shared
# read lock for MS milliseconds (its pid in $holder).
chain_held() {
  wait
  small_chain
  sha256sum base.qcow2 top.qcow2 >sums
  spawn qemu-io -r -c "sleep $1" "$work/base.qcow2"
  holder=$!
  sleep 0.3
}

# (1)
chain_held 2000
timed "$QCOMMIT" merge top.qcow2 --budget off >out1.txt 2>err1.txt
((rc == 0)) || soft_fail "(1) merge failed: $(cat err1.txt)"
grep -q 'waiting up to 10 s for pid [0-9]* (qemu-io) to release base.qcow2' err1.txt || soft_fail "(1) no wait message: $(cat err1.txt)"
[[ $(grep -c waiting err1.txt) -eq 1 ]] || soft_fail "(1) the wait was announced more than once"
same_view view.raw base.qcow2 || soft_fail "(1) BASE does not show TOP's view"
qemu-img check -q base.qcow2 || soft_fail "(1) BASE not clean"
awk -v t="$took" 'BEGIN { exit !(t >= 1.4 && t < 6) }' || soft_fail "(1) the merge did not wait for the release (took $took s)"

# (2)
chain_held 3000
! "$QCOMMIT" merge top.qcow2 --budget off --wait 1s >out2.txt 2>err2.txt || soft_fail "(2) merge did not give up after 1 s"
grep -q 'image is in use.*held by pid [0-9]* (qemu-io)' err2.txt || soft_fail "(2) the error does not name the holder: $(cat err2.txt)"
sha256sum --quiet -c sums || soft_fail "(2) an image changed although the merge gave up"

# (3)
chain_held 2000
! "$QCOMMIT" merge top.qcow2 --budget off --wait 0 >out3.txt 2>err3.txt || soft_fail "(3) --wait 0 waited"
! grep -q 'waiting' err3.txt || soft_fail "(3) --wait 0 announced a wait"
grep -q 'image is in use' err3.txt || soft_fail "(3) no in-use error: $(cat err3.txt)"

# (4) The same wait as JSON events: the wait, and while it lasts (3 s) a progress event at least
# once a second, its elapsed time moving on.
chain_held 3000
"$QCOMMIT" merge top.qcow2 --budget off --output=json >out4.json 2>err4.txt || soft_fail "(4) merge failed: $(cat err4.txt)"
jq -se 'map(select(.event == "wait")) | length == 1 and (.[0].message | test("qemu-io"))' out4.json >/dev/null || soft_fail "(4) no wait event in the JSON: $(head -c 300 out4.json)"
jq -se --arg base "$work/base.qcow2" --argjson pid "$holder" '
  map(select(.event == "wait")) | .[0] |
  .for == "lock" and .path == $base and .holders == [{"pid": $pid, "command": "qemu-io"}] and
  (.conflict | test("consistent read")) and .["timeout-s"] == 10' out4.json >/dev/null ||
  soft_fail "(4) the wait event does not say what it waits for (lock, $work/base.qcow2, pid $holder qemu-io, 10 s): $(jq -c 'select(.event == "wait")' out4.json)"
jq -se '[.[] | select(.event == "progress" and .phase == "start") | .elapsed] | length >= 2 and . == sort and (.[0] >= 0.9)' out4.json >/dev/null ||
  soft_fail "(4) no progress event each second while waiting: $(jq -c 'select(.event == "progress")' out4.json | head -5)"
jq -se 'map(select(.event == "result")) | length == 1' out4.json >/dev/null || soft_fail "(4) no result"
finish "merge.lock_wait: all checks passed"
