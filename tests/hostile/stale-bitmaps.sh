#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Persistent bitmaps in BASE, valid and stale (issue 17). A program without bitmap support clears
# the autoclear bitmaps bit when it writes an image; the bitmaps extension it leaves describes
# nothing (QEMU's docs/interop/qcow2.txt). qcommit must treat it as QEMU does: `check` counts its
# clusters as leaks (the same count as qemu-img check), `check --repair` frees them, and a merge
# neither frees nor follows them, even once they hold other data. Valid bitmaps are removed by the
# merge. Every case ends with BASE showing TOP's original view and a clean qemu-img check.
# usage: stale-bitmaps.sh QCOMMIT
set -uo pipefail
qcommit=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
patch() { python3 "$here/qcow2_patch.py" "$@"; }
work=$(mktemp -d /tmp/qcommit-bitmaps.XXXXXX)
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
kBitmapsExt=0x23852875

json_field() { python3 -c 'import json,sys; print(json.load(sys.stdin).get(sys.argv[1], 0))' "$1"; }
# Leaked clusters as qemu-img check and qcommit check count them.
qemu_leaks() { qemu-img check --output=json "$1" 2>/dev/null | json_field leaks; }
qcommit_leaks() { "$qcommit" check --output=json "$1" 2>/dev/null | json_field leaks; }
# Persistent bitmaps as qemu-img info and qcommit info (and plan) count them.
qemu_bitmaps() {
  qemu-img info --output=json "$1" 2>/dev/null |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin).get("format-specific", {}).get("data", {}).get("bitmaps", [])))'
}
qcommit_bitmaps() {
  "$qcommit" info --output=json "$1" 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["chain"][0].get("bitmaps", 0))'
}
plan_bitmaps() {
  "$qcommit" plan --output=json "$1" --budget off 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["bitmaps-to-remove"])'
}
# plan_agrees CASE : the plan of a merge into BASE counts no bitmaps to remove, as qemu-img info.
plan_agrees() {
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 plan-top.qcow2 64M
  local pb; pb=$(plan_bitmaps plan-top.qcow2)
  [ "$pb" = "$(qemu_bitmaps base.qcow2)" ] || fail "$1: plan counts $pb bitmaps to remove, qemu-img info $(qemu_bitmaps base.qcow2)"
  rm -f plan-top.qcow2
}
has_bitmaps_ext() { patch "$1" extensions | grep -qix "$kBitmapsExt"; }

# BASE (64 MiB, data in [0, 4M) and [8M, 12M)) with bitmap b0, dirty over [8M, 12M): the bitmap
# owns a directory, a table and a data cluster.
mkbase() {
  qemu-img create -q -f qcow2 base.qcow2 64M &&
    qemu-io -f qcow2 -c 'write -P 0x11 0 4M' base.qcow2 >/dev/null &&
    qemu-img bitmap --add base.qcow2 b0 &&
    qemu-io -f qcow2 -c 'write -P 0x22 8M 4M' base.qcow2 >/dev/null
}

# merge_and_verify CASE : TOP over BASE, merged; BASE must end as TOP's original view, clean.
merge_and_verify() {
  local case=$1 rc=0
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M &&
    qemu-io -f qcow2 -c 'write -P 0x44 2M 8M' -c 'write -z 40M 1M' top.qcow2 >/dev/null || {
    fail "$case: cannot make TOP"; return; }
  qemu-img convert -O raw top.qcow2 top-view.raw
  timeout 120 "$qcommit" merge "$PWD/top.qcow2" --budget off --output=json >merge.out 2>merge.err || rc=$?
  if [ $rc -ne 0 ]; then fail "$case: merge exited $rc: $(tail -2 merge.err)"; return; fi
  echo "  $case: merge: $(grep -o '"bitmaps-removed": [0-9]*' merge.out | tail -1)"
  qemu-img compare -q -f raw -F qcow2 top-view.raw base.qcow2 ||
    fail "$case: BASE does not show TOP's original view"
  local out
  out=$(qemu-img check base.qcow2 2>&1) || fail "$case: qemu-img check of BASE after the merge: $out"
  out=$("$qcommit" check base.qcow2 2>&1) || fail "$case: qcommit check of BASE after the merge: $out"
  has_bitmaps_ext base.qcow2 && fail "$case: BASE still has a bitmaps extension after the merge"
  [ "$(qemu_bitmaps base.qcow2)" = 0 ] || fail "$case: qemu-img info lists bitmaps after the merge"
}

