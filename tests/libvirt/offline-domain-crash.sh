#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_domain_crash: `qcommit merge --domain` SIGKILLed in the middle, then the same
# command again, against a real libvirtd. The re-run must finish both the data and the definition.
#
# Each scenario: a fresh domain whose disk chain base.qcow2 <- base.s1 <- base.s2 <- base.s3 was
# made by `virsh snapshot-create-as --disk-only` while it ran (so its inactive definition carries
# a <backingStore> chain, as libvirt writes it), data in every layer, the domain shut off; the
# guest view of the active layer saved as raw. The merge is killed
#   - from outside with SIGKILL while it copies (copy-sigkill),
#   - at the test-only points of QCOMMIT_TEST_KILL_AT (plugin/domain/domain_merge.cpp): after the first
#     committed copy window (the re-run must resume from the engine's checkpoint), after the data
#     is merged, after the snapshot metadata is removed, after the domain is redefined,
# for the active layer and for a range below it (--top base.s1 --base base.qcow2), with and
# without --delete. After the re-run: qemu-img compare of the saved view with the active layer,
# qemu-img check of every qcow2 layer, `virsh domblklist`, the <backingStore> chain of
# `virsh dumpxml --inactive` equal to the files' chain, `virsh snapshot-list`, no checkpoint
# file and no journal left in the definition, merged files deleted only with --delete, and the
# domain starts on that chain.
#
# usage: offline-domain-crash.sh QCOMMIT [SCENARIO...]
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
shift
pid=
scenario_cleanup_hook() {
  [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
}
scenario_test_init qcc

kBigMiB=320  # two extents of this size in the active layer

# setup SCEN BIG: domain $dom on $dir/base.s3 (chain as above), shut off, view saved in view0.raw.
setup() {
  local big=$1
  dir=$root/$scen
  dom=$tag-$scen
  mkdir -p "$dir"
  cd "$dir"
  qemu-img create -q -f qcow2 base.qcow2 4G
  qemu-io -c 'write -P 1 0 8M' base.qcow2 >/dev/null
  define_disk_domain "$dom" "$dir/base.qcow2"
  doms+=("$dom")
  virsh -q start "$dom" >/dev/null
  local s
  for s in s1 s2 s3; do virsh -q snapshot-create-as "$dom" "$s" --disk-only --atomic >/dev/null; done
  virsh -q destroy "$dom" >/dev/null
  qemu-io -c 'write -P 2 1M 2M' -c 'write -P 5 3000M 1M' base.s1 >/dev/null
  qemu-io -c 'write -P 3 2M 2M' -c 'write -z 6M 1M' base.s2 >/dev/null
  if [[ $big == big ]]; then
    # More data than one copy window (kWindowBytes, 512 MiB), so the copy commits a checkpoint
    # before it ends.
    qemu-io -c "write -P 7 0 ${kBigMiB}M" -c "write -P 8 $((kBigMiB + 512))M ${kBigMiB}M" base.s3 >/dev/null
  else
    qemu-io -c 'write -P 4 3M 64k' base.s3 >/dev/null
  fi
  qemu-img convert -O raw base.s3 view0.raw
}

# The merge journal kept in the domain's definition (plugin/domain/definition.cpp); fails when absent.
journal() { virsh -q metadata "$dom" urn:qcommit:domain-merge --config 2>/dev/null; }
# The image chain of FILE as qemu-img sees it, absolute paths, one per line.
file_chain() { qemu-img info --backing-chain --output=json "$1" | jq -r '.[] | ."filename"' | xargs -n1 realpath; }
# The chain of disk vda in the domain's definition: <source> then every <backingStore>'s source.
xml_chain() {
  virsh dumpxml "$@" "$dom" | python3 -c '
import sys, xml.etree.ElementTree as ET
for disk in ET.parse(sys.stdin).getroot().iter("disk"):
    if disk.find("target") is None or disk.find("target").get("dev") != "vda":
        continue
    n = disk
    while n is not None and n.find("source") is not None:
        print(n.find("source").get("file") or n.find("source").get("dev"))
        n = n.find("backingStore")'
}

# verify ACTIVE "SNAPSHOTS" MERGED_FILE DELETED(yes|no)
verify() {
  local active=$1 snaps_want=$2 merged=$3 deleted=$4
  local src
  src=$(vda_source "$dom")
  [[ $src == "$dir/$active" ]] || fail "domblklist says vda is '$src', expected $dir/$active"
  qemu-img compare -q view0.raw "$dir/$active" || fail "guest view of $active differs from the view before the merge"
  local f
  while read -r f; do
    [[ $(qemu-img info --output=json "$f" | jq -r .format) == qcow2 ]] || continue
    qemu-img check -q "$f" || fail "qemu-img check $f is not clean"
  done < <(file_chain "$dir/$active")
  local want have
  want=$(file_chain "$dir/$active" | xargs)
  have=$(xml_chain --inactive | xargs)
  [[ $have == "$want" ]] || fail "dumpxml --inactive chain '$have' != files' chain '$want'"
  have=$(virsh -q snapshot-list "$dom" --name | xargs)
  [[ $have == "$snaps_want" ]] || fail "snapshot-list is '$have', expected '$snaps_want'"
  local left
  left=$(find "$dir" -name '*.qcommit-merge*' | xargs)
  [[ -z $left ]] || fail "checkpoint files left behind: $left"
  ! journal >/dev/null || fail "merge journal left in the definition: $(journal)"
  if [[ $deleted == yes ]]; then
    [[ ! -e $dir/$merged ]] || fail "$merged not deleted with --delete"
  else
    [[ -e $dir/$merged ]] || fail "$merged deleted without --delete"
  fi
  if virsh -q start "$dom" >start.err 2>&1; then
    have=$(xml_chain | xargs)
    [[ $have == "$want" ]] || fail "the started domain runs on '$have', expected '$want'"
    virsh -q destroy "$dom" >/dev/null 2>&1 || true
  else
    fail "domain does not start after the re-run: $(cat start.err)"
  fi
}

# crash POINT MERGE-ARGS...: run the merge killed at POINT, check it died by SIGKILL, re-run.
crash_and_rerun() {
  local point=$1
  shift
  local rc=0
  QCOMMIT_TEST_KILL_AT=$point "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json "$@" \
    >run1.json 2>run1.err || rc=$?
  [[ $rc == 137 ]] || { fail "merge not killed at '$point' (exit $rc): $(tail -n 3 run1.err)"; return 0; }
  journal >/dev/null || fail "no merge journal in the definition after the kill at '$point'"
  rerun "$@"
}

rerun() {
  local rc=0
  "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json "$@" >run2.json 2>run2.err || rc=$?
  [[ $rc == 0 ]] || fail "re-run failed (exit $rc): $(tail -n 3 run2.err) $(grep -v progress run2.json | tail -n 3)"
  grep -q 'finishing an interrupted merge' run2.json run2.err ||
    fail "re-run did not say it finishes the interrupted merge"
}

want() { [[ $# == 0 ]] || printf '%s\n' "$@" | grep -qx "$scen"; }
all=(copy-sigkill data-window data-merged-delete snapshots-removed defined below-data-merged below-defined-delete)
(($#)) || set -- "${all[@]}"
for scen in "$@"; do
  t0=$SECONDS
  case $scen in
    copy-sigkill)
      # SIGKILL from outside once the copy has made progress; the journal and the engine's
      # checkpoint carry the re-run.
      setup big
      "$QCOMMIT" merge --domain "$dom" --disk vda --budget off --output=json >run1.json 2>run1.err &
      pid=$!
      while kill -0 "$pid" 2>/dev/null; do
        if grep -q '"phase": "copy", "done": [1-9]' run1.json 2>/dev/null; then
          kill -9 "$pid"
          break
        fi
        sleep 0.005
      done
      rc=0
      wait "$pid" || rc=$?
      pid=
      [[ $rc == 137 ]] || fail "merge finished (exit $rc) before it could be killed in the copy"
      done_at=$(grep -o '"phase": "copy", "done": [0-9]*, "total": [0-9]*' run1.json | tail -n 1)
      echo "  killed at: $done_at"
      rerun
      echo "  re-run: $(jq -c 'select(.event == "result") | {"resumed-from", copied}' run2.json)"
      verify base.s2 "s1 s2" base.s3 no
      ;;
    data-window)
      setup big
      crash_and_rerun data-window
      resumed=$(jq -r 'select(.event == "result") | ."resumed-from"' run2.json)
      [[ $resumed -gt 0 ]] || fail "re-run did not resume from the checkpoint (resumed-from '$resumed')"
      echo "  re-run resumed from guest offset $resumed"
      verify base.s2 "s1 s2" base.s3 no
      ;;
    data-merged-delete)
      # --delete: the merged active layer must survive until the definition no longer names it.
      setup small
      crash_and_rerun data-merged --delete
      verify base.s2 "s1 s2" base.s3 yes
      ;;
    snapshots-removed)
      setup small
      crash_and_rerun snapshots-removed
      verify base.s2 "s1 s2" base.s3 no
      ;;
    defined)
      setup small
      crash_and_rerun defined
      verify base.s2 "s1 s2" base.s3 no
      ;;
    below-data-merged)
      # A range below the active layer: base.s2 is rebased onto base.qcow2 by the merge; the
      # definition's <backingStore> chain must follow.
      setup small
      crash_and_rerun data-merged --top "$dir/base.s1" --base "$dir/base.qcow2"
      verify base.s3 "s3" base.s1 no
      ;;
    below-defined-delete)
      setup small
      crash_and_rerun defined --top "$dir/base.s1" --base "$dir/base.qcow2" --delete
      verify base.s3 "s3" base.s1 yes
      ;;
    *) echo "unknown scenario $scen" >&2; exit 2 ;;
  esac
  echo "scenario $scen: $((SECONDS - t0)) s"
done

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.offline_domain_crash: OK ($SECONDS s)"
