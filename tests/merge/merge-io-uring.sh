#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.io_uring_batches: an unthrottled merge (`--budget off`) writes its requests under 64 KiB
# in batches through io_uring from mappings of the layers, and the result is the same as the
# threads' path (`--no-io-uring`).
# Chain: BASE (256 MiB of data in 1 GiB) under MID (scattered whole 64 KiB clusters, 96 MiB, a
# quarter over BASE's data) under TOP (extended L2: 4-60 KiB, 4 KiB-granular pieces in 6144 other
# scattered clusters and over every 4th of MID's: about 115 MiB). The pieces go through io_uring,
# MID's clusters (64 KiB and longer runs) through the splice threads.
# Checked for both paths: the result says which path ran and how many requests went through
# io_uring (on the batched path at least half the 6144 pieces: guest-adjacent new clusters join
# into one request, which goes to the threads from 64 KiB on; none with --no-io-uring); BASE shows
# TOP's view; qemu-img check is clean; BASE's page cache holds no more than its metadata
# afterwards (the data went O_DIRECT). The batched path's peak RSS is at most 40 MiB above the
# threads' (the mapped pages of the pieces are unmapped as the copy goes, every 16 MiB; without
# that it was 109 MiB above). Relative, so that it holds for a sanitizer build too. The
# human-readable result line counts the requests that went through io_uring, and is silent about
# io_uring where none did.
# Exit 77 (skipped) where BASE's filesystem refuses O_DIRECT or this kernel offers no io_uring.
#
# usage: merge-io-uring.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
for tool in qemu-img qemu-io jq fincore /usr/bin/time python3; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found"; exit 77; }
done
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-io-uring.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

readonly kCluster=65536 kMidClusters=1536 kPieces=6144 kMetadataLimit=$((4 << 20))
readonly kRssAboveThreadsKiB=$((40 * 1024))
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

qemu-img create -q -f qcow2 base.qcow2 1G
qemu-io -f qcow2 -c "write -P 1 0 256M" base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 mid.qcow2 1G
qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k -b mid.qcow2 -F qcow2 top.qcow2 1G
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
  local label=$1
  shift
  rm -f base.qcow2 mid.qcow2 top.qcow2
  cp -a --sparse=always pristine/*.qcow2 .
  sync
  python3 -c 'import os, sys; os.posix_fadvise(os.open(sys.argv[1], os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)' base.qcow2
  local before cached
  before=$(fincore --bytes --noheadings --output RES base.qcow2)
  /usr/bin/time -f %M -o "rss-$label" "$QCOMMIT" merge top.qcow2 --base base.qcow2 --budget off "$@" --output=json >"result-$label.json"
  cached=$(fincore --bytes --noheadings --output RES base.qcow2)
  if [[ $(jq -r 'select(.event == "result") | ."direct-io"' "result-$label.json") != true ]]; then
    echo "SKIP: O_DIRECT is not available under $work"
    exit 77
  fi
  path=$(jq -r 'select(.event == "result") | ."io-uring"' "result-$label.json")
  writes=$(jq -r 'select(.event == "result") | ."io-uring-writes"' "result-$label.json")
  rss_kib=$(tail -1 "rss-$label")
  qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || fail "$label: BASE does not show TOP's view"
  qemu-img check -q base.qcow2 || fail "$label: qemu-img check: BASE is not clean"
  ((cached - before <= kMetadataLimit)) ||
    fail "$label: BASE has $((cached - before)) more bytes in the page cache after the merge (at most $kMetadataLimit of metadata expected)"
  echo "$label: io-uring $path ($writes requests), peak RSS $rss_kib KiB, page cache of BASE $before -> $cached bytes"
}

merge_once batched
case $path in
  true) ;;
  false)
    echo "SKIP: io_uring cannot be set up here (kernel, kernel.io_uring_disabled or a seccomp filter)"
    exit 77
    ;;
  *) fail "the result does not say whether io_uring was used (\"io-uring\": $path)" ;;
esac
[[ $writes =~ ^[0-9]+$ ]] && ((writes >= kPieces / 2)) ||
  fail "batched: $writes requests through io_uring, expected at least $((kPieces / 2))"
batched_rss_kib=$rss_kib

merge_once threads --no-io-uring
[[ $path == false && $writes == 0 ]] ||
  fail "--no-io-uring: the result says \"io-uring\": $path, $writes requests"
((batched_rss_kib <= rss_kib + kRssAboveThreadsKiB)) ||
  fail "batched: peak RSS $batched_rss_kib KiB, more than $kRssAboveThreadsKiB KiB above the threads' $rss_kib KiB: mapped source pages were not released"

# The human-readable result names the requests that went through io_uring, and only when some did:
# a small chain whose TOP has kSmallPieces whole clusters (every request 64 KiB), then one whose
# TOP has kSmallPieces single 4 KiB pieces in place over BASE's data, 3 clusters apart (no two
# join: kSmallPieces batched requests, fewer only if some write came back short).
readonly kSmallPieces=32 kSmallStride=3
# human_line TOP_OPTIONS PIECE_BYTES: merges such a chain, prints its result line (empty if none).
human_line() {
  rm -f small-base.qcow2 small-top.qcow2
  qemu-img create -q -f qcow2 small-base.qcow2 64M
  qemu-io -f qcow2 -c "write -P 1 0 64M" small-base.qcow2 >/dev/null
  qemu-img create -q -f qcow2 $1 -b small-base.qcow2 -F qcow2 small-top.qcow2 64M
  seq 0 $((kSmallPieces - 1)) | awk -v cs=$kCluster -v st=$kSmallStride -v n="$2" \
    '{ printf "write -P %d %d %d\n", $1 % 250 + 2, $1 * st * cs, n }' |
    qemu-io -f qcow2 small-top.qcow2 >/dev/null
  "$QCOMMIT" merge small-top.qcow2 --base small-base.qcow2 --budget off | grep '^merged ' || true
}
line=$(human_line "" $kCluster)
[[ $line == *" 2.0 MiB copied"* ]] || # kSmallPieces whole clusters
  fail "whole clusters only: the merge did not copy them, or printed no result line: '$line'"
[[ $line != *"through io_uring"* ]] || fail "whole clusters only: the result line speaks of io_uring: $line"
line=$(human_line "-o extended_l2=on,cluster_size=64k" 4096)
if [[ $line =~ \;\ ([0-9]+)\ requests?\ under\ 64\ KiB\ O_DIRECT\ in\ batches\ through\ io_uring\) ]]; then
  ((BASH_REMATCH[1] >= kSmallPieces / 2 && BASH_REMATCH[1] <= kSmallPieces)) ||
    fail "$kSmallPieces pieces of 4 KiB: the result line counts ${BASH_REMATCH[1]} batched requests"
else
  fail "$kSmallPieces pieces of 4 KiB: the result line does not name them as batched: '$line'"
fi

((failures == 0)) || exit 1
echo "OK"