echo "stale: autoclear bit cleared, check --repair=leaks, then merge"
mkdir "$work/stale" && cd "$work/stale" && mkbase || fail "stale: cannot make BASE"
patch base.qcow2 autoclear 0
ql=$(qemu_leaks base.qcow2) cl=$(qcommit_leaks base.qcow2)
echo "  stale: leaks: qemu-img $ql, qcommit $cl"
[ "$ql" -ge 3 ] || fail "stale: qemu-img check finds $ql leaks, expected the bitmap's 3 clusters"
[ "$ql" = "$cl" ] || fail "stale: qemu-img check counts $ql leaked clusters, qcommit check $cl"
qb=$(qemu_bitmaps base.qcow2) cb=$(qcommit_bitmaps base.qcow2)
[ "$qb" = 0 ] && [ "$cb" = 0 ] || fail "stale: bitmaps counted by qemu-img info $qb, qcommit info $cb (expected 0)"
"$qcommit" check --repair=leaks base.qcow2 >repair.out 2>&1 || fail "stale: check --repair=leaks exited $?: $(cat repair.out)"
has_bitmaps_ext base.qcow2 && fail "stale: check --repair left the stale bitmaps extension in the header"
out=$(qemu-img check base.qcow2 2>&1) || fail "stale: qemu-img check after qcommit check --repair: $out"
[ "$(qemu_leaks base.qcow2)" = 0 ] || fail "stale: leaks left after qcommit check --repair"
plan_agrees stale
merge_and_verify stale

echo "stale-reused: the stale extension's clusters hold other data when the merge starts"
mkdir "$work/reused" && cd "$work/reused" && mkbase || fail "reused: cannot make BASE"
patch base.qcow2 autoclear 0
dd if=base.qcow2 of=header.bin bs=64k count=1 status=none
qemu-img check -q -r leaks base.qcow2 >/dev/null 2>&1
# QEMU freed the bitmap's clusters and dropped the extension; new data takes the freed clusters
# (one cluster per write: each takes the lowest free cluster).
reuse="16 17 18 19 20 21"
for i in $reuse; do qemu-io -f qcow2 -c "write -P 0x33 ${i}M 64k" base.qcow2 >/dev/null; done
# The header as it was (stale extension back): still a valid image, the extension describes nothing.
dd if=header.bin of=base.qcow2 bs=64k count=1 conv=notrunc status=none
has_bitmaps_ext base.qcow2 || fail "reused: the stale extension is not back"
out=$(qemu-img check base.qcow2 2>&1) || fail "reused: qemu-img check of the prepared BASE: $out"
cl=$(qcommit_leaks base.qcow2)
[ "$cl" = 0 ] || fail "reused: qcommit check finds $cl leaks where qemu-img check finds none"
plan_agrees reused
merge_and_verify reused
for i in $reuse; do
  qemu-io -f qcow2 -c "read -P 0x33 ${i}M 64k" base.qcow2 | grep -q 'read 65536' ||
    fail "reused: the data written at ${i}M (into the freed clusters) changed"
done

echo "valid: bitmaps removed by the merge"
mkdir "$work/valid" && cd "$work/valid" && mkbase || fail "valid: cannot make BASE"
[ "$(qemu_bitmaps base.qcow2)" = 1 ] && [ "$(qcommit_bitmaps base.qcow2)" = 1 ] ||
  fail "valid: bitmaps counted by qemu-img info $(qemu_bitmaps base.qcow2), qcommit info $(qcommit_bitmaps base.qcow2) (expected 1)"
out=$("$qcommit" check base.qcow2 2>&1) || fail "valid: qcommit check of BASE with bitmaps: $out"
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 plan-top.qcow2 64M
[ "$(plan_bitmaps plan-top.qcow2)" = 1 ] || fail "valid: plan does not count 1 bitmap to remove"
rm -f plan-top.qcow2
merge_and_verify valid
grep -q '"bitmaps-removed": 1' merge.out || fail "valid: the merge did not report 1 bitmap removed"

if [ $fails -ne 0 ]; then echo "$fails failures"; exit 1; fi
echo "all bitmap cases pass"
