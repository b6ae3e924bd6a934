#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.check_stats: qcommit check reports the cluster statistics qemu-img check reports (issue 24):
# for images built with qemu-img/qemu-io (data, compressed and zero writes, discards, 512 B to
# 2 MiB clusters, extended L2, an internal snapshot, a layout written in reverse guest order, a
# leak at the end of the file), `check --output=json` carries qemu-img's total/allocated/
# fragmented/compressed clusters, image-end-offset, check-errors, leaks, corruptions and format,
# and the text output has qemu-img's statistics line ("3/64 = 4.69% allocated, ...") and end
# offset line.
# usage: check-stats.sh QCOMMIT
set -uo pipefail  # no -e: every failure is soft, and qemu-img check exits 3 on a leak
. "$(dirname "$0")/lib.sh"
qcommit=$(realpath "$1")
PATCH=$(realpath "$(dirname "$0")/../hostile/qcow2_patch.py")
setup cli.check_stats
cases=0

# build NAME CREATE_OPTS SIZE QEMU_IO_CMD...: a fresh image NAME.qcow2 written by one qemu-io run.
build() {
  local name=$1 opts=$2 size=$3
  shift 3
  qemu-img create -q -f qcow2 -o "$opts" "$name.qcow2" "$size" || { soft_fail "$name: qemu-img create"; return 1; }
  (($# == 0)) || qio -f qcow2 "$name.qcow2" "$@" || { soft_fail "$name: qemu-io $*"; return 1; }
}

# agree NAME CREATE_OPTS SIZE QEMU_IO_CMD...: build, then compare.
agree() { build "$@" && compare "$1"; }
# compare NAME: qcommit check and qemu-img check agree on NAME's statistics (JSON and text).
compare() {
  local name=$1 img=$1.qcow2 k theirs ours want got
  cases=$((cases + 1))
  theirs=$(qemu-img check --output=json "$img" 2>/dev/null)
  ours=$("$qcommit" check --output=json "$img" 2>/dev/null)
  jq -e . >/dev/null <<<"$ours" || { soft_fail "$name: qcommit check --output=json: $ours"; return; }
  # qemu-img leaves out the counters that are 0.
  for k in total-clusters allocated-clusters fragmented-clusters compressed-clusters \
           image-end-offset check-errors leaks corruptions format; do
    want=$(jq -c --arg k "$k" '.[$k] // 0' <<<"$theirs")
    got=$(jq -c --arg k "$k" '.[$k] // 0' <<<"$ours")
    [[ $want == "$got" ]] || soft_fail "$name: $k: qcommit $got, qemu-img $want"
    jq -e --arg k "$k" 'has($k)' >/dev/null <<<"$ours" || soft_fail "$name: no \"$k\" in qcommit's JSON"
  done
  want=$(qemu-img check "$img" 2>/dev/null | grep -E 'allocated|Image end offset')
  got=$("$qcommit" check "$img" 2>/dev/null | grep -E 'allocated|Image end offset')
  [[ $want == "$got" ]] || soft_fail "$name: text: qcommit \"$got\", qemu-img \"$want\""
  echo "  $name: $(jq -c '{"total-clusters","allocated-clusters","fragmented-clusters","compressed-clusters","image-end-offset"}' <<<"$theirs")"
}

# Nothing allocated: qemu-img prints no statistics line.
agree empty cluster_size=65536 4M
# Plain data, contiguous in guest and host order.
agree plain cluster_size=65536 4M 'write -P 0x11 0 128k' 'write -P 0x12 1M 64k'
# Compressed clusters (each one fragmented, as qemu-img counts them) among plain ones.
agree compressed cluster_size=65536 4M 'write -c -P 0x21 0 64k' 'write -c -P 0x22 64k 64k' \
  'write -P 0x23 128k 192k' 'write -c -P 0x24 2M 128k'
# Zero writes: on unallocated clusters (no allocation), over data without unmap (a zero cluster
# keeping its allocation) and with unmap (allocation dropped).
agree zeros cluster_size=65536 4M 'write -P 0x31 0 512k' 'write -z 1M 256k' 'write -z 64k 128k' \
  'write -z -u 256k 128k'
# Discards: freed clusters are neither allocated nor in use.
agree discard cluster_size=65536 4M 'write -P 0x41 0 1M' 'discard 128k 256k' 'discard 960k 64k'
# 512 B clusters (several L2 tables), compressed and zero writes among data.
agree small cluster_size=512 1M 'write -P 0x51 0 64k' 'write -c -P 0x52 128k 4k' \
  'write -z 8k 4k' 'write -P 0x53 512k 1k' 'discard 16k 2k'
# 2 MiB clusters.
agree large cluster_size=2097152 64M 'write -P 0x61 0 3M' 'write -P 0x62 40M 64k' \
  'write -c -P 0x63 10M 2M' 'write -z 32M 2M'
# Extended L2 entries: subclusters written, zeroed with and without unmap, discarded.
agree extl2 cluster_size=65536,extended_l2=on 8M 'write -P 0x71 0 64k' 'write -P 0x72 256k 4k' \
  'write -z 512k 64k' 'write -z 4k 8k' 'write -z -u 1M 64k' 'write -P 0x73 2M 128k' \
  'discard 2M 64k' 'write -c -P 0x74 4M 64k'
agree extl2-large cluster_size=2097152,extended_l2=on 32M 'write -P 0x75 0 64k' 'write -P 0x76 5M 3M' \
  'write -z 16M 64k'
# An internal snapshot: only the active table's clusters count as allocated, the snapshot's data
# keeps its clusters in use (image-end-offset).
if build snapshot cluster_size=65536 4M 'write -P 0x81 0 512k' 'write -c -P 0x82 1M 64k'; then
  qemu-img snapshot -c snap1 snapshot.qcow2 || soft_fail "snapshot: qemu-img snapshot -c"
  qio -f qcow2 snapshot.qcow2 'write -P 0x83 64k 128k' 'discard 256k 64k' 'write -P 0x84 3M 64k' ||
    soft_fail "snapshot: qemu-io after snapshot"
  compare snapshot
fi
# Fragmented: clusters written in reverse guest order, so no neighbours are neighbours on disk.
frag=(); for i in $(seq 15 -1 0); do frag+=("write -P $((0x90 + i)) $((i * 65536)) 64k"); done
agree fragmented cluster_size=65536 4M "${frag[@]}" 'write -P 0xa0 2M 256k'
# Fragmented across L2 tables (512 B clusters: 64 entries a table).
frag=(); for i in $(seq 200 -3 0); do frag+=("write -P 0xb1 $((i * 512)) 512"); done
agree fragmented-small cluster_size=512 1M "${frag[@]}"
# A leaked cluster at the end of the file: qemu-img's end offset includes it.
if build leak cluster_size=65536 4M 'write -P 0xc1 0 64k' 'write -P 0xc2 64k 64k'; then
  python3 "$PATCH" leak.qcow2 l2-entry 1 0 || soft_fail "leak: patch"
  compare leak
fi

echo "$cases images"
finish
