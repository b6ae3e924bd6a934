#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.appended_guest_order: the clusters a merge appends to BASE are laid out in guest order,
# so that a later sequential read of BASE is sequential on disk (as after `qemu-img commit`),
# whatever order the guest wrote them in. MID: scattered 64 KiB clusters written in a shuffled
# order, half over clusters BASE has (written in place), half new to BASE; TOP above it adds more
# new clusters, so the new clusters of one window come from two files. Both an unthrottled and a
# budgeted merge. Checked with `qemu-img map`: the clusters new to BASE, walked in guest order,
# never step back in BASE's file; BASE shows TOP's view and `qemu-img check` finds it clean.
#
# usage: merge-appended-order.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.appended_guest_order

readonly kCluster=65536 kSizeMiB=256 kBaseData=$((128 << 20))
layers ${kSizeMiB}M base.qcow2="write -P 1 0 128M" mid.qcow2 top.qcow2
# shuffled SEED FIRST STEP COUNT: qemu-io writes of COUNT clusters FIRST, FIRST+STEP, ... in a
# shuffled order (the layer's own clusters are allocated in that order).
shuffled() {
  seq "$2" "$3" $((kSizeMiB * 1024 * 1024 / kCluster - 1)) | awk -v s="$1" 'BEGIN { srand(s) } { print rand(), $1 }' |
    sort -n | awk -v n="$4" -v cs=$kCluster 'NR <= n { printf "write -P %d %d %d\n", $2 % 251 + 1, $2 * cs, cs }'
}
shuffled 21 0 8 512 | qemu-io -f qcow2 mid.qcow2 >/dev/null
shuffled 22 4 8 256 | qemu-io -f qcow2 top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
# What the merge adds to BASE: the layers' data past BASE's 128 MiB (BASE has none there).
expected=$(qemu-img map --output=json top.qcow2 |
  jq --argjson from $kBaseData '[.[] | select(.data and .depth < 2 and .start >= $from) | .length] | add')
mkdir pristine && cp -a --sparse=always ./*.qcow2 pristine/

# check LABEL: BASE's new clusters in guest order never step back in BASE's file.
check() {
  local label=$1 stats
  qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || soft_fail "$label: BASE does not show TOP's view"
  qemu-img check -q base.qcow2 || soft_fail "$label: qemu-img check: BASE is not clean"
  stats=$(qemu-img map --output=json base.qcow2 | jq -r --argjson from $kBaseData '
    [.[] | select(.data and .start + .length > $from)
     | (if .start < $from then $from - .start else 0 end) as $cut
     | {start: (.start + $cut), length: (.length - $cut), offset: (.offset + $cut)}] as $new
    | [range(1; $new | length) | select($new[.].offset < $new[. - 1].offset)] as $back
    | "\($new | map(.length) | add // 0) \($back | length)"')
  read -r appended steps_back <<<"$stats"
  [[ $appended == "$expected" ]] || soft_fail "$label: BASE got $appended bytes of new clusters, expected $expected"
  [[ $steps_back == 0 ]] || soft_fail "$label: BASE's new clusters step back $steps_back times in guest order"
  echo "$label: $appended bytes in new clusters, steps back in guest order: $steps_back"
}

for budget in off 20ms; do
  cp -a --sparse=always pristine/*.qcow2 .
  "$QCOMMIT" merge top.qcow2 --base base.qcow2 --budget $budget >/dev/null
  check "budget $budget"
done
finish OK
