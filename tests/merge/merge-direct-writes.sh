#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.direct_writes: an unthrottled merge (`--budget off`) of a TOP made of scattered 64 KiB
# clusters, half over clusters BASE has (written in place), half new to BASE (appended), writes
# them O_DIRECT, not through the page cache: afterwards no more of BASE is in the page cache than
# its metadata (the tables the writer reads and writes), and BASE shows TOP's view.
# Through the page cache each byte is copied once more in the kernel and the writers queue on
# BASE's inode lock (docs/benchmarks.md, offline merge speed).
# Exit 77 (skipped) where BASE's filesystem refuses O_DIRECT.
#
# usage: merge-direct-writes.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.direct_writes

readonly kCluster=65536 kClusters=512 kMetadataLimit=$((2 << 20))
layers 256M base.qcow2="write -P 1 0 128M" top.qcow2
# Every 8th cluster of the 4096, in a shuffled order (TOP's clusters are allocated in that order).
seq 0 8 $((256 * 1024 * 1024 / kCluster - 1)) | awk 'BEGIN { srand(21) } { print rand(), $1 }' | sort -n |
  head -n $kClusters | awk -v cs=$kCluster '{ printf "write -P %d %d %d\n", $2 % 251 + 1, $2 * cs, cs }' |
  qemu-io -f qcow2 top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw

drop_cache base.qcow2
before=$(cached_bytes base.qcow2)
"$QCOMMIT" merge top.qcow2 --budget off --output=json >result.json
[[ $(jq -r 'select(.event == "result") | ."direct-io"' result.json) == true ]] ||
  { echo "SKIP: O_DIRECT is not available under $work"; exit 77; }
cached=$(cached_bytes base.qcow2)
copied=$(jq -r 'select(.event == "result") | .copied' result.json)

[[ $copied == $((kClusters * kCluster)) ]] || soft_fail "copied $copied bytes, expected $((kClusters * kCluster))"
((cached - before <= kMetadataLimit)) ||
  soft_fail "BASE has $((cached - before)) more bytes in the page cache after the merge (at most $kMetadataLimit of metadata expected): data went through the page cache"
qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || soft_fail "BASE does not show TOP's view"
qemu-img check -q base.qcow2 || soft_fail "qemu-img check: BASE is not clean"
echo "page cache of BASE: $before bytes before, $cached after; copied $copied"
finish OK
