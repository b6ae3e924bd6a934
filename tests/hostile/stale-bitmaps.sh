#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Persistent bitmaps in BASE, valid and stale (issue 17). A program without bitmap support clears
# the autoclear bitmaps bit when it writes an image; the bitmaps extension it leaves describes
# nothing (QEMU's docs/interop/qcow2.txt). qcommit must treat it as QEMU does: `check` counts its
# clusters as leaks (the same count as qemu-img check), `check --repair` frees them, and a merge
# neither frees nor follows them, even once they hold other data. Valid bitmaps are removed by the
# merge. Every case ends with BASE showing TOP's original view and a clean qemu-img check.
# usage: stale-bitmaps.sh QCOMMIT
set -euo pipefail
qcommit=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib/test.sh"
setup hostile.stale_bitmaps
patch() { python3 "$here/qcow2_patch.py" "$@"; }
kBitmapsExt=0x23852875

# of EXPR CMD...: the Python expression EXPR of the JSON document `j` that CMD prints ("?" if
# none; CMD's exit status does not count).
of() {
  local e=$1
  shift
  { "$@" 2>/dev/null || true; } | python3 -c 'import json,sys; j = json.load(sys.stdin); print(eval(sys.argv[1]))' "$e" 2>/dev/null || echo '?'
}
# Leaked clusters as qemu-img check and qcommit check count them.
qemu_leaks() { of 'j.get("leaks", 0)' qemu-img check --output=json "$1"; }
qcommit_leaks() { of 'j.get("leaks", 0)' "$qcommit" check --output=json "$1"; }
# Persistent bitmaps as qemu-img info and qcommit info (and plan) count them.
qemu_bitmaps() { of 'len(j.get("format-specific", {}).get("data", {}).get("bitmaps", []))' qemu-img info --output=json "$1"; }
qcommit_bitmaps() { of 'j["chain"][0].get("bitmaps", 0)' "$qcommit" info --output=json "$1"; }
# plan_bitmaps CASE [WANT]: the plan of a merge into BASE counts WANT bitmaps to remove (default:
# as many as qemu-img info lists).
plan_bitmaps() {
  local want=${2:-$(qemu_bitmaps base.qcow2)} pb
  new plan-top.qcow2 64M -f qcow2 -b base.qcow2 -F qcow2
  pb=$(of 'j["bitmaps-to-remove"]' "$qcommit" plan --output=json plan-top.qcow2 --budget off)
  [ "$pb" = "$want" ] || soft_fail "$1: plan counts $pb bitmaps to remove, expected $want (qemu-img info $(qemu_bitmaps base.qcow2))"
  rm -f plan-top.qcow2
}
has_bitmaps_ext() { patch "$1" extensions | grep -qix "$kBitmapsExt"; }

# new_case CASE: a directory of its own with BASE (64 MiB, data in [0, 4M) and [8M, 12M)) with
# bitmap b0, dirty over [8M, 12M): the bitmap owns a directory, a table and a data cluster.
new_case() {
  echo "$2"
  mkdir "$work/$1" && cd "$work/$1"
  new base.qcow2 64M -f qcow2 && qio base.qcow2 'write -P 0x11 0 4M' && qemu-img bitmap --add base.qcow2 b0 &&
    qio base.qcow2 'write -P 0x22 8M 4M' || soft_fail "$1: cannot make BASE"
}

# merge_and_verify CASE : TOP over BASE, merged; BASE must end as TOP's original view, clean.
merge_and_verify() {
  local case=$1 out
  new top.qcow2 64M -f qcow2 -b base.qcow2 -F qcow2 && qio top.qcow2 'write -P 0x44 2M 8M' 'write -z 40M 1M' ||
    { soft_fail "$case: cannot make TOP"; return; }
  qemu-img convert -O raw top.qcow2 top-view.raw
  timeout 120 "$qcommit" merge "$PWD/top.qcow2" --budget off --output=json >merge.out 2>merge.err ||
    { soft_fail "$case: merge exited $?: $(tail -2 merge.err)"; return; }
  echo "  $case: merge: $(grep -o '"bitmaps-removed": [0-9]*' merge.out | tail -1)"
  qemu-img compare -q -f raw -F qcow2 top-view.raw base.qcow2 || soft_fail "$case: BASE does not show TOP's original view"
  out=$(qemu-img check base.qcow2 2>&1) || soft_fail "$case: qemu-img check of BASE after the merge: $out"
  out=$("$qcommit" check base.qcow2 2>&1) || soft_fail "$case: qcommit check of BASE after the merge: $out"
  ! has_bitmaps_ext base.qcow2 || soft_fail "$case: BASE still has a bitmaps extension after the merge"
  [ "$(qemu_bitmaps base.qcow2)" = 0 ] || soft_fail "$case: qemu-img info lists bitmaps after the merge"
}

