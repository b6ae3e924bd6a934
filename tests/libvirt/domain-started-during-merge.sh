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
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
shift
pid= qio=
scenario_cleanup_hook() {
  if [[ -n $qio ]]; then kill "$qio" 2>/dev/null || true; fi
  if [[ -n $pid ]]; then
    kill -CONT "$pid" 2>/dev/null
    kill -9 "$pid" 2>/dev/null
  fi
}
scenario_test_init qcs

# setup: $dir/base.qcow2 <- mid.qcow2 <- top.qcow2, data in each, domain $dom on top.qcow2 (shut
# off), the guest view saved in view0.raw.
setup() {
  dir=$root/$scen
  dom=$tag-$scen
  mkdir -p "$dir"
  cd "$dir"
  qemu-img create -q -f qcow2 base.qcow2 256M
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2
  qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2
  qemu-io -c 'write -P 1 0 8M' base.qcow2 >/dev/null
  qemu-io -c 'write -P 2 1M 2M' mid.qcow2 >/dev/null
  qemu-io -c 'write -P 3 2M 2M' -c 'write -z 6M 1M' -c 'write -P 4 100M 16M' top.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view0.raw
  define_disk_domain "$dom" "$dir/top.qcow2"
  doms+=("$dom")
}

# The pid of the domain's QEMU, or nothing when it does not run.
qemu_pid() { cat "/run/libvirt/qemu/$dom.pid" 2>/dev/null || true; }
# Files a running QEMU of the domain has open that no longer exist.
qemu_deleted_files() {
  local q
  q=$(qemu_pid)
  [[ -n $q ]] || return 0
  find "/proc/$q/fd" -type l -printf '%l\n' 2>/dev/null | grep ' (deleted)$' || true
}

