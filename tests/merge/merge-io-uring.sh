#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.io_uring_batches: an unthrottled merge (`--budget off`) writes its requests under 64 KiB
# in batches through io_uring from mappings of the layers, with the result of the threads' path
# (`--no-io-uring`). Chain: BASE (256 MiB of data in 1 GiB) under MID (96 MiB of scattered whole
# 64 KiB clusters, a quarter over BASE's data) under TOP (extended L2: 4-60 KiB, 4 KiB-granular
# pieces in 6144 other scattered clusters and over every 4th of MID's, about 115 MiB): the pieces
# go through io_uring, MID's clusters (64 KiB and longer runs) through the splice threads.
# Checked for both paths: the result names the path and the requests through io_uring (batched:
# at least half the 6144 pieces, as guest-adjacent new clusters join into one request, which goes
# to the threads from 64 KiB on; --no-io-uring: none); BASE shows TOP's view, qemu-img check is
# clean, BASE's page cache holds no more than its metadata (the data went O_DIRECT). The batched
# path's peak RSS is at most 40 MiB above the threads' (the pieces' mapped pages are unmapped
# every 16 MiB of the copy; else 109 MiB above; relative, so it holds for a sanitizer build too).
# The human-readable result line counts the requests through io_uring, and is silent about
# io_uring where none went.
# Exit 77 (skipped) where BASE's filesystem refuses O_DIRECT or this kernel offers no io_uring.
#
# usage: merge-io-uring.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
for tool in qemu-img qemu-io jq fincore /usr/bin/time python3; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found"; exit 77; }
done
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.io_uring_batches

readonly kCluster=65536 kMidClusters=1536 kPieces=6144 kMetadataLimit=$((4 << 20))
readonly kRssAboveThreadsKiB=$((40 * 1024))

layers 1G base.qcow2="write -P 1 0 256M" mid.qcow2
new top.qcow2 1G -f qcow2 -o extended_l2=on,cluster_size=64k -b mid.qcow2 -F qcow2
# 16384 guest clusters shuffled: the first kMidClusters whole into MID, the next kPieces as one
# piece each into TOP, and every 4th of MID's clusters gets a piece in TOP too.
seq 0 16383 | awk 'BEGIN { srand(7) } { print rand(), $1 }' | sort -n | awk '{ print $2 }' >order
head -n $kMidClusters order | awk -v cs=$kCluster '{ printf "write -P %d %d %d\n", $1 % 251 + 1, $1 * cs, cs }' |
  qemu-io -f qcow2 mid.qcow2 >/dev/null
{
  sed -n "$((kMidClusters + 1)),$((kMidClusters + kPieces))p" order
  head -n $kMidClusters order | awk 'NR % 4 == 0'
} | awk -v cs=$kCluster '{ b = $1 % 15; n = int($1 / 15) % (15 - b) + 1
    printf "write -P %d %d %d\n", ($1 + 100) % 251 + 1, $1 * cs + b * 4096, n * 4096 }' |
  qemu-io -f qcow2 top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
mkdir pristine && cp -a --sparse=always base.qcow2 mid.qcow2 top.qcow2 pristine/

