#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.domain_started_during_merge: `qcommit merge --domain --delete` while someone starts the
# domain, against a real libvirtd. The domain is checked once at the start of the merge, and the
# copy takes its time: a `virsh start` can come at any moment after that. The merge is stopped
# (QCOMMIT_TEST_STOP_AT, plugin/domain/domain_merge.cpp) at its named points after the copy:
#   data-merged  the data is in BASE, the definition still names TOP, nothing deleted yet;
#   defined      the definition names BASE, the merged files are about to be deleted;
# the test runs `virsh start` there, then lets the merge go on. The merge holds QEMU's image
# locks through these steps, so QEMU cannot open the images: the start must fail on a lock, and
# the merge then finish (definition on BASE, TOP deleted). If the start ever succeeds, the merge
# must refuse (one line, exit 1) and TOP must still exist: never is a file deleted that a
# running QEMU has open, and never does a running domain get its definition switched away.
# Scenarios: the active layer (TOP <- domain) at each point; the same on the re-run that finishes
# an interrupted merge (killed at 'defined', QCOMMIT_TEST_KILL_AT), where the locks are the CLI's
# own; a range below the active layer (--top MID --base BASE) at data-merged; and a qemu-io that
# opens TOP read-only at 'defined' (TOP's read lock admits other readers): TOP is not deleted
# under it, the merge refuses in one line, and the re-run deletes TOP once it is closed.
# After each: the guest view is unchanged (qemu-img compare), the images are clean, and the
# domain starts on the merged chain.
# usage: domain-started-during-merge.sh QCOMMIT [SCENARIO...]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
shift
merge_pid='' qio=''
on_exit '[[ -z $qio ]] || kill "$qio" 2>/dev/null; [[ -z $merge_pid ]] || { kill -CONT "$merge_pid"; kill -9 "$merge_pid"; } 2>/dev/null'
scenario_init libvirt.domain_started_during_merge qcs

# prepare: $dir/base.qcow2 <- mid.qcow2 <- top.qcow2, data in each, domain $dom on top.qcow2 (shut
# off), the guest view saved in view0.raw.
prepare() {
  scenario_dir
  layers 256M base.qcow2='write -P 1 0 8M' mid.qcow2='write -P 2 1M 2M' \
    top.qcow2='write -P 3 2M 2M;write -z 6M 1M;write -P 4 100M 16M'
  qemu-img convert -O raw top.qcow2 view0.raw
  define_disk_domain "$dom" "$dir/top.qcow2"
}

# Files a running QEMU of the domain has open that no longer exist.
qemu_deleted_files() {
  local q
  q=$(cat "/run/libvirt/qemu/$dom.pid" 2>/dev/null) || return 0
  find "/proc/$q/fd" -type l -printf '%l\n' 2>/dev/null | grep ' (deleted)$' || true
}
# merge_state: the merge's process state (T: stopped), "" once it has ended.
merge_state() { awk '{print $3}' "/proc/$merge_pid/stat" 2>/dev/null || true; }
stopped_or_ended() { [[ $(merge_state) == T || -z $(merge_state) ]]; }
# has_open FILE: qemu-io ($qio) has FILE open.
has_open() { find "/proc/$qio/fd" -type l -printf '%l\n' 2>/dev/null | grep -qxF "$1"; }

# stop_merge_at POINT: starts the merge (--delete, the scenario's $range) with
# QCOMMIT_TEST_STOP_AT=POINT ($merge_pid) and waits until it stops there; false (after fail) if not.
stop_merge_at() {
  QCOMMIT_TEST_STOP_AT=$1 "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "${range[@]}" --delete \
    >merge.out 2>merge.err &
  merge_pid=$!
  wait_until 120 stopped_or_ended || true
  [[ $(merge_state) == T ]] && return 0
  go_on
  fail "the merge never stopped at '$1' (exit $merge_rc): $(tail -n 3 merge.err)"
  return 1
}
# go_on: lets the stopped merge go on and sets $merge_rc.
go_on() {
  kill -CONT "$merge_pid"
  merge_rc=0
  wait "$merge_pid" || merge_rc=$?
  merge_pid=
}

