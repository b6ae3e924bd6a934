#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Hostile images through `qcommit info`, `map`, `check` and `merge` (issue 7).
# Every refusal must be exactly one line on stderr naming the offending file, exit 1 or 3 (never a
# signal, never a timeout); check exits 2 for corruption (as qemu-img check); a refused merge writes nothing (sha256 of
# every file involved, before and after). Images are built with qemu-img/qemu-io and patched
# byte-wise with qcow2_patch.py.
# usage: hostile-images.sh QCOMMIT
set -uo pipefail
qcommit=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
patch() { python3 "$here/qcow2_patch.py" "$@"; }
work=$(mktemp -d /tmp/qcommit-hostile.XXXXXX)
trap 'rm -rf "$work"' EXIT
fails=0 checks=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect CASE CMD NAME_IN_ERROR ALLOWED_RCS -- ARGS... : runs qcommit ARGS in the case directory.
expect() {
  local case=$1 cmd=$2 name=$3 allowed=$4; shift 5
  local out=$work/$case.$cmd.out err=$work/$case.$cmd.err rc=0
  (cd "$work/$case" && timeout 60 "$qcommit" "$cmd" "$@" >"$out" 2>"$err") || rc=$?
  checks=$((checks + 1))
  local lines; lines=$(wc -l <"$err")
  if [ $rc -ge 124 ]; then fail "$case: qcommit $cmd $* died (exit $rc): $(head -c 2000 "$err")"; return; fi
  if [[ " $allowed " != *" $rc "* ]]; then
    fail "$case: qcommit $cmd $* exited $rc, expected one of ($allowed): $(head -3 "$err")"; return
  fi
  if [ $rc -ne 0 ] && [ "$cmd" != check ]; then
    [ "$lines" -eq 1 ] || fail "$case: qcommit $cmd: $lines lines on stderr, expected one: $(head -3 "$err")"
    grep -qF -- "$name" "$err" || fail "$case: qcommit $cmd: error does not name $name: $(cat "$err")"
    grep -qiE 'sanitizer|runtime error|terminate called' "$err" && fail "$case: qcommit $cmd: $(cat "$err")"
  fi
  if [ $rc -ne 0 ]; then echo "  $case/$cmd: exit $rc: $(tail -1 "$err")"; else echo "  $case/$cmd: exit 0"; fi
}

sums() { local f; for f in "$@"; do sha256sum "$f" 2>/dev/null || echo "missing $f"; done; }

# merge_refused CASE TOP NAME FILES... : merge exits 1 or 3 and none of FILES changes.
merge_refused() {
  local case=$1 top=$2 name=$3; shift 3
  local before after
  before=$(cd "$work/$case" && sums "$@")
  expect "$case" merge "$name" "1 3" -- "$top" --budget off
  after=$(cd "$work/$case" && sums "$@")
  [ "$before" = "$after" ] || fail "$case: merge changed files: $(diff <(echo "$before") <(echo "$after"))"
  # A merge that fails during the copy keeps its checkpoint (a rerun resumes); BASE is unchanged.
  if ls -A "$work/$case" | grep -q 'qcommit-merge'; then echo "  $case/merge: checkpoint kept"; fi
}

# all_refused CASE TOP NAME CHECK_RCS FILES... : info, map and merge refused.
all_refused() {
  local case=$1 top=$2 name=$3 check_rcs=$4; shift 4
  expect "$case" info "$name" "1 3" -- "$top"
  expect "$case" map "$name" "1 3" -- "$top"
  expect "$case" check "$name" "$check_rcs" -- "$top"
  merge_refused "$case" "$top" "$name" "$@"
}

# merge_only_refused CASE TOP NAME CHECK_RCS FILES... : metadata that the reader cannot tell
# from valid without a full check (overlaps). info and map report what is on disk, like
# qemu-img info/map (exit 0, no crash); check finds it (CHECK_RCS); merge runs the check on the
# layers it merges and refuses.
merge_only_refused() {
  local case=$1 top=$2 name=$3 check_rcs=$4; shift 4
  expect "$case" info "$name" "0" -- "$top"
  expect "$case" map "$name" "0" -- "$top"
  expect "$case" check "$name" "$check_rcs" -- "$top"
  merge_refused "$case" "$top" "$name" "$@"
}

