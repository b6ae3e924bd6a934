#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# hostile.file_safety: no command opens a file outside what the user named in a way that a symlink,
# FIFO or hard link planted in an image's directory could turn against it (common/safe_file.h).
#
#  (1) Each command runs under strace (merge governed with its probe, unthrottled with --rebase and
#      --delete, with --trace, a refused merge, plan --measure, report -o, check --repair=all, info,
#      map, doctor): every opening that may write must be an exclusive creation (O_EXCL), an
#      unnamed file (O_TMPFILE), a reopening of a descriptor, a chain image the user named, or an
#      output the user named opened with O_NOFOLLOW (strace_writes.py judges the log).
#  (2) Planted at the names the user gives for outputs: a symlink to a victim file (--trace,
#      report -o: refused, the victim untouched, and a merge refused for it writes nothing), a
#      FIFO (refused at once, never blocks), a hard link to a victim (refused).
#  (3) A merge refused before its first write (a child that is not TOP's) creates nothing beside
#      BASE: no probe, no checkpoint.
#
# usage: file-safety.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
command -v strace >/dev/null || { echo "strace not installed: skipped"; exit 77; }
. "$here/../lib/test.sh"
setup hostile.file_safety

make_chain() {  # small_chain with child.qcow2 over TOP, no checkpoint
  rm -f child.qcow2 .base.qcow2.qcommit-merge*
  small_chain
  new child.qcow2 64M -f qcow2 -b top.qcow2 -F qcow2
  qio child.qcow2 "write -P 5 1M 1M"
}

chain_args=(--allowed base.qcow2 --allowed top.qcow2 --allowed child.qcow2
            --allowed "$work/base.qcow2" --allowed "$work/top.qcow2" --allowed "$work/child.qcow2")

# traced NAME EXPECTED_RC [--allowed-output F]... -- QCOMMIT-ARGS...: runs qcommit under strace,
# requires its exit code (any: any) and a clean verdict of strace_writes.py.
traced() {
  local name=$1 want=$2 judge=() rc=0; shift 2
  while [[ $1 != -- ]]; do judge+=("$1"); shift; done
  shift
  strace -f -qq -s 4096 -e trace=open,openat,creat -o "trace-$name.log" \
    timeout 120 "$QCOMMIT" "$@" >"out-$name.txt" 2>"err-$name.txt" </dev/null || rc=$?
  [[ $want == any || $rc == "$want" ]] || soft_fail "($name) exit $rc, expected $want: $(head -c 300 "err-$name.txt")"
  python3 "$here/strace_writes.py" "trace-$name.log" "${chain_args[@]}" "${judge[@]}" >"verdict-$name.txt" ||
    soft_fail "($name) $(head -c 600 "verdict-$name.txt")"
}

# (1) Every command under strace.
make_chain
traced merge-governed 0 -- merge top.qcow2 --budget 20ms --probe on --cotenants off -c test:///default
same_view view.raw base.qcow2 || soft_fail "(1) governed merge: BASE does not show TOP's view"
make_chain
traced merge-rebase-delete 0 -- merge top.qcow2 --budget off --rebase child.qcow2 --delete
[[ ! -e top.qcow2 ]] || soft_fail "(1) --delete left TOP"
make_chain
traced merge-trace 0 --allowed-output t.csv -- merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t.csv
[[ -s t.csv ]] || soft_fail "(1) --trace wrote no trace"
traced report 0 --allowed-output r.html -- report t.csv -o r.html
[[ -s r.html ]] || soft_fail "(1) report wrote nothing"
make_chain
traced plan-measure 0 -- plan top.qcow2 --measure -c test:///default
traced check-repair 0 -- check --repair=all base.qcow2
traced info 0 -- info top.qcow2
traced map 0 -- map top.qcow2
traced doctor any -- doctor -c test:///default  # its exit code: the host's findings

# (2) Outputs the user named, with something planted at the name.
mkdir -p outside
echo "precious" >outside/victim
cp outside/victim victim.orig
make_chain
cp base.qcow2 base.orig
ln -sf "$work/outside/victim" t-link.csv
rc=0; "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t-link.csv >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || soft_fail "(2) --trace through a symlink was accepted"
grep -q 't-link.csv' err.txt || soft_fail "(2) the --trace refusal does not name the file: $(cat err.txt)"
cmp -s outside/victim victim.orig || soft_fail "(2) --trace wrote through a planted symlink"
cmp -s base.qcow2 base.orig || soft_fail "(2) a merge refused for its --trace changed BASE"
[[ ! -e .base.qcow2.qcommit-merge ]] || soft_fail "(2) a merge refused for its --trace left a checkpoint"
ln -sf "$work/outside/victim" r-link.html
rc=0; "$QCOMMIT" report t.csv -o r-link.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || soft_fail "(2) report -o through a symlink was accepted"
cmp -s outside/victim victim.orig || soft_fail "(2) report wrote through a planted symlink"
mkfifo r-fifo.html t-fifo.csv
rc=0; timeout 20 "$QCOMMIT" report t.csv -o r-fifo.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 && $rc != 124 ]] || soft_fail "(2) report -o to a FIFO: exit $rc (124: it blocked)"
rc=0; timeout 20 "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t-fifo.csv >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 && $rc != 124 ]] || soft_fail "(2) --trace to a FIFO: exit $rc (124: it blocked)"
ln outside/victim r-hard.html
rc=0; "$QCOMMIT" report t.csv -o r-hard.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || soft_fail "(2) report -o to a hard link of another file was accepted"
cmp -s outside/victim victim.orig || soft_fail "(2) report wrote through a planted hard link"

# (3) A refused merge creates nothing beside BASE.
make_chain
new stranger.qcow2 64M -f qcow2
rc=0; strace -f -qq -s 4096 -e trace=open,openat,creat -o trace-refused.log \
  "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default \
  --rebase stranger.qcow2 >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || soft_fail "(3) a child not backed by TOP was accepted"
if grep -E 'O_CREAT|O_TMPFILE' trace-refused.log | grep -q "$work"; then
  soft_fail "(3) a refused merge created a file: $(grep -E 'O_CREAT|O_TMPFILE' trace-refused.log | grep "$work" | head -2)"
fi
[[ ! -e .base.qcow2.qcommit-merge ]] || soft_fail "(3) a refused merge left a checkpoint"

finish "file safety: every opening for writing was safe"