# merge_once LABEL [OPTION]: a fresh copy of the chain merged; sets path (true/false), writes
# (requests through io_uring), rss_kib.
merge_once() {
  local label=$1 before cached direct
  shift
  rm -f base.qcow2 mid.qcow2 top.qcow2
  cp -a --sparse=always pristine/*.qcow2 .
  drop_cache base.qcow2
  before=$(cached_bytes base.qcow2)
  /usr/bin/time -f %M -o "rss-$label" "$QCOMMIT" merge top.qcow2 --base base.qcow2 --budget off "$@" --output=json >"result-$label.json"
  cached=$(cached_bytes base.qcow2)
  read -r direct path writes < <(jq -r 'select(.event == "result") | "\(."direct-io") \(."io-uring") \(."io-uring-writes")"' "result-$label.json") || true
  [[ $direct == true ]] || { echo "SKIP: O_DIRECT is not available under $work"; exit 77; }
  rss_kib=$(tail -1 "rss-$label")
  qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || soft_fail "$label: BASE does not show TOP's view"
  qemu-img check -q base.qcow2 || soft_fail "$label: qemu-img check: BASE is not clean"
  ((cached - before <= kMetadataLimit)) ||
    soft_fail "$label: BASE has $((cached - before)) more bytes in the page cache after the merge (at most $kMetadataLimit of metadata expected)"
  echo "$label: io-uring $path ($writes requests), peak RSS $rss_kib KiB, page cache of BASE $before -> $cached bytes"
}

merge_once batched
[[ $path != false ]] ||
  { echo "SKIP: io_uring cannot be set up here (kernel, kernel.io_uring_disabled or a seccomp filter)"; exit 77; }
[[ $path == true ]] || soft_fail "the result does not say whether io_uring was used (\"io-uring\": $path)"
[[ $writes =~ ^[0-9]+$ ]] && ((writes >= kPieces / 2)) ||
  soft_fail "batched: $writes requests through io_uring, expected at least $((kPieces / 2))"
batched_rss_kib=$rss_kib

merge_once threads --no-io-uring
[[ $path == false && $writes == 0 ]] ||
  soft_fail "--no-io-uring: the result says \"io-uring\": $path, $writes requests"
((batched_rss_kib <= rss_kib + kRssAboveThreadsKiB)) ||
  soft_fail "batched: peak RSS $batched_rss_kib KiB, more than $kRssAboveThreadsKiB KiB above the threads' $rss_kib KiB: mapped source pages were not released"

# The human-readable result names the requests that went through io_uring, and only when some did:
# a small chain whose TOP has kSmallPieces whole clusters (every request 64 KiB), then one whose
# TOP has kSmallPieces single 4 KiB pieces in place over BASE's data, 3 clusters apart (no two
# join: kSmallPieces batched requests, fewer only if some write came back short).
readonly kSmallPieces=32 kSmallStride=3
# human_line TOP_OPTIONS PIECE_BYTES: merges such a chain, prints its result line (empty if none).
human_line() {
  rm -f small-base.qcow2 small-top.qcow2
  new small-base.qcow2 64M -f qcow2
  qio small-base.qcow2 "write -P 1 0 64M"
  new small-top.qcow2 64M -f qcow2 $1 -b small-base.qcow2 -F qcow2
  seq 0 $((kSmallPieces - 1)) | awk -v cs=$kCluster -v st=$kSmallStride -v n="$2" \
    '{ printf "write -P %d %d %d\n", $1 % 250 + 2, $1 * st * cs, n }' |
    qemu-io -f qcow2 small-top.qcow2 >/dev/null
  "$QCOMMIT" merge small-top.qcow2 --base small-base.qcow2 --budget off | grep '^merged ' || true
}
line=$(human_line "" $kCluster)
[[ $line == *" 2.0 MiB copied"* ]] || # kSmallPieces whole clusters
  soft_fail "whole clusters only: the merge did not copy them, or printed no result line: '$line'"
[[ $line != *"through io_uring"* ]] || soft_fail "whole clusters only: the result line speaks of io_uring: $line"
line=$(human_line "-o extended_l2=on,cluster_size=64k" 4096)
if [[ $line =~ \;\ ([0-9]+)\ requests?\ under\ 64\ KiB\ O_DIRECT\ in\ batches\ through\ io_uring\) ]]; then
  ((BASH_REMATCH[1] >= kSmallPieces / 2 && BASH_REMATCH[1] <= kSmallPieces)) ||
    soft_fail "$kSmallPieces pieces of 4 KiB: the result line counts ${BASH_REMATCH[1]} batched requests"
else
  soft_fail "$kSmallPieces pieces of 4 KiB: the result line does not name them as batched: '$line'"
fi
finish OK