new_case() { mkdir -p "$work/$1"; cd "$work/$1"; }
mkbase() { qemu-img create -q -f qcow2 "$@" base.qcow2 4M && qemu-io -f qcow2 -c 'write -P 0x11 0 1M' base.qcow2 >/dev/null; }
mktop() { qemu-img create -q -f qcow2 "$@" -b base.qcow2 -F qcow2 top.qcow2 4M; }

echo "backing file names"
# 1. Backing names outside the image's directory tree, json: and protocol names. check looks at
#    one image and follows no backing file: it passes (0) and must not open the backing file.
new_case shadow; qemu-img create -q -f qcow2 -u -b /etc/shadow -F raw top.qcow2 4M
all_refused shadow top.qcow2 top.qcow2 0 top.qcow2 /etc/shadow
new_case dotdot/a/b; mkbase; cp base.qcow2 ../../x; rm base.qcow2
qemu-img create -q -f qcow2 -u -b ../../x -F qcow2 top.qcow2 4M
all_refused dotdot/a/b top.qcow2 top.qcow2 0 top.qcow2 ../../x
new_case json; qemu-img create -q -f qcow2 -u -b 'json:{"file":{"driver":"file","filename":"/etc/passwd"}}' -F raw top.qcow2 4M
all_refused json top.qcow2 top.qcow2 0 top.qcow2 /etc/passwd
new_case nbd; qemu-img create -q -f qcow2 -u -b 'nbd://127.0.0.1:10809/x' -F raw top.qcow2 4M
all_refused nbd top.qcow2 top.qcow2 0 top.qcow2
# 2. A symlinked backing file, swapped to /etc/passwd between two runs.
new_case symlink; mkbase; mv base.qcow2 real.qcow2; ln -s real.qcow2 base.qcow2; mktop
qemu-io -f qcow2 -c 'write -P 0x22 0 64k' top.qcow2 >/dev/null
expect symlink info top.qcow2 0 -- top.qcow2
expect symlink map top.qcow2 0 -- top.qcow2
ln -sfn /etc/passwd base.qcow2
all_refused symlink top.qcow2 top.qcow2 0 top.qcow2 real.qcow2 /etc/passwd
# 3. A backing file that is a FIFO (inside the tree, and outside it): opening it must not wait
#    for a writer (it hung before), it is refused as not a regular file.
new_case fifo; mkfifo pipe; mkfifo ../outside-pipe
qemu-img create -q -f qcow2 -u -b pipe -F raw top.qcow2 4M
qemu-img create -q -f qcow2 -u -b ../outside-pipe -F raw top2.qcow2 4M
all_refused fifo top.qcow2 pipe 0 top.qcow2
all_refused fifo top2.qcow2 outside-pipe 0 top2.qcow2

echo "metadata"
# Layers for the metadata cases: BASE (valid) and TOP with data in its first clusters.
meta_case() {  # meta_case NAME QEMU_IMG_OPTS...
  new_case "$1"; shift; mkbase; mktop "$@"
  qemu-io -f qcow2 -c 'write -P 0x33 0 256k' -c 'write -P 0x44 1M 64k' top.qcow2 >/dev/null
}
# 3. An L2 entry pointing into the refcount table.
meta_case l2-into-reftable; patch top.qcow2 l2-entry 0 refcount-table
merge_only_refused l2-into-reftable top.qcow2 top.qcow2 2 top.qcow2 base.qcow2
# 4. Two L2 entries sharing one cluster (16-bit refcounts: refcount 1, two references).
meta_case shared-cluster; patch top.qcow2 l2-entry 1 copy:0
merge_only_refused shared-cluster top.qcow2 top.qcow2 2 top.qcow2 base.qcow2
# 5. Refcount overflow: 1-bit refcounts cannot count the second reference to a shared cluster.
meta_case refcount-overflow -o refcount_bits=1; patch top.qcow2 l2-entry 2 copy:0
merge_only_refused refcount-overflow top.qcow2 top.qcow2 2 top.qcow2 base.qcow2
# 6. An L1 entry pointing at the L1 table itself (the L1 table read as an L2 table).
meta_case l2-loop; patch top.qcow2 l1-entry 0 l1-table
merge_only_refused l2-loop top.qcow2 top.qcow2 2 top.qcow2 base.qcow2
# 7. An L2 table offset beyond the end of the file.
meta_case l2-beyond-eof; patch top.qcow2 l1-entry 0 eof
all_refused l2-beyond-eof top.qcow2 top.qcow2 2 top.qcow2 base.qcow2

