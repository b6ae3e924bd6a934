#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_domain_crash: `qcommit merge --domain` SIGKILLed in the middle, then the same
# command again, against a real libvirtd. The re-run must finish both the data and the definition.
# Each scenario: a fresh domain whose disk chain base.qcow2 <- base.s1 <- base.s2 <- base.s3 was
# made by `virsh snapshot-create-as --disk-only` while it ran (so its inactive definition carries a
# <backingStore> chain, as libvirt writes it), data in every layer, the domain shut off; the guest
# view of the active layer saved as raw. The merge is killed (the table below) from outside while it
# copies, or at the test-only points of QCOMMIT_TEST_KILL_AT (plugin/domain/domain_merge.cpp): after
# the first committed copy window (the re-run must resume from the engine's checkpoint), after the
# data is merged, the snapshot metadata removed, the domain redefined; for the active layer and for
# a range below it, with and without --delete. After the re-run: qemu-img compare of the saved view
# with the active layer, qemu-img check of every qcow2 layer, `virsh domblklist`, the <backingStore>
# chain of `virsh dumpxml --inactive` equal to the files' chain, `virsh snapshot-list`, no
# checkpoint file and no journal left in the definition, merged files deleted only with --delete,
# and the domain starts on that chain.
# usage: offline-domain-crash.sh QCOMMIT [SCENARIO...]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
shift
merge_pid=
on_exit '[[ -z $merge_pid ]] || kill -9 "$merge_pid" 2>/dev/null'
scenario_init libvirt.offline_domain_crash qcc
kBigMiB=320  # two extents of this size in the active layer

# KILLED AT "-": from outside while it copies; DATA big: more than one copy window (kWindowBytes,
# 512 MiB) in base.s3, so the copy commits a checkpoint before it ends; RANGE below: base.s1 into
# base.qcow2, base.s2 rebased onto it (the definition's <backingStore> chain must follow).
scenarios=(
  # SCENARIO           KILLED AT          DATA   RANGE   --delete
  "copy-sigkill         -                  big    active  no"
  "data-window          data-window        big    active  no"
  "data-merged-delete   data-merged        small  active  yes"
  "snapshots-removed    snapshots-removed  small  active  no"
  "defined              defined            small  active  no"
  "below-data-merged    data-merged        small  below   no"
  "below-defined-delete defined            small  below   yes"
)

# prepare DATA: domain $dom on $dir/base.s3 (chain as above), shut off, view saved in view0.raw.
prepare() {
  scenario_dir
  snapshot_chain 4G
  virsh -q destroy "$dom" >/dev/null
  qio -f qcow2 base.s1 'write -P 2 1M 2M' 'write -P 5 3000M 1M'
  qio -f qcow2 base.s2 'write -P 3 2M 2M' 'write -z 6M 1M'
  local s3=('write -P 4 3M 64k')
  [[ $1 == small ]] || s3=("write -P 7 0 ${kBigMiB}M" "write -P 8 $((kBigMiB + 512))M ${kBigMiB}M")
  qio -f qcow2 base.s3 "${s3[@]}"
  qemu-img convert -O raw base.s3 view0.raw
}

# The merge journal kept in the domain's definition (plugin/domain/definition.cpp); fails when absent.
journal() { virsh -q metadata "$dom" urn:qcommit:domain-merge --config 2>/dev/null; }
# The image chain of FILE as qemu-img sees it, absolute paths, one per line.
file_chain() { qemu-img info --backing-chain --output=json "$1" | jq -r '.[] | ."filename"' | xargs -n1 realpath; }
# The chain of disk vda in the domain's definition (dumpxml ARGS): the files, top first.
xml_chain() { vda_xml "$@" | tr ' ' '\n' | sed -n 's/^[^=]*=//p' | xargs; }

