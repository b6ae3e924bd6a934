#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# ctest lab.repeat_governed / lab-trixie.repeat_governed: every job governed, every time.
# The same plain `virsh blockcommit --active --pivot` under a running qcommitd, started
# QCOMMIT_LAB_REPEAT times in a row (default 3; the lab row in docs/benchmarks.md runs 20), each a
# fresh lab run: 256 MiB in the overlay, cache=writeback, the host's page cache dropped before the
# merge so the job reads its overlay from the storage (reads unthrottled: a fast NFS mount),
# which lets an unpaced job dirty the whole overlay's worth of BASE within a second
# (scripts/bench-stall --repeat --drop-caches). Judged per run:
#   - governed: QEMU's job shows a speed while it runs ("-" means it never did: the job escaped),
#     and at most kMaxUnpacedMiB had been copied before it did. Bytes, not milliseconds, are the
#     harm a late speed does (what an unpaced job dirties ahead of the guests), and they do not
#     depend on how loaded the machine running the test is: an escaped job or one caught by the
#     0.5 s poll instead of QEMU's job events copies far more (the whole 256 MiB at page-cache
#     speed). kMaxUnpacedMiB is qcommitd's own late-adoption bound (kLateAdoptionBytes: two of
#     QEMU's 16 MiB mirror bursts): at page-cache speed the lab's job copies 6-17 MiB within
#     100-165 ms (2026-12-07), so a bound of one burst failed runs governed within 98 ms;
#   - no stall: the guest's probe max stays under kMaxProbeMs (the users' "under 1 s"; an escaped
#     256 MiB job stalls it ~5 s at the pivot). The latency targets themselves are judged by
#     bench-stall on a quiet host, not here.
# And over the runs: the median time-to-govern (job first seen to speed first seen, each through
# a libvirt answer every ~21 ms under TCG) within the 100 ms target. One run of three may be
# slower on a loaded machine (165 ms in CI, 2026-12-07, 6 MiB copied by then); the 20-run rows in
# docs/benchmarks.md judge every run's 100 ms on a quiet host.
#   repeat_test.sh host|trixie
# trixie: skips (77) unless QCOMMIT_TEST_TRIXIE=1 and the Debian 13 platform is started.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
which=${1:-host}
kMaxMedianGovernMs=100
kMaxUnpacedMiB=32
kMaxProbeMs=1000
runs=${QCOMMIT_LAB_REPEAT:-3}

skip() {
  echo "SKIP repeat_governed ($which): $*"
  exit 77
}
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
if [ "$which" = trixie ]; then
  [ "${QCOMMIT_TEST_TRIXIE:-0}" = 1 ] || skip "QCOMMIT_TEST_TRIXIE is not 1"
  "$src/scripts/trixie-platform" status >/dev/null 2>&1 || skip "the trixie platform is not started"
fi
[ "$(id -u)" -eq 0 ] || fail "the lab needs root"
"$src/scripts/lab-cleanup" >&2
out=$(mktemp -d "${TMPDIR:-/tmp}/qcommit-repeat.XXXXXX")
trap 'rm -rf "$out"' EXIT
"$src/scripts/bench-stall" --platform "$which" --rows qcd-commit --caches writeback --size 256M \
  --baseline 2 --settle 2 --repeat "$runs" --drop-caches --out "$out" >&2 ||
  fail "scripts/bench-stall failed"
cat "$out/table.txt"
n=0 bad=0 govern=()
while read -r label _bp50 _bmax _p50 _p99 max _gap merge_s rc _n _t _p _f1 _f2 _h gov unpaced _start_max _rest_max; do
  n=$((n + 1))
  if [ "$rc" != 0 ]; then
    echo "FAIL: $label: the merge failed (rc $rc)" >&2; bad=1; continue
  fi
  if [ "$gov" = - ]; then
    echo "FAIL: $label: QEMU's job never had a speed while it ran (it escaped)" >&2; bad=1
  else
    govern+=("$gov")
    awk -v u="$unpaced" -v m="$kMaxUnpacedMiB" 'BEGIN {exit !(u <= m)}' ||
      { echo "FAIL: $label: $unpaced MiB copied before QEMU's job had a speed (> $kMaxUnpacedMiB MiB; govern_ms $gov)" >&2; bad=1; }
  fi
  awk -v x="$max" -v m="$kMaxProbeMs" 'BEGIN {exit !(x < m)}' ||
    { echo "FAIL: $label: the guest's probe waited $max ms (>= $kMaxProbeMs ms) during the $merge_s s merge" >&2; bad=1; }
done <"$out/results.txt"
[ "$n" = "$runs" ] || fail "$n runs recorded, $runs wanted"
median=-
if ((${#govern[@]})); then
  median=$(printf '%s\n' "${govern[@]}" | sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}')
  awk -v g="$median" -v m="$kMaxMedianGovernMs" 'BEGIN {exit !(g <= m)}' ||
    { echo "FAIL: median time-to-govern $median ms over ${#govern[@]} runs (> $kMaxMedianGovernMs ms; runs: ${govern[*]})" >&2; bad=1; }
fi
[ "$bad" = 0 ] || exit 1
echo "PASS repeat_governed ($which): $runs runs, each governed with at most $kMaxUnpacedMiB MiB copied before, median time-to-govern $median ms (runs: ${govern[*]}), probe max under $kMaxProbeMs ms ($SECONDS s)"