# started_during POINT MERGE-ARGS...: runs the merge with QCOMMIT_TEST_STOP_AT=POINT, waits
# until it stops there, runs `virsh start`, lets the merge go on and checks what happened.
# Sets $started (yes|no) and $merge_rc.
started_during() {
  local point=$1
  shift
  QCOMMIT_TEST_STOP_AT=$point "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "$@" \
    >merge.out 2>merge.err &
  pid=$!
  local state= i
  for ((i = 0; i < 1200; i++)); do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    [[ $state == T || -z $state ]] && break
    sleep 0.1
  done
  if [[ $state != T ]]; then
    merge_rc=0
    wait "$pid" || merge_rc=$?
    pid=
    fail "the merge never stopped at '$point' (exit $merge_rc): $(tail -n 3 merge.err)"
    started=no
    return 0
  fi
  # The merge is stopped at POINT: the images must be locked against a starting QEMU.
  if virsh -q start "$dom" >start.out 2>start.err; then
    started=yes
    echo "  virsh start at '$point' succeeded"
  else
    started=no
    echo "  virsh start at '$point' failed: $(grep -o "Failed to get [^:]*lock[^']*" start.err | head -n 1)"
    grep -qi 'lock' start.err || fail "the start failed, but not on an image lock: $(cat start.err)"
  fi
  kill -CONT "$pid"
  merge_rc=0
  wait "$pid" || merge_rc=$?
  pid=
  # Never a running QEMU on a deleted file.
  local gone
  gone=$(qemu_deleted_files)
  [[ -z $gone ]] || fail "the domain's QEMU runs on deleted files: $gone"
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

# finish_and_verify ACTIVE MERGED MERGE-ARGS...: re-runs the merge when an earlier run left its
# journal, then checks the domain's disk, the view, the deletion and that the domain starts.
finish_and_verify() {
  local active=$1 merged=$2
  shift 2
  if virsh -q metadata "$dom" urn:qcommit:domain-merge --config >/dev/null 2>&1; then
    "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "$@" >rerun.out 2>rerun.err ||
      fail "the re-run failed: $(tail -n 3 rerun.err)"
  fi
  local src
  src=$(vda_source "$dom")
  [[ $src == "$dir/$active" ]] || fail "vda is '$src', expected $dir/$active"
  qemu-img compare -q view0.raw "$dir/$active" || fail "the guest view of $active differs from before the merge"
  local f
  for f in "$dir"/*.qcow2; do qemu-img check -q "$f" || fail "qemu-img check $f is not clean"; done
  [[ ! -e $dir/$merged ]] || fail "$merged not deleted with --delete"
  local left
  left=$(find "$dir" -name '*.qcommit-merge*' | xargs)
  [[ -z $left ]] || fail "checkpoint files left behind: $left"
  ! virsh -q metadata "$dom" urn:qcommit:domain-merge --config >/dev/null 2>&1 || fail "merge journal left in the definition"
  if virsh -q start "$dom" >start2.err 2>&1; then
    virsh -q destroy "$dom" >/dev/null 2>&1 || true
  else
    fail "the domain does not start after the merge: $(cat start2.err)"
  fi
}

# reader_during POINT MERGE-ARGS...: runs the merge with QCOMMIT_TEST_STOP_AT=POINT; there, a
# qemu-io opens top.qcow2 read-only (as a QEMU reading it as a backing file would: TOP is only
# read-locked by the merge, and others may read it too) and keeps it open. The merge must not
# delete it under that reader: it refuses (one line naming the process, exit 1), TOP stays.
reader_during() {
  local point=$1
  shift
  QCOMMIT_TEST_STOP_AT=$point "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "$@" \
    >merge.out 2>merge.err &
  pid=$!
  local state= i
  for ((i = 0; i < 1200; i++)); do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    [[ $state == T || -z $state ]] && break
    sleep 0.1
  done
  [[ $state == T ]] || { fail "the merge never stopped at '$point': $(tail -n 3 merge.err)"; pid=; return 0; }
  qemu-io -r -f raw -c 'sleep 600000' "$dir/top.qcow2" >qio.out 2>&1 &
  qio=$!
  for ((i = 0; i < 100; i++)); do
    find "/proc/$qio/fd" -type l -printf '%l\n' 2>/dev/null | grep -qx "$dir/top.qcow2" && break
    sleep 0.05
  done
  find "/proc/$qio/fd" -type l -printf '%l\n' 2>/dev/null | grep -qx "$dir/top.qcow2" ||
    fail "qemu-io could not open top.qcow2 beside the merge: $(cat qio.out)"
  kill -CONT "$pid"
  merge_rc=0
  wait "$pid" || merge_rc=$?
  pid=
  # TOP's own link only: qemu-io may hold other unlinked files (a deleted one of its own is no
  # deletion by the merge).
  if find "/proc/$qio/fd" -type l -printf '%l\n' 2>/dev/null | grep -qxF "$dir/top.qcow2 (deleted)"; then
    fail "top.qcow2 was deleted while qemu-io (pid $qio) had it open"
  fi
  [[ $merge_rc == 1 ]] || fail "the merge deleted (exit $merge_rc) though top.qcow2 was open"
  tail -n 1 merge.err | grep -q "top.qcow2: is open in pid $qio (qemu-io); not deleted" ||
    fail "no clear one-line refusal: $(tail -n 2 merge.err)"
  [[ -e $dir/top.qcow2 ]] || fail "top.qcow2 is gone"
  kill "$qio" 2>/dev/null || true
  wait "$qio" 2>/dev/null || true
  qio=
}

all=(active-data-merged active-defined rerun-defined below-data-merged reader-opens-top)
(($#)) || set -- "${all[@]}"
for scen in "$@"; do
  t0=$SECONDS
  case $scen in
    active-data-merged)
      # The definition still names TOP: a QEMU started now would run on TOP, which the merge
      # is about to delete.
      setup
      started_during data-merged --delete
      [[ $started == no ]] || fail "the domain could start on TOP while the merge held it"
      finish_and_verify mid.qcow2 top.qcow2 --delete
      ;;
    active-defined)
      setup
      started_during defined --delete
      [[ $started == no ]] || fail "the domain could start while the merge held its images"
      finish_and_verify mid.qcow2 top.qcow2 --delete
      ;;
    rerun-defined)
      # Killed once the definition is updated; the re-run finishes the rest under its own locks.
      setup
      rc=0
      QCOMMIT_TEST_KILL_AT=defined "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --delete \
        >kill.out 2>kill.err || rc=$?
      [[ $rc == 137 ]] || fail "merge not killed at 'defined' (exit $rc): $(tail -n 3 kill.err)"
      [[ -e $dir/top.qcow2 ]] || fail "top.qcow2 deleted before the kill point"
      started_during defined --delete
      [[ $started == no ]] || fail "the domain could start while the re-run held its images"
      finish_and_verify mid.qcow2 top.qcow2 --delete
      ;;
    below-data-merged)
      # MID into BASE; TOP, the active layer, is rebased onto BASE by then.
      setup
      started_during data-merged --top "$dir/mid.qcow2" --base "$dir/base.qcow2" --delete
      [[ $started == no ]] || fail "the domain could start while the merge held its images"
      finish_and_verify top.qcow2 mid.qcow2 --top "$dir/mid.qcow2" --base "$dir/base.qcow2" --delete
      ;;
    reader-opens-top)
      # Another reader of TOP, which the merge's read lock on TOP lets in: no deletion under it;
      # the re-run deletes TOP once it is closed.
      setup
      reader_during defined --delete
      finish_and_verify mid.qcow2 top.qcow2 --delete
      ;;
    *) echo "unknown scenario $scen" >&2; exit 2 ;;
  esac
  echo "scenario $scen: $((SECONDS - t0)) s"
done

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.domain_started_during_merge: OK ($SECONDS s)"
