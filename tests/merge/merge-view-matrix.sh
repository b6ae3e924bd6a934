#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.view_matrix: no merge changes the view of TOP or of a child named with --rebase, for every
# size relation among BELOW (BASE's backing file), BASE, an intermediate layer MID, TOP and the
# children (ROWS: a chain a row, "-": no such layer). A child larger than a TOP shorter than BASE
# reads zeros past TOP's end, and must on BASE too (the merge gives the child zeros where it
# allocates nothing and BASE shows something); a TOP larger than a MID shorter than BASE reads
# zeros past MID's end, which BASE must show after the merge. Every layer has its own data
# pattern, data near its end, zero clusters; TOP has compressed clusters; flags pick qcow2 v2,
# extended L2 or 2 MiB clusters in the children, an internal snapshot in BASE (its view unchanged
# afterwards) or persistent bitmaps in BASE (removed: they would be stale).
# Each row is merged (`qcommit merge TOP [--base BASE] --rebase CHILD... --budget off`); then every
# child's view is unchanged (qemu-img compare) and backed by BASE, BASE shows TOP's old view over
# TOP's size and its own old view beyond, qemu-img check is clean on BASE and the children.
# About 25 s of CPU; 50-80 s of wall time on 2 busy cores.
#
# usage: merge-view-matrix.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
[[ -x $QCOMMIT ]] || { echo "usage: $0 QCOMMIT (an executable qcommit)" >&2; exit 2; }
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.view_matrix

# name            BELOW BASE   MID   TOP     CHILDREN      flags
ROWS=(
  "top-short        -   16M    -     8M      16M           -"
  "top-short-below+ 24M 16M    -     8M      24M,12M       -"
  "top-short-below- 10M 16M    -     8M      16M           -"
  "child-v2         20M 16M    -     8M      16M           child-v2"
  "base-v2          20M 16M    -     8M      16M           base-v2"
  "xl2-unaligned    -   16M    -     8200k   16M           xl2"
  "unaligned        20M 16M    -     8200k   16M,8264k     child-2m"
  "child-smaller    20M 16M    -     12M     4M,12M        -"
  "mid-short        -   16M    6M    16M     16M           -"
  "mid-short-top<   20M 16M    6M    10M     16M           -"
  "mid-short-v2     20M 16M    6M    12M     20M           base-v2,child-v2"
  "base-grows       24M 8M     -     16M     20M           -"
  "base-grows-mid   24M 8M     12M   16M     16M           base-v2"
  "below-short      8M  12M    -     16M     16M           -"
  "equal            16M 16M    16M   16M     16M           -"
  "mid-large        -   8M     16M   12M     16M           -"
  "raw-base         -   16M    -     8M      16M           raw-base"
  "base-snapshot    20M 16M    -     8M      16M           base-snap"
  "base-bitmaps     -   16M    6M    12M     16M,12M       base-bitmap"
)

bytes() { numfmt --from=iec "${1^^}"; }  # of a size as the table writes it (16M, 8200k)
has_flag() { [[ ",$1," == *",$2,"* ]]; }

# Distinct data in qcow2 image $1 (virtual size $2 bytes, pattern $3): its start, the middle, a
# piece across its last cluster boundary, its last 64 KiB, a zero cluster; after more qemu-io
# commands (first: compressed clusters must be written into unallocated ones).
fill_layer() {
  local img=$1 size=$2 p=$3
  shift 3
  local mid=$((size / 2 / 65536 * 65536))
  qio -f qcow2 "$img" "$@" "write -P $p 0 64k" "write -P $((p + 1)) $mid 256k" "write -z $((mid + 512 * 1024)) 128k" \
    "write -P $((p + 2)) $((size - 200000)) 70000" "write -P $((p + 3)) $((size - 65536)) 65536"
}

