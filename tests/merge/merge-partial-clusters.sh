#!/usr/bin/env bash
# merge.partial_clusters: a TOP with extended L2 (2 KiB subclusters) whose guest wrote 4 KiB-granular
# pieces inside BASE's 64 KiB clusters, several per cluster (two apart, and one across the cluster's
# end into the next), half over clusters BASE has (written in place), half new to BASE. An
# unthrottled merge writes each new cluster once, whole (BASE's view of it with the pieces laid
# over it), and only the pieces' bytes into clusters BASE has; BASE then shows TOP's view.
# The bytes written into each of BASE's data clusters are counted from the merge's own system
# calls (strace: pwrite64, pwritev, splice and copy_file_range into BASE).
# Exit 77 (skipped) where strace cannot trace here.
#
# usage: merge-partial-clusters.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-partial.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
work=$(pwd -P)

if ! strace -f -o /dev/null true 2>/dev/null; then
  echo "SKIP: strace cannot trace here"
  exit 77
fi

readonly kCluster=65536 kSelected=256
qemu-img create -q -f qcow2 base.qcow2 64M
qemu-io -f qcow2 -c "write -P 1 0 32M" base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k -b base.qcow2 -F qcow2 top.qcow2 64M
# Every 4th of the 1024 clusters in a shuffled order; in cluster c: a piece at 4-12 KiB of 4-16 KiB,
# one at 32-44 KiB of 4-12 KiB, and 8 KiB across the end of c into c+1 (its first 4 KiB).
seq 0 4 1023 | awk 'BEGIN { srand(21) } { print rand(), $1 }' | sort -n | head -n $kSelected |
  awk -v cs=$kCluster '{ c = $2; p = c % 251 + 1
    printf "write -P %d %d %d\n", p, c * cs + 4096 * (1 + c % 3), 4096 * (1 + c % 4)
    printf "write -P %d %d %d\n", p, c * cs + 32768 + 4096 * (c % 4), 4096 * (1 + c % 3)
    printf "write -P %d %d %d\n", p, c * cs + cs - 4096, 8192 }' |
  qemu-io -f qcow2 top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
qemu-img map --output=json -f qcow2 base.qcow2 >base-before.json
qemu-img map --output=json -f qcow2 top.qcow2 >top.json

strace -ff -y -s 0 -e trace=pwrite64,pwritev,pwritev2,splice,copy_file_range -o trace \
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >result.json
qemu-img map --output=json -f qcow2 base.qcow2 >base-after.json

failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || fail "BASE does not show TOP's view"
qemu-img check -q base.qcow2 || fail "qemu-img check: BASE is not clean"

# Per guest cluster TOP provides data in: the bytes written into its host cluster in BASE against
# what it needs (in place: TOP's bytes in it; new: the cluster, once).
python3 - "$work/base.qcow2" "$kCluster" trace.* <<'EOF' || failures=$((failures + 1))
import json, re, sys
base, cs, traces = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def data_runs(path, depth):
    return [(e["start"], e["length"], e.get("offset")) for e in json.load(open(path))
            if e["data"] and e["depth"] == depth]
had = set()
for s, n, _ in data_runs("base-before.json", 0):
    had.update(range(s // cs, (s + n + cs - 1) // cs))
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
calls = 0
for t in traces:
    for line in open(t):
        for p in pats:
            m = p.match(line.strip())
            if not m:
                continue
            calls += 1
            off, n = int(m.group(1)), int(m.group(2))
            while n > 0:
                c = off // cs * cs
                k = min(n, c + cs - off)
                written[c] = written.get(c, 0) + k
                off, n = off + k, n - k
if calls == 0:
    sys.exit("FAIL: no write into BASE found in the trace")
bad = []
for c, n in sorted(need.items()):
    want = n if c in had else cs
    got = written.get(host[c], 0)
    if got != want:
        bad.append("guest cluster %#x (%s): %d bytes written into its host cluster %#x, expected %d"
                   % (c * cs, "in place" if c in had else "new", got, host[c], want))
new = sum(1 for c in need if c not in had)
print("%d clusters with TOP's data (%d new to BASE), %d writes into BASE traced" % (len(need), new, calls))
if bad:
    print("FAIL: %d clusters written other than once:" % len(bad), file=sys.stderr)
    for b in bad[:10]:
        print("  " + b, file=sys.stderr)
    sys.exit(1)
EOF
((failures == 0)) || exit 1
echo "OK"
