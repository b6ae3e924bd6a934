#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.partial_clusters: a TOP with extended L2 (2 KiB subclusters) whose guest wrote 4 KiB-granular
# pieces inside BASE's 64 KiB clusters, several per cluster (two apart, and one across the cluster's
# end into the next). An unthrottled merge writes each of BASE's clusters once: only the pieces'
# bytes into clusters BASE has; into a cluster new to BASE, only the pieces where BASE's view of it
# reads as zeros and its new host cluster lies past the end of BASE's file as the merge found it
# (space that reads as zeros: fallocated or a hole); else the whole cluster (BASE's view with the
# pieces laid over it). BASE then shows TOP's view. The bytes written into each of BASE's data
# clusters are counted from the merge's own system calls (strace); writes handed to io_uring are
# none, so the merge runs with --no-io-uring: the requests are the same on both paths, only how
# they are issued differs (merge.io_uring_batches checks that path's result).
# Four chains (at the end). Runtime: about 5 s. Exit 77 (skipped) where strace cannot trace here.
#
# usage: merge-partial-clusters.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.partial_clusters
work=$(pwd -P)  # as strace -y names BASE
strace -f -o /dev/null true 2>/dev/null || { echo "SKIP: strace cannot trace here"; exit 77; }
readonly kCluster=65536

# The guest's writes into cluster c (one number per line on stdin): a piece at 4-12 KiB of 4-16 KiB,
# one at 32-44 KiB of 4-12 KiB, and 8 KiB across the end of c into c+1 (its first 4 KiB).
pieces() {
  awk -v cs=$kCluster '{ c = $1; p = c % 251 + 1
    printf "write -P %d %.0f %d\n", p, c * cs + 4096 * (1 + c % 3), 4096 * (1 + c % 4)
    printf "write -P %d %.0f %d\n", p, c * cs + 32768 + 4096 * (c % 4), 4096 * (1 + c % 3)
    printf "write -P %d %.0f %d\n", p, c * cs + cs - 4096, 8192 }'
}

# BASE of SIZE with its first 32 MiB written (the default), and its variants.
plain_base() { layers "$1" base.qcow2="write -P 1 0 32M"; }
# 8 MiB of its data freed inside the file, the old bytes left there.
reused_base() {
  plain_base "$1"
  qemu-io --image-opts "driver=qcow2,file.filename=base.qcow2,pass-discard-request=off" \
    -c "discard 8M 8M" >/dev/null
}
# On a backing file of its own with data (0x7e) at 40-48 MiB.
backing_base() { layers "$1" below.qcow2="write -P 0x7e 40M 8M" base.qcow2="write -P 1 0 32M"; }
base_setup=plain_base