build_row() {  # below base mid top children flags
  local below=$1 base=$2 mid=$3 top=$4 children=$5 flags=$6 base_opts=(-o compat=1.1) child_opts=() top_opts=()
  has_flag "$flags" base-v2 && base_opts=(-o compat=0.10)
  has_flag "$flags" child-v2 && child_opts=(-o compat=0.10)
  has_flag "$flags" xl2 && top_opts=(-o extended_l2=on) child_opts=(-o extended_l2=on)
  has_flag "$flags" child-2m && child_opts=(-o cluster_size=2M)  # TOP's end inside a child cluster
  if has_flag "$flags" raw-base; then
    new base.raw "$base" -f raw
    qio -f raw base.raw "write -P 40 0 $base"
    BASE=base.raw BFMT=raw
  else
    if [[ $below != - ]]; then
      new below.qcow2 "$below" -f qcow2
      fill_layer below.qcow2 "$(bytes "$below")" 31 "write -P 30 64k $(($(bytes "$below") - 3 * 65536))"
      new base.qcow2 "$base" -f qcow2 -b below.qcow2 -F qcow2 "${base_opts[@]}"
      fill_layer base.qcow2 "$(bytes "$base")" 41
    else
      new base.qcow2 "$base" -f qcow2 "${base_opts[@]}"
      fill_layer base.qcow2 "$(bytes "$base")" 41 "write -P 40 $((2 * 1048576)) 4M"
    fi
    BASE=base.qcow2 BFMT=qcow2
    # An internal snapshot of BASE (its view must survive the merge) and persistent bitmaps (the
    # merge removes them: they would be stale).
    has_flag "$flags" base-snap && qemu-img snapshot -c s0 base.qcow2 &&
      qio -f qcow2 base.qcow2 "write -P 44 1M 192k"
    has_flag "$flags" base-bitmap && qemu-img bitmap --add base.qcow2 b0 &&
      qemu-img bitmap --add base.qcow2 b1
  fi
  local under=$BASE ufmt=$BFMT
  if [[ $mid != - ]]; then
    new mid.qcow2 "$mid" -f qcow2 -b "$under" -F "$ufmt"
    fill_layer mid.qcow2 "$(bytes "$mid")" 51
    under=mid.qcow2 ufmt=qcow2
  fi
  new top.qcow2 "$top" -f qcow2 -b "$under" -F "$ufmt" "${top_opts[@]}"
  local tsize i=0 c csize
  tsize=$(bytes "$top")
  fill_layer top.qcow2 "$tsize" 61 "write -c -P 65 $((1048576)) 64k" \
    "write -c -P 66 $((tsize / 2 / 65536 * 65536 + 1048576)) 64k" "write -P 67 $((3 * 1048576 + 1000)) 3000"
  CHILDREN=()
  for c in ${children//,/ }; do
    i=$((i + 1))
    new "child$i.qcow2" "$c" -f qcow2 -b top.qcow2 -F qcow2 "${child_opts[@]}"
    csize=$(bytes "$c")
    # Data of its own on both sides of TOP's end and near its own end; a zero range past TOP's.
    local past=()
    ((csize > tsize + 3 * 1048576)) &&
      past=("write -P $((90 + i)) $((tsize + 2 * 1048576 + 65536)) 64k" "write -z $((tsize + 2 * 1048576 + 524288)) 64k")
    qio -f qcow2 "child$i.qcow2" "write -P $((70 + i)) 64k 64k" "write -P $((80 + i)) $((csize - 65536)) 64k" "${past[@]}"
    CHILDREN+=("child$i.qcow2")
  done
}

run_row() {
  local name=$1 below=$2 base=$3 mid=$4 top=$5 children=$6 flags=$7
  mkdir "$work/$name" && cd "$work/$name"
  build_row "$below" "$base" "$mid" "$top" "$children" "$flags"
  local c args=() bfmt=$BFMT tsize bsize out
  tsize=$(bytes "$top")
  bsize=$(bytes "$base")
  qemu-img convert -O raw top.qcow2 before-top.raw
  qemu-img convert -f "$bfmt" -O raw "$BASE" before-base.raw
  has_flag "$flags" base-snap && qemu-img convert -f qcow2 -l snapshot.name=s0 -O raw "$BASE" before-snap.raw
  for c in "${CHILDREN[@]}"; do
    qemu-img convert -O raw "$c" "before-$c.raw"
    args+=(--rebase "$c")
  done
  if ! out=$("$QCOMMIT" merge top.qcow2 --base "$BASE" "${args[@]}" --budget off 2>&1); then
    soft_fail "$name: qcommit merge failed: $out"
    return
  fi
  for c in "${CHILDREN[@]}"; do
    qemu-img compare -q -f raw -F qcow2 "before-$c.raw" "$c" 2>/dev/null ||
      soft_fail "$name: $c's view changed (TOP $tsize bytes, BASE $bsize): $(qemu-img compare -f raw -F qcow2 "before-$c.raw" "$c" 2>&1 | head -c 200)"
    [[ "$(qemu-img info --output=json "$c" | jq -r '."full-backing-filename" // empty' | xargs -r realpath)" == "$(realpath "$BASE")" ]] ||
      soft_fail "$name: $c is not backed by BASE"
    qemu-img check -q "$c" >/dev/null 2>&1 || soft_fail "$name: qemu-img check $c not clean"
  done
  # BASE shows TOP's old view over TOP's size and, where it was larger, its own old view beyond.
  cp before-top.raw expect.raw
  ((bsize > tsize)) && tail -c +$((tsize + 1)) before-base.raw >>expect.raw
  qemu-img convert -f "$bfmt" -O raw "$BASE" after-base.raw
  cmp -s expect.raw after-base.raw ||
    soft_fail "$name: BASE does not show TOP's old view then its own: $(cmp expect.raw after-base.raw 2>&1 | head -c 200)"
  [[ $bfmt != qcow2 ]] || qemu-img check -q "$BASE" >/dev/null 2>&1 || soft_fail "$name: qemu-img check BASE not clean"
  if has_flag "$flags" base-snap; then
    qemu-img convert -f qcow2 -l snapshot.name=s0 -O raw "$BASE" after-snap.raw
    cmp -s before-snap.raw after-snap.raw || soft_fail "$name: BASE's internal snapshot s0 changed"
  fi
  ! has_flag "$flags" base-bitmap || [[ $(qemu-img info --output=json "$BASE" | jq '."format-specific".data.bitmaps // [] | length') == 0 ]] ||
    soft_fail "$name: BASE still has persistent bitmaps (stale after the merge)"
  cd "$work" && rm -rf "$name"
}

start=$SECONDS
for row in "${ROWS[@]}"; do
  read -r -a f <<<"$row"
  run_row "${f[@]}"
  cd "$work"
done
echo "merge.view_matrix: ${#ROWS[@]} chains in $((SECONDS - start)) s"
finish