new_case stale "stale: autoclear bit cleared, check --repair=leaks, then merge"
patch base.qcow2 autoclear 0
ql=$(qemu_leaks base.qcow2) cl=$(qcommit_leaks base.qcow2)
echo "  stale: leaks: qemu-img $ql, qcommit $cl"
[ "$ql" -ge 3 ] 2>/dev/null || soft_fail "stale: qemu-img check finds $ql leaks, expected the bitmap's 3 clusters"
[ "$ql" = "$cl" ] || soft_fail "stale: qemu-img check counts $ql leaked clusters, qcommit check $cl"
qb=$(qemu_bitmaps base.qcow2) cb=$(qcommit_bitmaps base.qcow2)
[ "$qb" = 0 ] && [ "$cb" = 0 ] || soft_fail "stale: bitmaps counted by qemu-img info $qb, qcommit info $cb (expected 0)"
"$qcommit" check --repair=leaks base.qcow2 >repair.out 2>&1 || soft_fail "stale: check --repair=leaks exited $?: $(cat repair.out)"
! has_bitmaps_ext base.qcow2 || soft_fail "stale: check --repair left the stale bitmaps extension in the header"
out=$(qemu-img check base.qcow2 2>&1) || soft_fail "stale: qemu-img check after qcommit check --repair: $out"
[ "$(qemu_leaks base.qcow2)" = 0 ] || soft_fail "stale: leaks left after qcommit check --repair"
plan_bitmaps stale
merge_and_verify stale

new_case reused "stale-reused: the stale extension's clusters hold other data when the merge starts"
patch base.qcow2 autoclear 0
dd if=base.qcow2 of=header.bin bs=64k count=1 status=none
qemu-img check -q -r leaks base.qcow2 >/dev/null 2>&1 || true
# QEMU freed the bitmap's clusters and dropped the extension; new data takes the freed clusters
# (one cluster per write: each takes the lowest free cluster).
reuse="16 17 18 19 20 21"
for i in $reuse; do qio base.qcow2 "write -P 0x33 ${i}M 64k"; done
# The header as it was (stale extension back): still a valid image, the extension describes nothing.
dd if=header.bin of=base.qcow2 bs=64k count=1 conv=notrunc status=none
has_bitmaps_ext base.qcow2 || soft_fail "reused: the stale extension is not back"
out=$(qemu-img check base.qcow2 2>&1) || soft_fail "reused: qemu-img check of the prepared BASE: $out"
cl=$(qcommit_leaks base.qcow2)
[ "$cl" = 0 ] || soft_fail "reused: qcommit check finds $cl leaks where qemu-img check finds none"
plan_bitmaps reused
merge_and_verify reused
for i in $reuse; do
  qemu-io -f qcow2 -c "read -P 0x33 ${i}M 64k" base.qcow2 | grep -q 'read 65536' ||
    soft_fail "reused: the data written at ${i}M (into the freed clusters) changed"
done

new_case valid "valid: bitmaps removed by the merge"
[ "$(qemu_bitmaps base.qcow2)" = 1 ] && [ "$(qcommit_bitmaps base.qcow2)" = 1 ] ||
  soft_fail "valid: bitmaps counted by qemu-img info $(qemu_bitmaps base.qcow2), qcommit info $(qcommit_bitmaps base.qcow2) (expected 1)"
out=$("$qcommit" check base.qcow2 2>&1) || soft_fail "valid: qcommit check of BASE with bitmaps: $out"
plan_bitmaps valid 1
merge_and_verify valid
grep -q '"bitmaps-removed": 1' merge.out || soft_fail "valid: the merge did not report 1 bitmap removed"
finish "all bitmap cases pass"
