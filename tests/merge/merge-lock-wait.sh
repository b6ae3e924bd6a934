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
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-lockwait.XXXXXX")
cleanup() {
  pkill -f "qemu-io -r -c sleep .* $work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

make_chain() {
  rm -f base.qcow2 top.qcow2
  qemu-img create -q -f qcow2 base.qcow2 64M
  qemu-io -f qcow2 -c "write -P 1 0 8M" base.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M
  qemu-io -f qcow2 -c "write -P 7 4M 16M" top.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view.raw
  sha256sum base.qcow2 top.qcow2 >sums
}
hold() {  # hold MS: qemu-io keeps BASE's shared read lock for MS milliseconds
  qemu-io -r -c "sleep $1" "$work/base.qcow2" &
  holder=$!
  sleep 0.3
}

# (1)
make_chain
hold 2000
t0=$(date +%s.%N)
"$QCOMMIT" merge top.qcow2 --budget off >out1.txt 2>err1.txt || fail "(1) merge failed: $(cat err1.txt)"
t1=$(date +%s.%N)
grep -q 'waiting up to 10 s for pid [0-9]* (qemu-io) to release base.qcow2' err1.txt || fail "(1) no wait message: $(cat err1.txt)"
[[ $(grep -c waiting err1.txt) -eq 1 ]] || fail "(1) the wait was announced more than once"
qemu-img compare -q view.raw base.qcow2 || fail "(1) BASE does not show TOP's view"
qemu-img check -q base.qcow2 || fail "(1) BASE not clean"
awk -v a="$t0" -v b="$t1" 'BEGIN { exit !(b - a >= 1.4 && b - a < 6) }' || fail "(1) the merge did not wait for the release (took $(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}') s)"
wait

# (2)
make_chain
hold 3000
if "$QCOMMIT" merge top.qcow2 --budget off --wait 1s >out2.txt 2>err2.txt; then fail "(2) merge did not give up after 1 s"; fi
grep -q 'image is in use.*held by pid [0-9]* (qemu-io)' err2.txt || fail "(2) the error does not name the holder: $(cat err2.txt)"
sha256sum --quiet -c sums || fail "(2) an image changed although the merge gave up"
wait

# (3)
make_chain
hold 2000
if "$QCOMMIT" merge top.qcow2 --budget off --wait 0 >out3.txt 2>err3.txt; then fail "(3) --wait 0 waited"; fi
grep -q 'waiting' err3.txt && fail "(3) --wait 0 announced a wait"
grep -q 'image is in use' err3.txt || fail "(3) no in-use error: $(cat err3.txt)"
wait

# (4) The same wait as JSON events: the wait, and while it lasts (3 s) a progress event at least
# once a second, its elapsed time moving on.
make_chain
hold 3000
"$QCOMMIT" merge top.qcow2 --budget off --output=json >out4.json 2>err4.txt || fail "(4) merge failed: $(cat err4.txt)"
jq -se 'map(select(.event == "wait")) | length == 1 and (.[0].message | test("qemu-io"))' out4.json >/dev/null || fail "(4) no wait event in the JSON: $(head -c 300 out4.json)"
jq -se --arg base "$work/base.qcow2" --argjson pid "$holder" '
  map(select(.event == "wait")) | .[0] |
  .for == "lock" and .path == $base and .holders == [{"pid": $pid, "command": "qemu-io"}] and
  (.conflict | test("consistent read")) and .["timeout-s"] == 10' out4.json >/dev/null ||
  fail "(4) the wait event does not say what it waits for (lock, $work/base.qcow2, pid $holder qemu-io, 10 s): $(jq -c 'select(.event == "wait")' out4.json)"
jq -se '[.[] | select(.event == "progress" and .phase == "start") | .elapsed] | length >= 2 and . == sort and (.[0] >= 0.9)' out4.json >/dev/null ||
  fail "(4) no progress event each second while waiting: $(jq -c 'select(.event == "progress")' out4.json | head -5)"
jq -se 'map(select(.event == "result")) | length == 1' out4.json >/dev/null || fail "(4) no result"
wait

if ((${#failures[@]})); then
  printf 'merge.lock_wait: %d failure(s)\n' "${#failures[@]}"
  exit 1
fi
echo "merge.lock_wait: all checks passed"
