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
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-fsafe.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

make_chain() {
  rm -f base.qcow2 top.qcow2 child.qcow2 .base.qcow2.qcommit-merge*
  qemu-img create -q -f qcow2 base.qcow2 64M
  qemu-io -f qcow2 -c "write -P 1 0 8M" base.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M
  qemu-io -f qcow2 -c "write -P 7 4M 16M" -c "write -P 9 40M 1M" top.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2 64M
  qemu-io -f qcow2 -c "write -P 5 1M 1M" child.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view.raw
}

chain_args=(--allowed base.qcow2 --allowed top.qcow2 --allowed child.qcow2
            --allowed "$work/base.qcow2" --allowed "$work/top.qcow2" --allowed "$work/child.qcow2")

# traced NAME EXPECTED_RC [--allowed-output F]... -- QCOMMIT-ARGS...: runs qcommit under strace,
# requires its exit code and a clean verdict of strace_writes.py.
traced() {
  local name=$1 want=$2; shift 2
  local judge=()
  while [[ $1 != -- ]]; do judge+=("$1"); shift; done
  shift
  local rc=0
  strace -f -qq -s 4096 -e trace=open,openat,creat -o "trace-$name.log" \
    timeout 120 "$QCOMMIT" "$@" >"out-$name.txt" 2>"err-$name.txt" </dev/null || rc=$?
  [[ $rc == "$want" ]] || fail "($name) exit $rc, expected $want: $(head -c 300 "err-$name.txt")"
  local verdict=0
  python3 "$here/strace_writes.py" "trace-$name.log" "${chain_args[@]}" "${judge[@]}" \
    >"verdict-$name.txt" || verdict=$?
  [[ $verdict == 0 ]] || fail "($name) $(head -c 600 "verdict-$name.txt")"
}

# (1) Every command under strace.
make_chain
traced merge-governed 0 -- merge top.qcow2 --budget 20ms --probe on --cotenants off -c test:///default
qemu-img compare -q view.raw base.qcow2 || fail "(1) governed merge: BASE does not show TOP's view"
make_chain
traced merge-rebase-delete 0 -- merge top.qcow2 --budget off --rebase child.qcow2 --delete
[[ ! -e top.qcow2 ]] || fail "(1) --delete left TOP"
make_chain
traced merge-trace 0 --allowed-output t.csv -- merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t.csv
[[ -s t.csv ]] || fail "(1) --trace wrote no trace"
traced report 0 --allowed-output r.html -- report t.csv -o r.html
[[ -s r.html ]] || fail "(1) report wrote nothing"
make_chain
traced plan-measure 0 -- plan top.qcow2 --measure -c test:///default
traced check-repair 0 -- check --repair=all base.qcow2
traced info 0 -- info top.qcow2
traced map 0 -- map top.qcow2
# doctor's exit code depends on the host's findings; only its openings are judged.
rc_doctor=0
strace -f -qq -s 4096 -e trace=open,openat,creat -o trace-doctor.log \
  timeout 60 "$QCOMMIT" doctor -c test:///default >/dev/null 2>&1 </dev/null || rc_doctor=$?
python3 "$here/strace_writes.py" trace-doctor.log "${chain_args[@]}" >verdict-doctor.txt ||
  fail "(1 doctor) $(head -c 600 verdict-doctor.txt)"

# (2) Outputs the user named, with something planted at the name.
mkdir -p outside
echo "precious" >outside/victim
cp outside/victim victim.orig
make_chain
cp base.qcow2 base.orig
ln -sf "$work/outside/victim" t-link.csv
rc=0; "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t-link.csv >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || fail "(2) --trace through a symlink was accepted"
grep -q 't-link.csv' err.txt || fail "(2) the --trace refusal does not name the file: $(cat err.txt)"
cmp -s outside/victim victim.orig || fail "(2) --trace wrote through a planted symlink"
cmp -s base.qcow2 base.orig || fail "(2) a merge refused for its --trace changed BASE"
[[ ! -e .base.qcow2.qcommit-merge ]] || fail "(2) a merge refused for its --trace left a checkpoint"
ln -sf "$work/outside/victim" r-link.html
rc=0; "$QCOMMIT" report t.csv -o r-link.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || fail "(2) report -o through a symlink was accepted"
cmp -s outside/victim victim.orig || fail "(2) report wrote through a planted symlink"
mkfifo r-fifo.html t-fifo.csv
rc=0; timeout 20 "$QCOMMIT" report t.csv -o r-fifo.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 && $rc != 124 ]] || fail "(2) report -o to a FIFO: exit $rc (124: it blocked)"
rc=0; timeout 20 "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default --trace t-fifo.csv >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 && $rc != 124 ]] || fail "(2) --trace to a FIFO: exit $rc (124: it blocked)"
ln outside/victim r-hard.html
rc=0; "$QCOMMIT" report t.csv -o r-hard.html >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || fail "(2) report -o to a hard link of another file was accepted"
cmp -s outside/victim victim.orig || fail "(2) report wrote through a planted hard link"

# (3) A refused merge creates nothing beside BASE.
make_chain
qemu-img create -q -f qcow2 stranger.qcow2 64M
rc=0
strace -f -qq -s 4096 -e trace=open,openat,creat -o trace-refused.log \
  "$QCOMMIT" merge top.qcow2 --budget 20ms --cotenants off -c test:///default \
  --rebase stranger.qcow2 >/dev/null 2>err.txt || rc=$?
[[ $rc != 0 ]] || fail "(3) a child not backed by TOP was accepted"
if grep -E 'O_CREAT|O_TMPFILE' trace-refused.log | grep -q "$work"; then
  fail "(3) a refused merge created a file: $(grep -E 'O_CREAT|O_TMPFILE' trace-refused.log | grep "$work" | head -2)"
fi
[[ ! -e .base.qcow2.qcommit-merge ]] || fail "(3) a refused merge left a checkpoint"

if ((${#failures[@]})); then
  echo "${#failures[@]} failure(s)"
  exit 1
fi
echo "file safety: every opening for writing was safe"
