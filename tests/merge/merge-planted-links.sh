#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.planted_links: the files a merge creates cannot be turned against the user running it.
#  (1) symlinks planted at the checkpoint's name and at its temporary file's name (anyone who can
#      write in BASE's directory can plant them) point at files outside: the merge succeeds and
#      neither target changes (a root merge must never overwrite what a link points to);
#  (2) a FIFO planted at the checkpoint's name: the merge neither blocks nor fails;
#  (3) a block-device BASE (a loop device under a raw BASE, needs root): its checkpoint is kept in
#      the state directory (QCOMMIT_STATE_DIR), never under /dev (a tmpfs a reboot empties), seen
#      with strace;
#  (4) a child that cannot be rebased is refused before anything is written;
#  (5) --delete never deletes a layer another process has open (waited for within --wait, then
#      refused).
#
# usage: merge-planted-links.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.planted_links
loop=
on_exit '[[ -z $loop ]] || losetup -d "$loop" 2>/dev/null'

# (1) Links at both names.
small_chain
mkdir -p outside
echo "precious" >outside/victim-tmp
echo "precious too" >outside/victim-cp
cp outside/victim-tmp outside/victim-cp .
ln -s "$work/outside/victim-tmp" .base.qcow2.qcommit-merge.tmp
ln -s "$work/outside/victim-cp" .base.qcow2.qcommit-merge
"$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt || soft_fail "(1) merge with planted links failed: $(cat err.txt)"
cmp -s outside/victim-tmp victim-tmp || soft_fail "(1) the temporary file's link target was overwritten"
cmp -s outside/victim-cp victim-cp || soft_fail "(1) the checkpoint's link target was overwritten"
same_view view.raw base.qcow2 || soft_fail "(1) BASE does not show TOP's view"
[[ ! -e .base.qcow2.qcommit-merge && ! -L .base.qcow2.qcommit-merge ]] || soft_fail "(1) checkpoint left behind"

# (2) A FIFO at the checkpoint's name.
small_chain
mkfifo .base.qcow2.qcommit-merge
timeout 60 "$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt ||
  soft_fail "(2) merge with a FIFO at the checkpoint's name failed or blocked: $(cat err.txt)"
same_view view.raw base.qcow2 || soft_fail "(2) BASE does not show TOP's view"

# (3) A block-device BASE.
if [[ $(id -u) -eq 0 ]] && command -v strace >/dev/null && command -v losetup >/dev/null; then
  truncate -s 256M disk.img
  if loop=$(losetup --find --show disk.img 2>/dev/null); then
    qio -f raw "$loop" "write -P 3 0 32M"
    new top.qcow2 256M -f qcow2 -b "$loop" -F raw
    scatter top.qcow2 1500 4096
    qemu-img convert -O raw top.qcow2 view.raw
    export QCOMMIT_STATE_DIR=$work/state
    strace -f -qq -e trace=openat,rename,unlink -o strace.log "$QCOMMIT" merge top.qcow2 --allow-backing-dir /dev --budget off --output=json >run.json 2>run.err ||
      soft_fail "(3) the merge failed: $(cat run.err)"
    grep 'qcommit-merge' strace.log | grep -q '"/dev/' && soft_fail "(3) the merge wrote a checkpoint under /dev"
    grep 'qcommit-merge' strace.log | grep "$QCOMMIT_STATE_DIR" | grep -q O_CREAT ||
      soft_fail "(3) the merge did not keep its checkpoint in the state directory"
    same_view view.raw "$loop" || soft_fail "(3) the loop device does not show TOP's view"
    unset QCOMMIT_STATE_DIR
  else
    echo "skip (3): no loop device"
  fi
else
  echo "skip (3): needs root, strace and losetup"
fi

# (4) A child that cannot be rebased (BASE's name does not fit in its 512-byte header cluster) is
#     refused before anything is written: BASE, TOP and the child are byte-identical afterwards.
d=$(printf 'd%.0s' {1..200})/$(printf 'e%.0s' {1..200})
mkdir -p "$d"
layers 4M "$d/base.qcow2" top4.qcow2="write -P 5 0 1M"
new child4.qcow2 4M -f qcow2 -o cluster_size=512 -b top4.qcow2 -F qcow2
sha256sum "$d/base.qcow2" top4.qcow2 child4.qcow2 >sums4
! "$QCOMMIT" merge top4.qcow2 --rebase child4.qcow2 --budget off >out4.txt 2>err4.txt ||
  soft_fail "(4) a child whose header cannot hold BASE's name was accepted"
grep -q 'child4.qcow2' err4.txt || soft_fail "(4) the error does not name the child: $(cat err4.txt)"
sha256sum --quiet -c sums4 || soft_fail "(4) files changed although the merge was refused"

# (5) merge --delete while a reader has TOP open (TOP is only read-locked) longer than --wait: TOP
#     is not deleted under it, the wait is a JSON event ("for": "close", TOP's path, the reader's
#     pid and command), the error names the reader; once it is closed the same command finishes
#     (resumed).
small_chain
# A reader that takes no image lock (qemu-io would lock BASE too, and the merge would wait it out).
spawn python3 -c 'import time; f = open("top.qcow2", "rb"); time.sleep(3)'
reader=$!
# Until the reader has TOP open (a slow interpreter start must not let the merge go first).
reading() { ls -l "/proc/$reader/fd" 2>/dev/null | grep -q 'top\.qcow2$'; }
wait_until 4 reading || true
! "$QCOMMIT" merge top.qcow2 --budget off --delete --wait 1s --output=json >out5.txt 2>err5.txt ||
  soft_fail "(5) merge --delete succeeded while a reader had TOP open"
[[ -e top.qcow2 ]] || soft_fail "(5) TOP was deleted while a reader had it open"
grep -q "pid $reader" err5.txt || soft_fail "(5) the error does not name the reader: $(cat err5.txt)"
jq -se --arg top "$(pwd -P)/top.qcow2" --argjson pid "$reader" 'map(select(.event == "wait")) | length == 1 and
  (.[0] | .for == "close" and .path == $top and .holders == [{"pid": $pid, "command": "python3"}] and
   .["timeout-s"] == 1)' out5.txt >/dev/null ||
  soft_fail "(5) no wait event saying what it waits for (close, $(pwd -P)/top.qcow2, pid $reader python3, 1 s): $(jq -c 'select(.event == "wait")' out5.txt)"
wait "$reader" || true
"$QCOMMIT" merge top.qcow2 --budget off --delete --output=json >out5.json 2>err5b.txt || soft_fail "(5) the re-run failed: $(cat err5b.txt)"
[[ ! -e top.qcow2 ]] || soft_fail "(5) the re-run did not delete TOP"
jq -se 'map(select(.event == "result")) | .[0].resumed == true' out5.json >/dev/null || soft_fail "(5) the re-run did not resume"
same_view view.raw base.qcow2 || soft_fail "(5) BASE does not show TOP's view"

finish "merge.planted_links: all checks passed"
