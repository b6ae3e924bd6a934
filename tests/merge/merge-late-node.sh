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
[[ $EUID -eq 0 && -c /dev/loop-control ]] && command -v losetup python3 >/dev/null ||
  { echo "merge.late_node: needs root, /dev/loop-control, losetup and python3; skipped"; exit 77; }
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.late_node
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
  wait_until 1 test ! -e "$dev" || true
}
on_exit 'jobs -p | xargs -r kill 2>/dev/null; remove_loop'  # no attach after the removal

# base.raw (8 MiB) and top.qcow2 over it with writes of its own; TOP's view saved, then TOP's
# backing file renamed to $dev (not attached yet).
make_chain() {
  rm -f base.raw top.qcow2 view.raw
  new base.raw 8M -f raw
  qio -f raw base.raw "write -P 3 0 6M"
  new top.qcow2 8M -f qcow2 -b "$work/base.raw" -F raw
  qio top.qcow2 "write -P 7 2M 3M" "write -z 6M 64k"
  qemu-img convert -O raw top.qcow2 view.raw
  qemu-img rebase -u -b "$dev" -F raw top.qcow2
}
# attach_after SECONDS: losetup attaches base.raw at $dev that much later (spawn it).
attach_after() { sleep "$1" && losetup "$dev" "$work/base.raw"; }

# (1)
make_chain
spawn attach_after 1
timed "$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off >out1.txt 2>err1.txt
((rc == 0)) || soft_fail "(1) merge failed: $(cat err1.txt)"
wait
grep -q "waiting up to 10 s for $dev to appear" err1.txt || soft_fail "(1) no wait message: $(cat err1.txt)"
[[ $(grep -c waiting err1.txt) -eq 1 ]] || soft_fail "(1) the wait was announced $(grep -c waiting err1.txt) times, not once"
awk -v t="$took" 'BEGIN { exit !(t >= 0.9 && t < 8) }' || soft_fail "(1) took $took s (the device appeared after 1 s)"
[[ -b $dev ]] && qemu-img compare -q -f raw -F raw view.raw "$dev" || soft_fail "(1) BASE ($dev) does not show TOP's view"
remove_loop

# (2)
make_chain
spawn attach_after 1
"$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off --output=json >out2.json 2>err2.txt ||
  soft_fail "(2) merge failed: $(cat err2.txt)"
wait
jq -se --arg dev "$dev" 'map(select(.event == "wait")) | length == 1 and (.[0].message | contains($dev))' out2.json >/dev/null ||
  soft_fail "(2) no wait event in the JSON: $(head -c 300 out2.json)"
jq -se --arg dev "$dev" 'map(select(.event == "wait")) | .[0] |
  .for == "device-node" and .path == $dev and .["timeout-s"] > 9 and .["timeout-s"] <= 10' out2.json >/dev/null ||
  soft_fail "(2) the wait event does not say what it waits for (device-node, $dev, about 10 s): $(jq -c 'select(.event == "wait")' out2.json)"
jq -se 'map(select(.event == "result")) | length == 1' out2.json >/dev/null || soft_fail "(2) no result"
[[ -b $dev ]] && qemu-img compare -q -f raw -F raw view.raw "$dev" || soft_fail "(2) BASE ($dev) does not show TOP's view"
remove_loop

# (3)
make_chain
sha256sum top.qcow2 base.raw >sums
timed "$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off --wait 1s >out3.txt 2>err3.txt
[[ $rc -eq 1 ]] || soft_fail "(3) exit $rc, not 1"
[[ $(grep -vc '^qcommit: waiting' err3.txt) -eq 1 ]] && grep -v '^qcommit: waiting' err3.txt | grep -q "$dev" ||
  soft_fail "(3) not one line naming $dev: $(cat err3.txt)"
awk -v t="$took" 'BEGIN { exit !(t >= 0.9 && t < 6) }' || soft_fail "(3) gave up after $took s, not 1 s"
sha256sum --quiet -c sums || soft_fail "(3) an image changed although the merge gave up"

# (4)
qemu-img rebase -u -b "$work/gone.raw" -F raw top.qcow2
timed "$QCOMMIT" merge top.qcow2 --budget off >out4.txt 2>err4.txt
[[ $rc -eq 1 ]] || soft_fail "(4) exit $rc, not 1"
! grep -q waiting err4.txt || soft_fail "(4) a missing regular file was waited for"
grep -q gone.raw err4.txt || soft_fail "(4) the error does not name the file: $(cat err4.txt)"
awk -v t="$took" 'BEGIN { exit !(t < 2) }' || soft_fail "(4) took $took s"

finish "merge.late_node: all checks passed"