# 8. BASE with a data cluster in use whose refcount is 0: its allocator would hand the cluster
#    out again for TOP's data (two guest offsets on one host cluster), so the merge is refused.
new_case base-refcount-zero
qemu-img create -q -f qcow2 base.qcow2 4M
qemu-io -f qcow2 -c 'write -P 0xaa 0 64k' base.qcow2 >/dev/null
patch base.qcow2 refcount-of 0 0
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M
qemu-io -f qcow2 -c 'write -P 0x11 1M 64k' top.qcow2 >/dev/null
merge_refused base-refcount-zero top.qcow2 base.qcow2 top.qcow2 base.qcow2

# 8b. BASE cut short after its tables were written: an L2 entry and its refcount name a data
#     cluster past the end of the file. check counts the reference as qemu-img check does; the
#     merge is refused (its allocator, extending the file, would have placed TOP's data on that
#     very cluster: guest offset 128k would then show TOP's bytes from 2M). Found by
#     fuzz_merge_chain.
new_case base-cut-short
qemu-img create -q -f qcow2 base.qcow2 4M
qemu-io -f qcow2 -c 'write -P 0xaa 0 192k' base.qcow2 >/dev/null
truncate -s -64k base.qcow2
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M
qemu-io -f qcow2 -c 'write -P 0x11 2M 64k' top.qcow2 >/dev/null
expect base-cut-short check base.qcow2 2 -- base.qcow2
ours=$(grep -E 'errors? (were )?found' "$work/base-cut-short.check.out")
theirs=$(qemu-img check base.qcow2 2>/dev/null | grep -E 'errors? (were )?found')
[ -n "$theirs" ] && [ "$ours" = "$theirs" ] || fail "base-cut-short: check says '$ours', qemu-img check '$theirs'"
merge_refused base-cut-short top.qcow2 base.qcow2 top.qcow2 base.qcow2

echo "header"
# 9. header_length beyond the end of a short file (the extension area's size wrapped: the error
#    was std::length_error's text, naming no file). Found by fuzz_chain.
new_case short-header; mkbase; mktop -o cluster_size=524288
python3 - <<'PY'
import struct
d = bytearray(open('top.qcow2', 'rb').read()[:2882])
d[100:104] = struct.pack('>I', 16384)
open('top.qcow2', 'wb').write(d)
PY
all_refused short-header top.qcow2 top.qcow2 "1 2" top.qcow2 base.qcow2

echo "compressed clusters"
# 8. A compressed cluster whose stream inflates to two clusters (zlib, zstd).
for c in zlib zstd; do
  new_case overlong-$c; mkbase -o cluster_size=4096; mktop -o cluster_size=4096,compression_type=$c
  qemu-io -f qcow2 -c 'write -c -P 0x55 0 4k' top.qcow2 >/dev/null
  patch top.qcow2 overlong-compressed 0 $c
  # Metadata is valid, so check passes (0); reading the cluster fails, so merge refuses.
  merge_only_refused overlong-$c top.qcow2 top.qcow2 0 top.qcow2 base.qcow2
done

echo "hostile-images: $checks commands, $fails failures"
[ $fails -eq 0 ]