# started_during POINT: runs `virsh start` while the merge is stopped at POINT, lets
# the merge go on and checks what happened.
started_during() {
  stop_merge_at "$1" || return 0
  # The merge is stopped at POINT: the images must be locked against a starting QEMU.
  local started=no
  if virsh -q start "$dom" >start.out 2>start.err; then
    started=yes
    echo "  virsh start at '$1' succeeded"
    fail "the domain could start at '$1' while the merge held its images"
  else
    echo "  virsh start at '$1' failed: $(grep -o "Failed to get [^:]*lock[^']*" start.err | head -n 1)"
    grep -qi 'lock' start.err || fail "the start failed, but not on an image lock: $(cat start.err)"
  fi
  go_on
  # Never a running QEMU on a deleted file.
  [[ -z $(qemu_deleted_files) ]] || fail "the domain's QEMU runs on deleted files: $(qemu_deleted_files)"
  if [[ $started == yes ]]; then
    [[ $merge_rc == 1 ]] || fail "the domain started during the merge and the merge went on (exit $merge_rc)"
    tail -n 1 merge.err | grep -q '^qcommit: domain .*: was started during the merge' ||
      fail "no clear one-line refusal: $(tail -n 2 merge.err)"
    [[ -e $dir/top.qcow2 ]] || fail "top.qcow2 was deleted although the domain started on it"
    virsh -q destroy "$dom" >/dev/null 2>&1 || true
  else
    [[ $merge_rc == 0 ]] || fail "the merge failed (exit $merge_rc) though the start was refused: $(tail -n 3 merge.err)"
  fi
}

# reader_during POINT: while the merge is stopped at POINT, a qemu-io opens
# top.qcow2 read-only (as a QEMU reading it as a backing file would: TOP is only read-locked by the
# merge, and others may read it too) and keeps it open. The merge must not delete it under that
# reader: it refuses (one line naming the process, exit 1), TOP stays.
reader_during() {
  stop_merge_at "$1" || return 0
  qemu-io -r -f raw -c 'sleep 600000' "$dir/top.qcow2" >qio.out 2>&1 &
  qio=$!
  wait_until 5 has_open "$dir/top.qcow2" || fail "qemu-io could not open top.qcow2 beside the merge: $(cat qio.out)"
  go_on
  # TOP's own link only: qemu-io may hold other unlinked files (a deleted one of its own is no
  # deletion by the merge).
  has_open "$dir/top.qcow2 (deleted)" && fail "top.qcow2 was deleted while qemu-io (pid $qio) had it open"
  [[ $merge_rc == 1 ]] || fail "the merge deleted (exit $merge_rc) though top.qcow2 was open"
  tail -n 1 merge.err | grep -q "top.qcow2: is open in pid $qio (qemu-io); not deleted" ||
    fail "no clear one-line refusal: $(tail -n 2 merge.err)"
  [[ -e $dir/top.qcow2 ]] || fail "top.qcow2 is gone"
  stop "$qio"
  qio=
}

# finish_and_verify ACTIVE MERGED: re-runs the merge when an earlier run left its journal, then
# checks the domain's disk, the view, the deletion and that the domain starts.
finish_and_verify() {
  local active=$1 merged=$2 f left
  no_journal || "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "${range[@]}" --delete >rerun.out 2>rerun.err ||
    fail "the re-run failed: $(tail -n 3 rerun.err)"
  vda_is "$dir/$active" || fail "vda is '$(vda_source "$dom")', expected $dir/$active"
  same_view view0.raw "$dir/$active" || fail "the guest view of $active differs from before the merge"
  for f in "$dir"/*.qcow2; do qemu-img check -q "$f" || fail "qemu-img check $f is not clean"; done
  [[ ! -e $dir/$merged ]] || fail "$merged not deleted with --delete"
  left=$(find "$dir" -name '*.qcommit-merge*' | xargs)
  [[ -z $left ]] || fail "checkpoint files left behind: $left"
  no_journal || fail "merge journal left in the definition"
  virsh -q start "$dom" >start2.err 2>&1 || fail "the domain does not start after the merge: $(cat start2.err)"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
}

(($#)) || set -- active-data-merged active-defined rerun-defined below-data-merged reader-opens-top
for scen; do
  t0=$SECONDS
  prepare
  range=()
  [[ $scen != below-* ]] || range=(--top "$dir/mid.qcow2" --base "$dir/base.qcow2")
  case $scen in
    # active-: the definition still names TOP at data-merged: a QEMU started now would run on TOP,
    # which the merge is about to delete. below-: MID into BASE; TOP, the active layer, is rebased
    # onto BASE by then.
    active-data-merged | below-data-merged) started_during data-merged ;;
    active-defined) started_during defined ;;
    rerun-defined)
      # Killed once the definition is updated; the re-run finishes the rest under its own locks.
      QCOMMIT_TEST_KILL_AT=defined try "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --delete
      [[ $rc == 137 ]] || fail "merge not killed at 'defined' (exit $rc): $(tail -n 3 err.txt)"
      [[ -e $dir/top.qcow2 ]] || fail "top.qcow2 deleted before the kill point"
      started_during defined
      ;;
    # Another reader of TOP, which the merge's read lock on TOP lets in: no deletion under it;
    # the re-run deletes TOP once it is closed.
    reader-opens-top) reader_during defined ;;
    *) echo "unknown scenario $scen" >&2; exit 2 ;;
  esac
  if [[ $scen == below-* ]]; then
    finish_and_verify top.qcow2 mid.qcow2
  else
    finish_and_verify mid.qcow2 top.qcow2
  fi
  echo "scenario $scen: $((SECONDS - t0)) s"
done
finish "libvirt.domain_started_during_merge: OK ($SECONDS s)"
