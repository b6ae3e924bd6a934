#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# qcommit check reports the cluster statistics qemu-img check reports (issue 24): for images built
# with qemu-img/qemu-io (data, compressed and zero writes, discards, 512 B to 2 MiB clusters,
# extended L2, an internal snapshot, a layout written in reverse guest order, a leak at the end of
# the file), `check --output=json` carries qemu-img's total/allocated/fragmented/compressed
# clusters, image-end-offset, check-errors, leaks, corruptions and format, and the text output
# has qemu-img's statistics line ("3/64 = 4.69% allocated, ...") and end offset line.
# usage: check-stats.sh QCOMMIT
set -uo pipefail
qcommit=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/qcommit-check-stats.XXXXXX)
trap 'rm -rf "$work"' EXIT
fails=0 cases=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# image NAME CREATE_OPTS SIZE QEMU_IO_CMDS... : a fresh image written by one qemu-io run.
image() {
  local name=$1 opts=$2 size=$3; shift 3
  local img=$work/$name.qcow2 args=() c
  qemu-img create -q -f qcow2 -o "$opts" "$img" "$size" || { fail "$name: qemu-img create"; return 1; }
  for c in "$@"; do args+=(-c "$c"); done
  if [ ${#args[@]} -gt 0 ]; then
    qemu-io "${args[@]}" "$img" >/dev/null || { fail "$name: qemu-io $*"; return 1; }
  fi
}

# compare NAME : qcommit check and qemu-img check agree on NAME's statistics (JSON and text).
compare() {
  local name=$1 img=$work/$1.qcow2 k
  cases=$((cases + 1))
  local theirs ours
  theirs=$(qemu-img check --output=json "$img" 2>/dev/null)
  ours=$("$qcommit" check --output=json "$img" 2>/dev/null)
  if ! jq -e . >/dev/null <<<"$ours"; then fail "$name: qcommit check --output=json: $ours"; return; fi
  # qemu-img leaves out the counters that are 0.
  for k in total-clusters allocated-clusters fragmented-clusters compressed-clusters \
           image-end-offset check-errors leaks corruptions format; do
    local want got
    want=$(jq -c --arg k "$k" '.[$k] // 0' <<<"$theirs")
    got=$(jq -c --arg k "$k" '.[$k] // 0' <<<"$ours")
    [ "$want" = "$got" ] || fail "$name: $k: qcommit $got, qemu-img $want"
    jq -e --arg k "$k" 'has($k)' >/dev/null <<<"$ours" || fail "$name: no \"$k\" in qcommit's JSON"
  done
  local want_text got_text
  want_text=$(qemu-img check "$img" 2>/dev/null | grep -E 'allocated|Image end offset')
  got_text=$("$qcommit" check "$img" 2>/dev/null | grep -E 'allocated|Image end offset')
  [ "$want_text" = "$got_text" ] ||
    fail "$name: text: qcommit \"$got_text\", qemu-img \"$want_text\""
  echo "  $name: $(jq -c '{"total-clusters","allocated-clusters","fragmented-clusters","compressed-clusters","image-end-offset"}' <<<"$theirs")"
}

# Nothing allocated: qemu-img prints no statistics line.
image empty cluster_size=65536 4M && compare empty
# Plain data, contiguous in guest and host order.
image plain cluster_size=65536 4M 'write -P 0x11 0 128k' 'write -P 0x12 1M 64k' && compare plain
# Compressed clusters (each one fragmented, as qemu-img counts them) among plain ones.
image compressed cluster_size=65536 4M 'write -c -P 0x21 0 64k' 'write -c -P 0x22 64k 64k' \
  'write -P 0x23 128k 192k' 'write -c -P 0x24 2M 128k' && compare compressed
# Zero writes: on unallocated clusters (no allocation), over data without unmap (a zero cluster
# keeping its allocation) and with unmap (allocation dropped).
image zeros cluster_size=65536 4M 'write -P 0x31 0 512k' 'write -z 1M 256k' 'write -z 64k 128k' \
  'write -z -u 256k 128k' && compare zeros
# Discards: freed clusters are neither allocated nor in use.
image discard cluster_size=65536 4M 'write -P 0x41 0 1M' 'discard 128k 256k' 'discard 960k 64k' &&
  compare discard
# 512 B clusters (several L2 tables), compressed and zero writes among data.
image small cluster_size=512 1M 'write -P 0x51 0 64k' 'write -c -P 0x52 128k 4k' \
  'write -z 8k 4k' 'write -P 0x53 512k 1k' 'discard 16k 2k' && compare small
# 2 MiB clusters.
image large cluster_size=2097152 64M 'write -P 0x61 0 3M' 'write -P 0x62 40M 64k' \
  'write -c -P 0x63 10M 2M' 'write -z 32M 2M' && compare large
# Extended L2 entries: subclusters written, zeroed with and without unmap, discarded.
image extl2 cluster_size=65536,extended_l2=on 8M 'write -P 0x71 0 64k' 'write -P 0x72 256k 4k' \
  'write -z 512k 64k' 'write -z 4k 8k' 'write -z -u 1M 64k' 'write -P 0x73 2M 128k' \
  'discard 2M 64k' 'write -c -P 0x74 4M 64k' && compare extl2
image extl2-large cluster_size=2097152,extended_l2=on 32M 'write -P 0x75 0 64k' \
  'write -P 0x76 5M 3M' 'write -z 16M 64k' && compare extl2-large
# An internal snapshot: only the active table's clusters count as allocated, the snapshot's data
# keeps its clusters in use (image-end-offset).
if image snapshot cluster_size=65536 4M 'write -P 0x81 0 512k' 'write -c -P 0x82 1M 64k'; then
  qemu-img snapshot -c snap1 "$work/snapshot.qcow2" || fail "snapshot: qemu-img snapshot -c"
  qemu-io -c 'write -P 0x83 64k 128k' -c 'discard 256k 64k' -c 'write -P 0x84 3M 64k' \
    "$work/snapshot.qcow2" >/dev/null || fail "snapshot: qemu-io after snapshot"
  compare snapshot
fi
# Fragmented: clusters written in reverse guest order, so no neighbours are neighbours on disk.
frag=()
for i in $(seq 15 -1 0); do frag+=("write -P $((0x90 + i)) $((i * 65536)) 64k"); done
image fragmented cluster_size=65536 4M "${frag[@]}" 'write -P 0xa0 2M 256k' && compare fragmented
# Fragmented across L2 tables (512 B clusters: 64 entries a table).
frag=()
for i in $(seq 200 -3 0); do frag+=("write -P 0xb1 $((i * 512)) 512"); done
image fragmented-small cluster_size=512 1M "${frag[@]}" && compare fragmented-small
# A leaked cluster at the end of the file: qemu-img's end offset includes it.
if image leak cluster_size=65536 4M 'write -P 0xc1 0 64k' 'write -P 0xc2 64k 64k'; then
  python3 "$here/../hostile/qcow2_patch.py" "$work/leak.qcow2" l2-entry 1 0 || fail "leak: patch"
  compare leak
fi

echo "$cases images, $fails failures"
[ "$fails" -eq 0 ]
