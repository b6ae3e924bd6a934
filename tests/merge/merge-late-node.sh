#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.late_node: a backing file under /dev/ whose node appears late (udev still creating it after
# an LV activation; here a loop device attached after the merge started) is waited for within
# --wait, not fatal.
#  (1) TOP's backing file is /dev/loopN, a raw BASE not attached yet; attached 1 s after the merge
#      started: the merge says once what it waits for, then merges (BASE shows TOP's view);
#  (2) the same wait as a JSON event with --output=json: "for": "device-node", "path": /dev/loopN
#      and the timeout;
#  (3) --wait 1s and no device: exit 1 after about 1 s, one line naming /dev/loopN;
#  (4) a missing regular file is no race: refused at once, no wait announced.
# The upper time bounds leave room for a loaded machine; each stays below the default --wait
# (10 s), so a wait that ran to its deadline instead of ending with the device still fails.
#
# usage: merge-late-node.sh QCOMMIT   (root, losetup, python3; exit 77 to skip otherwise)
set -euo pipefail
QCOMMIT=$(realpath "$1")
if [[ $EUID -ne 0 || ! -c /dev/loop-control ]] || ! command -v losetup python3 >/dev/null; then
  echo "merge.late_node: needs root, /dev/loop-control, losetup and python3; skipped"
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-latenode.XXXXXX")
export QCOMMIT_STATE_DIR=$work/state
mkdir -p "$QCOMMIT_STATE_DIR"

# A loop device number whose node and device do not exist: losetup creates both when it attaches.
n=64
while [[ -e /dev/loop$n || -e /sys/block/loop$n ]]; do n=$((n + 1)); done
dev=/dev/loop$n

# Detaches the device and removes it (LOOP_CTL_REMOVE), so that its node is gone again.
remove_loop() {
  [[ -e /sys/block/loop$n ]] || return 0
  losetup -d "$dev" 2>/dev/null || true
  python3 -c "import fcntl, os; fcntl.ioctl(os.open('/dev/loop-control', os.O_RDWR), 0x4C81, $n)" 2>/dev/null || true
  for _ in $(seq 50); do [[ -e $dev ]] || break; sleep 0.02; done
}
cleanup() {
  jobs -p | xargs -r kill 2>/dev/null || true
  remove_loop
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }

# base.raw (8 MiB) and top.qcow2 over it with writes of its own; TOP's view saved, then TOP's
# backing file renamed to $dev (not attached yet).
make_chain() {
  rm -f base.raw top.qcow2 view.raw
  qemu-img create -q -f raw base.raw 8M
  qemu-io -f raw -c "write -P 3 0 6M" base.raw >/dev/null
  qemu-img create -q -f qcow2 -b "$work/base.raw" -F raw top.qcow2 8M
  qemu-io -f qcow2 -c "write -P 7 2M 3M" -c "write -z 6M 64k" top.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view.raw
  qemu-img rebase -u -b "$dev" -F raw top.qcow2
}
# attach_after SECONDS: losetup attaches base.raw at $dev that much later, in the background.
attach_after() {
  (sleep "$1" && losetup "$dev" "$work/base.raw") &
}

# (1)
make_chain
attach_after 1
t0=$(date +%s.%N)
"$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off >out1.txt 2>err1.txt ||
  fail "(1) merge failed: $(cat err1.txt)"
took=$(elapsed "$t0")
wait
grep -q "waiting up to 10 s for $dev to appear" err1.txt || fail "(1) no wait message: $(cat err1.txt)"
[[ $(grep -c waiting err1.txt) -eq 1 ]] || fail "(1) the wait was announced $(grep -c waiting err1.txt) times, not once"
awk -v t="$took" 'BEGIN { exit !(t >= 0.9 && t < 8) }' || fail "(1) took $took s (the device appeared after 1 s)"
[[ -b $dev ]] && qemu-img compare -q -f raw -F raw view.raw "$dev" || fail "(1) BASE ($dev) does not show TOP's view"
remove_loop

# (2)
make_chain
attach_after 1
"$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off --output=json >out2.json 2>err2.txt ||
  fail "(2) merge failed: $(cat err2.txt)"
wait
jq -se --arg dev "$dev" 'map(select(.event == "wait")) | length == 1 and (.[0].message | contains($dev))' out2.json >/dev/null ||
  fail "(2) no wait event in the JSON: $(head -c 300 out2.json)"
jq -se --arg dev "$dev" 'map(select(.event == "wait")) | .[0] |
  .for == "device-node" and .path == $dev and .["timeout-s"] > 9 and .["timeout-s"] <= 10' out2.json >/dev/null ||
  fail "(2) the wait event does not say what it waits for (device-node, $dev, about 10 s): $(jq -c 'select(.event == "wait")' out2.json)"
jq -se 'map(select(.event == "result")) | length == 1' out2.json >/dev/null || fail "(2) no result"
[[ -b $dev ]] && qemu-img compare -q -f raw -F raw view.raw "$dev" || fail "(2) BASE ($dev) does not show TOP's view"
remove_loop

# (3)
make_chain
sha256sum top.qcow2 base.raw >sums
t0=$(date +%s.%N)
rc=0
"$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off --wait 1s >out3.txt 2>err3.txt || rc=$?
took=$(elapsed "$t0")
[[ $rc -eq 1 ]] || fail "(3) exit $rc, not 1"
[[ $(grep -vc '^qcommit: waiting' err3.txt) -eq 1 ]] && grep -v '^qcommit: waiting' err3.txt | grep -q "$dev" ||
  fail "(3) not one line naming $dev: $(cat err3.txt)"
awk -v t="$took" 'BEGIN { exit !(t >= 0.9 && t < 6) }' || fail "(3) gave up after $took s, not 1 s"
sha256sum --quiet -c sums || fail "(3) an image changed although the merge gave up"

# (4)
qemu-img rebase -u -b "$work/gone.raw" -F raw top.qcow2
t0=$(date +%s.%N)
rc=0
"$QCOMMIT" merge top.qcow2 --budget off >out4.txt 2>err4.txt || rc=$?
took=$(elapsed "$t0")
[[ $rc -eq 1 ]] || fail "(4) exit $rc, not 1"
grep -q waiting err4.txt && fail "(4) a missing regular file was waited for"
grep -q gone.raw err4.txt || fail "(4) the error does not name the file: $(cat err4.txt)"
awk -v t="$took" 'BEGIN { exit !(t < 2) }' || fail "(4) took $took s"

if ((${#failures[@]})); then
  printf 'merge.late_node: %d failure(s)\n' "${#failures[@]}"
  exit 1
fi
echo "merge.late_node: all checks passed"
