#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Hostile images through `qcommit info`, `map`, `check` and `merge` (issue 7).
# Every refusal must be exactly one line on stderr naming the offending file, exit 1 or 3 (never a
# signal, never a timeout); check exits 2 for corruption (as qemu-img check); a refused merge
# writes nothing (sha256 of every file involved, before and after). Images are built with
# qemu-img/qemu-io and patched byte-wise with qcow2_patch.py.
# usage: hostile-images.sh QCOMMIT
set -euo pipefail
qcommit=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib/test.sh"
setup hostile.images
patch() { python3 "$here/qcow2_patch.py" "$@"; }
checks=0

# expect CASE CMD NAME_IN_ERROR ALLOWED_RCS -- ARGS... : runs qcommit ARGS in the case directory.
expect() {
  local case=$1 cmd=$2 name=$3 allowed=$4; shift 5
  local out=$work/$case.$cmd.out err=$work/$case.$cmd.err rc=0 lines
  (cd "$work/$case" && timeout 60 "$qcommit" "$cmd" "$@" >"$out" 2>"$err") || rc=$?
  checks=$((checks + 1))
  lines=$(wc -l <"$err")
  [ $rc -lt 124 ] || { soft_fail "$case: qcommit $cmd $* died (exit $rc): $(head -c 2000 "$err")"; return; }
  [[ " $allowed " == *" $rc "* ]] ||
    { soft_fail "$case: qcommit $cmd $* exited $rc, expected one of ($allowed): $(head -3 "$err")"; return; }
  if [ $rc -ne 0 ] && [ "$cmd" != check ]; then
    [ "$lines" -eq 1 ] || soft_fail "$case: qcommit $cmd: $lines lines on stderr, expected one: $(head -3 "$err")"
    grep -qF -- "$name" "$err" || soft_fail "$case: qcommit $cmd: error does not name $name: $(cat "$err")"
    ! grep -qiE 'sanitizer|runtime error|terminate called' "$err" || soft_fail "$case: qcommit $cmd: $(cat "$err")"
  fi
  if [ $rc -ne 0 ]; then echo "  $case/$cmd: exit $rc: $(tail -1 "$err")"; else echo "  $case/$cmd: exit 0"; fi
}

sums() { local f; for f in "$@"; do sha256sum "$f" 2>/dev/null || echo "missing $f"; done; }

# merge_refused CASE TOP NAME FILES... : merge exits 1 or 3 and none of FILES changes.
merge_refused() {
  local case=$1 top=$2 name=$3 before after; shift 3
  before=$(cd "$work/$case" && sums "$@")
  expect "$case" merge "$name" "1 3" -- "$top" --budget off
  after=$(cd "$work/$case" && sums "$@")
  [ "$before" = "$after" ] || soft_fail "$case: merge changed files: $(diff <(echo "$before") <(echo "$after"))"
  # A merge that fails during the copy keeps its checkpoint (a rerun resumes); BASE is unchanged.
  if ls -A "$work/$case" | grep -q 'qcommit-merge'; then echo "  $case/merge: checkpoint kept"; fi
}

# refused CASE INFO_MAP_RCS TOP NAME CHECK_RCS FILES... : info and map exit INFO_MAP_RCS, check
# CHECK_RCS, merge is refused. INFO_MAP_RCS is "1 3" (refused), or "0" for metadata that the
# reader cannot tell from valid without a full check (overlaps): info and map report what is on
# disk, like qemu-img info/map (exit 0, no crash), check finds it, and merge, which runs the check
# on the layers it merges, refuses.
refused() {
  local case=$1 rcs=$2 top=$3 name=$4 check_rcs=$5; shift 5
  expect "$case" info "$name" "$rcs" -- "$top"
  expect "$case" map "$name" "$rcs" -- "$top"
  expect "$case" check "$name" "$check_rcs" -- "$top"
  merge_refused "$case" "$top" "$name" "$@"
}

new_case() { mkdir -p "$work/$1"; cd "$work/$1"; }
mkbase() { new base.qcow2 4M -f qcow2 "$@" && qio base.qcow2 'write -P 0x11 0 1M'; }
mktop() { new top.qcow2 4M -f qcow2 "$@" -b base.qcow2 -F qcow2; }

echo "backing file names"
# 1. Backing names outside the image's directory tree, json: and protocol names. check looks at
#    one image and follows no backing file: it passes (0) and must not open the backing file.
new_case shadow; qemu-img create -q -f qcow2 -u -b /etc/shadow -F raw top.qcow2 4M
refused shadow "1 3" top.qcow2 top.qcow2 0 top.qcow2 /etc/shadow
new_case dotdot/a/b; mkbase; cp base.qcow2 ../../x; rm base.qcow2
qemu-img create -q -f qcow2 -u -b ../../x -F qcow2 top.qcow2 4M
refused dotdot/a/b "1 3" top.qcow2 top.qcow2 0 top.qcow2 ../../x
new_case json; qemu-img create -q -f qcow2 -u -b 'json:{"file":{"driver":"file","filename":"/etc/passwd"}}' -F raw top.qcow2 4M
refused json "1 3" top.qcow2 top.qcow2 0 top.qcow2 /etc/passwd
new_case nbd; qemu-img create -q -f qcow2 -u -b 'nbd://127.0.0.1:10809/x' -F raw top.qcow2 4M
refused nbd "1 3" top.qcow2 top.qcow2 0 top.qcow2
# 2. A symlinked backing file, swapped to /etc/passwd between two runs.
new_case symlink; mkbase; mv base.qcow2 real.qcow2; ln -s real.qcow2 base.qcow2; mktop
qio top.qcow2 'write -P 0x22 0 64k'
expect symlink info top.qcow2 0 -- top.qcow2
expect symlink map top.qcow2 0 -- top.qcow2
ln -sfn /etc/passwd base.qcow2
refused symlink "1 3" top.qcow2 top.qcow2 0 top.qcow2 real.qcow2 /etc/passwd
# 3. A backing file that is a FIFO (inside the tree, and outside it): opening it must not wait
#    for a writer, it is refused as not a regular file.
new_case fifo; mkfifo pipe; mkfifo ../outside-pipe
qemu-img create -q -f qcow2 -u -b pipe -F raw top.qcow2 4M
qemu-img create -q -f qcow2 -u -b ../outside-pipe -F raw top2.qcow2 4M
refused fifo "1 3" top.qcow2 pipe 0 top.qcow2
refused fifo "1 3" top2.qcow2 outside-pipe 0 top2.qcow2

