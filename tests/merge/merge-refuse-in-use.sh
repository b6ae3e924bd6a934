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
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-inuse.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

qemu-img create -q -f qcow2 base.qcow2 1G
qemu-io -f qcow2 -c "write -P 1 0 8M" base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 1G
args=()
for ((i = 0; i < 3000; i++)); do args+=(-c "write -P $((i % 251)) $(((i * 2654435761 % 16384) * 65536)) 64k"); done
qemu-io -f qcow2 "${args[@]}" top.qcow2 >/dev/null

# (1) QEMU holds TOP.
sum_top=$(sha256sum <top.qcow2) sum_base=$(sha256sum <base.qcow2)
qemu-system-x86_64 -machine none -nodefaults -display none -S \
  -drive file=top.qcow2,format=qcow2,if=none,id=d0 >qemu.log 2>&1 &
qpid=$!
pids+=("$qpid")
# Until QEMU has TOP open, watched through /proc: a probe that opened TOP itself (as this test
# once did with qemu-io) held a lock of its own while QEMU started, and QEMU then failed to get
# its write lock. QEMU takes its locks as it opens the image, before it waits (-S).
for ((i = 0; i < 200; i++)); do
  ls -l "/proc/$qpid/fd" 2>/dev/null | grep -q '/top\.qcow2$' && break
  kill -0 "$qpid" 2>/dev/null || break
  sleep 0.05
done
sleep 0.3
kill -0 "$qpid" || fail "QEMU did not start: $(cat qemu.log)"
qemu-io -r -f qcow2 -c "read 0 512" top.qcow2 >/dev/null 2>&1 &&
  fail "QEMU runs but TOP is not locked (qemu-io -r could open it)"
rc=0
"$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt || rc=$?
msg=$(cat err.txt)
echo "merge while QEMU holds TOP: exit $rc: $msg"
[[ $rc != 0 ]] || fail "merge succeeded while QEMU held TOP"
[[ $(wc -l <err.txt) -eq 1 ]] || fail "error is not one line: $msg"
[[ $msg == *top.qcow2* ]] || fail "error does not name TOP: $msg"
[[ $msg == *"$qpid"* || $msg == *qemu* ]] || fail "error does not name the holder (QEMU pid $qpid): $msg"
kill "$qpid"
wait "$qpid" 2>/dev/null || true
[[ "$(sha256sum <top.qcow2)" == "$sum_top" ]] || fail "TOP changed by the refused merge"
[[ "$(sha256sum <base.qcow2)" == "$sum_base" ]] || fail "BASE changed by the refused merge"
[[ -e .base.qcow2.qcommit-merge ]] && fail "refused merge left a checkpoint"

# (2) + (3): a slow merge (small latency budget, buffered writes) runs; a second one (--wait 0:
# refused at once instead of waiting for the first to end) and qemu-io
# writing BASE must be refused while it does.
qemu-img convert -O raw top.qcow2 view.raw
"$QCOMMIT" merge top.qcow2 --budget 1ms --no-direct --output=json >first.json 2>first.err &
mpid=$!
pids+=("$mpid")
for ((i = 0; i < 500; i++)); do
  grep -q '"phase": "copy"' first.json 2>/dev/null && break
  sleep 0.01
done
if ! kill -0 "$mpid" 2>/dev/null; then
  fail "the first merge finished before the concurrency checks could run (make it slower)"
else
  rc=0
  "$QCOMMIT" merge top.qcow2 --budget off --wait 0 >second.out 2>second.err || rc=$?
  echo "second concurrent merge: exit $rc: $(cat second.err)"
  [[ $rc != 0 ]] || fail "a second concurrent merge of the same chain was not refused"
  grep -q "base.qcow2\|top.qcow2" second.err || fail "second merge's error names neither image: $(cat second.err)"
  rc=0
  qemu-io -f qcow2 -c "write 0 4k" base.qcow2 >qio.out 2>&1 || rc=$?
  echo "qemu-io write BASE during the merge: exit $rc: $(head -1 qio.out)"
  grep -qi "lock" qio.out || fail "qemu-io could write BASE during a merge: $(cat qio.out)"
  still=0
  kill -0 "$mpid" 2>/dev/null && still=1
  echo "first merge still running after the checks: $still"
  [[ $still == 1 ]] || fail "the first merge ended during the concurrency checks (make it slower)"
fi
# The first merge, paced to a 1 ms budget, would take minutes: it is killed here, and a second
# run (no budget) must resume it from its checkpoint and finish the job.
if kill -9 "$mpid" 2>/dev/null; then
  wait "$mpid" 2>/dev/null || true
  [[ -e .base.qcow2.qcommit-merge ]] || fail "the killed merge left no checkpoint to resume from"
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >resume.json 2>resume.err ||
    fail "the resumed merge failed: $(cat resume.err)"
  grep -q '"resumed": true' resume.json || fail "the second run did not resume the killed merge: $(tail -n 3 resume.json)"
else
  wait "$mpid" || fail "the first merge failed: $(cat first.err)"
fi
qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || fail "BASE differs from TOP's view after the first merge"
qemu-img check -q base.qcow2 || fail "BASE not clean"
if ((${#failures[@]})); then printf '  %s\n' "${failures[@]}" >&2; exit 1; fi
echo "merge.refuse_in_use: OK"
