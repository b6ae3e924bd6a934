#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.refuse_in_use: (1) while QEMU holds TOP open read-write, qcommit merge TOP exits non-zero
# with one line naming TOP and the holder, and TOP and BASE are byte-identical afterwards;
# (2) two concurrent merges of one chain: the second is refused; (3) while a merge runs, qemu-io
# cannot write BASE (lock error); (4) that merge, killed, is finished by a re-run that resumes it.
#
# usage: merge-refuse-in-use.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.refuse_in_use

layers 1G base.qcow2="write -P 1 0 8M" top.qcow2
scatter top.qcow2 3000 16384

# (1) QEMU holds TOP.
sum_top=$(sha256sum <top.qcow2) sum_base=$(sha256sum <base.qcow2)
spawn qemu-system-x86_64 -machine none -nodefaults -display none -S \
  -drive file=top.qcow2,format=qcow2,if=none,id=d0 >qemu.log 2>&1
qpid=$!
# Until QEMU has TOP open, watched through /proc: a probe that opened TOP itself (qemu-io) would
# hold a lock of its own while QEMU started, and QEMU would then fail to get its write lock. QEMU
# takes its locks as it opens the image, before it waits (-S).
qemu_has_top() { ls -l "/proc/$qpid/fd" 2>/dev/null | grep -q '/top\.qcow2$' || gone "$qpid"; }
wait_until 10 qemu_has_top || true
sleep 0.3
kill -0 "$qpid" || soft_fail "QEMU did not start: $(cat qemu.log)"
qemu-io -r -f qcow2 -c "read 0 512" top.qcow2 >/dev/null 2>&1 &&
  soft_fail "QEMU runs but TOP is not locked (qemu-io -r could open it)"
rc=0; "$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt || rc=$?
msg=$(cat err.txt)
echo "merge while QEMU holds TOP: exit $rc: $msg"
[[ $rc != 0 ]] || soft_fail "merge succeeded while QEMU held TOP"
[[ $(wc -l <err.txt) -eq 1 ]] || soft_fail "error is not one line: $msg"
[[ $msg == *top.qcow2* ]] || soft_fail "error does not name TOP: $msg"
[[ $msg == *"$qpid"* || $msg == *qemu* ]] || soft_fail "error does not name the holder (QEMU pid $qpid): $msg"
stop "$qpid"
[[ "$(sha256sum <top.qcow2)" == "$sum_top" ]] || soft_fail "TOP changed by the refused merge"
[[ "$(sha256sum <base.qcow2)" == "$sum_base" ]] || soft_fail "BASE changed by the refused merge"
[[ ! -e .base.qcow2.qcommit-merge ]] || soft_fail "refused merge left a checkpoint"

# (2) + (3): a slow merge (small latency budget, buffered writes) runs; a second one (--wait 0:
# refused at once instead of waiting for the first to end) and qemu-io writing BASE must be
# refused while it does.
qemu-img convert -O raw top.qcow2 view.raw
spawn "$QCOMMIT" merge top.qcow2 --budget 1ms --no-direct --output=json >first.json 2>first.err
mpid=$!
wait_until 5 grep -qs '"phase": "copy"' first.json || true
if gone "$mpid"; then
  soft_fail "the first merge finished before the concurrency checks could run (make it slower)"
else
  rc=0; "$QCOMMIT" merge top.qcow2 --budget off --wait 0 >second.out 2>second.err || rc=$?
  echo "second concurrent merge: exit $rc: $(cat second.err)"
  [[ $rc != 0 ]] || soft_fail "a second concurrent merge of the same chain was not refused"
  grep -q "base.qcow2\|top.qcow2" second.err || soft_fail "second merge's error names neither image: $(cat second.err)"
  rc=0; qemu-io -f qcow2 -c "write 0 4k" base.qcow2 >qio.out 2>&1 || rc=$?
  echo "qemu-io write BASE during the merge: exit $rc: $(head -1 qio.out)"
  grep -qi "lock" qio.out || soft_fail "qemu-io could write BASE during a merge: $(cat qio.out)"
  still=0
  gone "$mpid" || still=1
  echo "first merge still running after the checks: $still"
  [[ $still == 1 ]] || soft_fail "the first merge ended during the concurrency checks (make it slower)"
fi
# The first merge, paced to a 1 ms budget, would take minutes: it is killed here, and a second
# run (no budget) must resume it from its checkpoint and finish the job.
if kill -9 "$mpid" 2>/dev/null; then
  wait "$mpid" 2>/dev/null || true
  [[ -e .base.qcow2.qcommit-merge ]] || soft_fail "the killed merge left no checkpoint to resume from"
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >resume.json 2>resume.err ||
    soft_fail "the resumed merge failed: $(cat resume.err)"
  grep -q '"resumed": true' resume.json || soft_fail "the second run did not resume the killed merge: $(tail -n 3 resume.json)"
else
  wait "$mpid" || soft_fail "the first merge failed: $(cat first.err)"
fi
qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || soft_fail "BASE differs from TOP's view after the first merge"
qemu-img check -q base.qcow2 || soft_fail "BASE not clean"
finish "merge.refuse_in_use: OK"