# verify ACTIVE "SNAPSHOTS" MERGED_FILE DELETED(yes|no)
verify() {
  local active=$1 snaps_want=$2 merged=$3 deleted=$4 f want have left
  vda_is "$dir/$active" || fail "domblklist says vda is '$(vda_source "$dom")', expected $dir/$active"
  same_view view0.raw "$dir/$active" || fail "guest view of $active differs from the view before the merge"
  while read -r f; do
    [[ $(fmt_of "$f") == qcow2 ]] || continue
    qemu-img check -q "$f" || fail "qemu-img check $f is not clean"
  done < <(file_chain "$dir/$active")
  want=$(file_chain "$dir/$active" | xargs)
  have=$(xml_chain --inactive)
  [[ $have == "$want" ]] || fail "dumpxml --inactive chain '$have' != files' chain '$want'"
  have=$(virsh -q snapshot-list "$dom" --name | xargs)
  [[ $have == "$snaps_want" ]] || fail "snapshot-list is '$have', expected '$snaps_want'"
  left=$(find "$dir" -name '*.qcommit-merge*' | xargs)
  [[ -z $left ]] || fail "checkpoint files left behind: $left"
  ! journal >/dev/null || fail "merge journal left in the definition: $(journal)"
  [[ $deleted == no || ! -e $dir/$merged ]] || fail "$merged not deleted with --delete"
  [[ $deleted == yes || -e $dir/$merged ]] || fail "$merged deleted without --delete"
  if virsh -q start "$dom" >start.err 2>&1; then
    have=$(xml_chain)
    [[ $have == "$want" ]] || fail "the started domain runs on '$have', expected '$want'"
    virsh -q destroy "$dom" >/dev/null 2>&1 || true
  else
    fail "domain does not start after the re-run: $(cat start.err)"
  fi
}

# kill_in_copy: the merge, SIGKILLed from outside once the copy has made progress; the journal
# and the engine's checkpoint carry the re-run.
kill_in_copy() {
  "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json >run1.json 2>run1.err &
  merge_pid=$!
  while kill -0 "$merge_pid" 2>/dev/null; do
    if grep -q '"phase": "copy", "done": [1-9]' run1.json 2>/dev/null; then
      kill -9 "$merge_pid"
      break
    fi
    sleep 0.005
  done
  local rc=0
  wait "$merge_pid" || rc=$?
  merge_pid=
  [[ $rc == 137 ]] || fail "merge finished (exit $rc) before it could be killed in the copy"
  echo "  killed at: $(grep -o '"phase": "copy", "done": [0-9]*, "total": [0-9]*' run1.json | tail -n 1)"
}

# kill_at POINT MERGE-ARGS...: the merge killed at POINT; false when it did not die by SIGKILL there.
kill_at() {
  local point=$1 rc=0
  shift
  QCOMMIT_TEST_KILL_AT=$point "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json "$@" \
    >run1.json 2>run1.err || rc=$?
  [[ $rc == 137 ]] || { fail "merge not killed at '$point' (exit $rc): $(tail -n 3 run1.err)"; return 1; }
  journal >/dev/null || fail "no merge journal in the definition after the kill at '$point'"
}

rerun() {
  local rc=0
  "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json "$@" >run2.json 2>run2.err || rc=$?
  [[ $rc == 0 ]] || fail "re-run failed (exit $rc): $(tail -n 3 run2.err) $(grep -v progress run2.json | tail -n 3)"
  grep -q 'finishing an interrupted merge' run2.json run2.err ||
    fail "re-run did not say it finishes the interrupted merge"
}

(($#)) || set -- "${scenarios[@]%% *}"
for scen; do
  row=
  for r in "${scenarios[@]}"; do [[ ${r%% *} != "$scen" ]] || row=$r; done
  [[ -n $row ]] || { echo "unknown scenario $scen" >&2; exit 2; }
  read -r _ point data range delete <<<"$row"
  t0=$SECONDS
  prepare "$data"
  args=()
  [[ $range == below ]] && args=(--top "$dir/base.s1" --base "$dir/base.qcow2")
  [[ $delete == yes ]] && args+=(--delete)
  if [[ $point == - ]]; then
    kill_in_copy
    rerun "${args[@]}"
    echo "  re-run: $(jq -c 'select(.event == "result") | {"resumed-from", copied}' run2.json)"
  elif kill_at "$point" "${args[@]}"; then
    rerun "${args[@]}"
  fi
  if [[ $point == data-window ]]; then
    resumed=$(jq -r 'select(.event == "result") | ."resumed-from"' run2.json)
    [[ $resumed -gt 0 ]] || fail "re-run did not resume from the checkpoint (resumed-from '$resumed')"
    echo "  re-run resumed from guest offset $resumed"
  fi
  if [[ $range == below ]]; then
    verify base.s3 "s3" base.s1 "$delete"
  else
    verify base.s2 "s1 s2" base.s3 "$delete"
  fi
  echo "scenario $scen: $((SECONDS - t0)) s"
done
finish "libvirt.offline_domain_crash: OK ($SECONDS s)"