# check_chain NAME SIZE MIN_WINDOWS MIN_PIECES MIN_REUSED MIN_OVER_BACKING [MAX_CACHED]: merges
# NAME/top.qcow2 (clusters from stdin) into NAME/base.qcow2 (SIZE, made by $base_setup) under
# strace and checks the bytes written per cluster; at least MIN_PIECES new clusters must have got
# their pieces only, MIN_REUSED clusters placed inside BASE's old file and MIN_OVER_BACKING over
# BASE's backing file's data must have been written whole (else the chain does not test what it is
# for), and the merge must leave at most MAX_CACHED bytes of BASE in the page cache. Not in a
# pipeline: it records failures in this shell.
check_chain() {
  local name=$1 size=$2 min_windows=$3 min_pieces=$4 min_reused=$5 min_backing=$6 max_cached=${7:-}
  mkdir "$name"
  (
    cd "$name"
    "$base_setup" "$size"
    stat -c %s base.qcow2 >base-size-before
    new top.qcow2 "$size" -f qcow2 -o extended_l2=on,cluster_size=64k -b base.qcow2 -F qcow2
    pieces | qemu-io -f qcow2 top.qcow2 >/dev/null
    qemu-img convert -O raw top.qcow2 view.raw
    qemu-img map --output=json -f qcow2 base.qcow2 >base-before.json
    qemu-img map --output=json -f qcow2 top.qcow2 >top.json
    drop_cache base.qcow2
    cached_bytes base.qcow2 >cached-before
    strace -ff -y -s 0 -e trace=pwrite64,pwritev,pwritev2,splice,copy_file_range,rename,renameat,renameat2 \
      -o trace "$QCOMMIT" merge top.qcow2 --budget off --no-io-uring --output=json >result.json
    cached_bytes base.qcow2 >cached-after
    qemu-img map --output=json -f qcow2 base.qcow2 >base-after.json
  )
  if [[ -n $max_cached && $(jq -r 'select(.event == "result") | ."direct-io"' "$name/result.json") == true ]]; then
    local cached=$(($(cat "$name/cached-after") - $(cat "$name/cached-before")))
    ((cached <= max_cached)) ||
      soft_fail "$name: BASE has $cached more bytes in the page cache after the merge (at most $max_cached of metadata expected): pieces in place went through the page cache"
  fi
  qemu-img compare -f raw -F qcow2 "$name/view.raw" "$name/base.qcow2" >/dev/null || soft_fail "$name: BASE does not show TOP's view"
  qemu-img check -q "$name/base.qcow2" || soft_fail "$name: qemu-img check: BASE is not clean"

  # Per guest cluster TOP provides data in: the bytes written into its host cluster in BASE against
  # what it needs (in place: TOP's bytes in it; new: the cluster, once).
  (cd "$name" && python3 - "$work/$name/base.qcow2" "$kCluster" "$min_windows" "$name" \
    "$min_pieces" "$min_reused" "$min_backing" trace.*) <<'EOF' 2>"$name.err" || soft_fail "$(cat "$name.err")"
import json, re, sys
base, cs, min_windows, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
min_pieces, min_reused, min_backing = (int(a) for a in sys.argv[5:8])
traces = sys.argv[8:]
def data_runs(path, depth):
    return [(e["start"], e["length"], e.get("offset")) for e in json.load(open(path))
            if e["data"] and (e["depth"] == depth if depth is not None else e["depth"] > 0)]
def clusters(runs):
    return {c for s, n, _ in runs for c in range(s // cs, (s + n + cs - 1) // cs)}
had = clusters(data_runs("base-before.json", 0))
below = clusters(data_runs("base-before.json", None))  # where BASE's backing file shows data
old_end = (int(open("base-size-before").read()) + cs - 1) // cs * cs  # BASE's file, cluster-rounded
need = {}  # guest cluster -> TOP's data bytes in it
for s, n, _ in data_runs("top.json", 0):
    for c in range(s // cs, (s + n + cs - 1) // cs):
        need[c] = need.get(c, 0) + min(s + n, (c + 1) * cs) - max(s, c * cs)
host = {}  # guest cluster -> host cluster in BASE after the merge
for s, n, off in data_runs("base-after.json", 0):
    for c in range(s // cs, (s + n) // cs):
        host[c] = off + (c * cs - s)
written = {}  # host cluster offset -> bytes written into it
fd = r"\d+<" + re.escape(base) + r">"
pats = [re.compile(r"^pwrite64\(" + fd + r", .*, (\d+)\) = (\d+)$"),
        re.compile(r"^pwritev2?\(" + fd + r", .*, \d+, (\d+)(?:, \w+)?\) = (\d+)$"),
        re.compile(r"^splice\([^,]+, [^,]+, " + fd + r", \[(\d+)[^\]]*\], \d+, \w+\) = (\d+)$"),
        re.compile(r"^copy_file_range\([^,]+, [^,]+, " + fd + r", \[(\d+)[^\]]*\], \d+, \w+\) = (\d+)$")]
checkpoint = re.compile(r'^rename(?:at2?)?\(.*\.qcommit-merge\.tmp", .*\) = 0$')
calls = checkpoints = 0
for t in traces:
    for line in open(t):
        line = line.strip()
        if checkpoint.match(line):
            checkpoints += 1
            continue
        for m in filter(None, (p.match(line) for p in pats)):
            calls += 1
            off, n = int(m.group(1)), int(m.group(2))
            while n > 0:
                c = off // cs * cs
                k = min(n, c + cs - off)
                written[c] = written.get(c, 0) + k
                off, n = off + k, n - k
if calls == 0:
    sys.exit("%s: no write into BASE found in the trace" % name)
windows = checkpoints - 1  # one checkpoint before the copy, one per committed window
bad = []
kinds = {"in place": 0, "new, pieces only": 0, "new, reused space": 0, "new, over backing data": 0}
for c, n in sorted(need.items()):
    # Pieces only where the bytes around them read as zeros without being written: in place, or
    # a new cluster with nothing under it in BASE's chain and space past BASE's old file end.
    kind = ("in place" if c in had else "new, over backing data" if c in below
            else "new, reused space" if host[c] < old_end else "new, pieces only")
    kinds[kind] += 1
    want = n if kind in ("in place", "new, pieces only") else cs
    got = written.get(host[c], 0)
    if got != want:
        bad.append("guest cluster %#x (%s): %d bytes written into its host cluster %#x, expected %d"
                   % (c * cs, kind, got, host[c], want))
print("%s: %d clusters with TOP's data (%s), %d writes into BASE traced, %d windows"
      % (name, len(need), ", ".join("%s %d" % kv for kv in kinds.items()), calls, windows))
fails = ["%d windows committed, expected at least %d" % (windows, min_windows)] if windows < min_windows else []
fails += ["%d clusters %s, expected at least %d" % (kinds[kind], kind, least)
          for kind, least in (("new, pieces only", min_pieces), ("new, reused space", min_reused),
                              ("new, over backing data", min_backing)) if kinds[kind] < least]
if bad:
    fails.append("%d clusters written other than once:\n  %s" % (len(bad), "\n  ".join(bad[:10])))
for f in fails:
    print("%s: %s" % (name, f), file=sys.stderr)
sys.exit(1 if fails else 0)
EOF
  rm -rf "$name"
}

# scattered: 256 clusters of a 64 MiB disk (every 4th of the 1024 in a shuffled order), half over
# clusters BASE has (0..511: written in place), half new to BASE (pieces only). The pieces are
# 4 KiB-aligned: they are written O_DIRECT however small (kAuto), so after the merge BASE has no
# more in the page cache than its metadata (fincore; not checked where O_DIRECT is unavailable).
scattered() { seq 0 4 1023 | awk 'BEGIN { srand(21) } { print rand(), $1 }' | sort -n | head -n 256 | cut -d' ' -f2; }
check_chain scattered 64M 1 100 0 0 $((1 << 20)) < <(scattered)
# window-split: one cluster in each 512 MiB that one L2 table of BASE maps (at a different place
# in each), over a 136 GiB disk (272 tables; the first cluster in BASE's data, the rest new). A
# window ends when it has touched kMaxDirtyMetadataBytes of L2 tables (8 MiB: 128 tables of
# 64 KiB), right after the first piece in the next table, and that piece ends inside its cluster
# while the cluster's other pieces follow: a window boundary there splits the cluster's pieces.
# Each cluster is still written once; the merge must commit more than one window (counted from its
# checkpoint renames), or the chain no longer tests what it is for.
check_chain window-split 136G 2 200 0 0 < <(seq 0 271 | awk '{ print ($1 == 0) ? 5 : $1 * 8192 + ($1 * 37) % 8000 }')
# reused: the scattered clusters over BASE's 8 MiB of freed clusters (8-16 MiB, 128 clusters) that
# still hold old data (discarded without passing the discard to the file): new clusters take that
# space first and must be written whole there, or the old bytes would show around the pieces.
base_setup=reused_base check_chain reused 64M 1 20 60 0 < <(scattered)
# backing: the scattered clusters over a BASE whose backing file has data at 40-48 MiB (under
# about 32 of them): there BASE's view is not zeros and the cluster is written whole; elsewhere
# pieces only.
base_setup=backing_base check_chain backing 64M 1 60 0 10 < <(scattered)
finish OK