echo "metadata"
# meta_case NAME INFO_MAP_RCS PATCH_ARGS [QEMU_IMG_OPTS]: BASE (valid) and TOP (with data in its
# first clusters; created with QEMU_IMG_OPTS) patched with PATCH_ARGS, then refused (check: 2).
meta_case() {
  new_case "$1"; mkbase; mktop ${4:+-o "$4"}
  qio top.qcow2 'write -P 0x33 0 256k' 'write -P 0x44 1M 64k'
  # shellcheck disable=SC2086 # PATCH_ARGS: words
  patch top.qcow2 $3
  refused "$1" "$2" top.qcow2 top.qcow2 2 top.qcow2 base.qcow2
}
# 3. An L2 entry pointing into the refcount table.
meta_case l2-into-reftable 0 "l2-entry 0 refcount-table"
# 4. Two L2 entries sharing one cluster (16-bit refcounts: refcount 1, two references).
meta_case shared-cluster 0 "l2-entry 1 copy:0"
# 5. Refcount overflow: 1-bit refcounts cannot count the second reference to a shared cluster.
meta_case refcount-overflow 0 "l2-entry 2 copy:0" refcount_bits=1
# 6. An L1 entry pointing at the L1 table itself (the L1 table read as an L2 table).
meta_case l2-loop 0 "l1-entry 0 l1-table"
# 7. An L2 table offset beyond the end of the file.
meta_case l2-beyond-eof "1 3" "l1-entry 0 eof"

# 8. BASE with a data cluster in use whose refcount is 0: its allocator would hand the cluster
#    out again for TOP's data (two guest offsets on one host cluster), so the merge is refused.
new_case base-refcount-zero
new base.qcow2 4M -f qcow2
qio base.qcow2 'write -P 0xaa 0 64k'
patch base.qcow2 refcount-of 0 0
mktop
qio top.qcow2 'write -P 0x11 1M 64k'
merge_refused base-refcount-zero top.qcow2 base.qcow2 top.qcow2 base.qcow2

# 8b. BASE cut short after its tables were written: an L2 entry and its refcount name a data
#     cluster past the end of the file. check counts the reference as qemu-img check does; the
#     merge is refused (its allocator, extending the file, would have placed TOP's data on that
#     very cluster: guest offset 128k would then show TOP's bytes from 2M).
new_case base-cut-short
new base.qcow2 4M -f qcow2
qio base.qcow2 'write -P 0xaa 0 192k'
truncate -s -64k base.qcow2
mktop
qio top.qcow2 'write -P 0x11 2M 64k'
expect base-cut-short check base.qcow2 2 -- base.qcow2
ours=$(grep -E 'errors? (were )?found' "$work/base-cut-short.check.out" || true)
theirs=$(qemu-img check base.qcow2 2>/dev/null | grep -E 'errors? (were )?found' || true)
[ -n "$theirs" ] && [ "$ours" = "$theirs" ] || soft_fail "base-cut-short: check says '$ours', qemu-img check '$theirs'"
merge_refused base-cut-short top.qcow2 base.qcow2 top.qcow2 base.qcow2

echo "header"
# 9. header_length beyond the end of a short file (the extension area's size wraps): still one
#    line naming the file.
new_case short-header; mkbase; mktop -o cluster_size=524288
python3 - <<'PY'
import struct
d = bytearray(open('top.qcow2', 'rb').read()[:2882])
d[100:104] = struct.pack('>I', 16384)
open('top.qcow2', 'wb').write(d)
PY
refused short-header "1 3" top.qcow2 top.qcow2 "1 2" top.qcow2 base.qcow2

echo "compressed clusters"
# 8. A compressed cluster whose stream inflates to two clusters (zlib, zstd).
for c in zlib zstd; do
  new_case overlong-$c; mkbase -o cluster_size=4096; mktop -o cluster_size=4096,compression_type=$c
  qio top.qcow2 'write -c -P 0x55 0 4k'
  patch top.qcow2 overlong-compressed 0 $c
  # Metadata is valid, so check passes (0); reading the cluster fails, so merge refuses.
  refused overlong-$c 0 top.qcow2 top.qcow2 0 top.qcow2 base.qcow2
done

finish "hostile-images: $checks commands, no failures"
