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
#     100-165 ms (2026-12-07), so a bound of one burst failed runs governed within 98 ms.
#     qcommitd's record is judged against it (a "late adoption": past 32 MiB when it read its
#     first speed back). The watcher counts the bytes at its own first sight of the speed, later
#     than QEMU took it: on a loaded machine (three busy loops at nice -10 beside the lab,
#     2026-12-07, tests/lab/results/repeat-governed-loaded-host-2026-12-07-debian13.txt) it first
#     saw the job 1.0-1.2 s after `virsh blockcommit` and counted up to 32 MiB where qcommitd
#     read its first speed back 5.7-32.8 ms after the job's creation, so
#     its count gets kMaxWatcherUnpacedMiB, one more of QEMU's bursts -- still far below what
#     an escaped job or one caught by the poll copies;
#   - no stall: the guest's probe max stays under kMaxProbeMs (the users' "under 1 s"; an escaped
#     256 MiB job stalls it ~5 s at the pivot). The latency targets themselves are judged by
#     bench-stall on a quiet host, not here;
#   - the probe answered: at least half of the requests it issues during the merge and the settle
#     after it (a probe that died reports no wait at all);
#   - found by QEMU's job event: qcommitd's log says how it found the job. A daemon without the
#     event path finds every job by its 0.5 s poll (the safety net); with it, a poll that lists
#     the job in the few ms before the event reaches the daemon finds it first, now and then.
#     So more than half of the runs must have been found by the event.
# And over the runs: the median of qcommitd's own time to govern -- from QEMU's timestamp of the
# job's creation (its JOB_STATUS_CHANGE event) to the first speed read back from QEMU, the
# issue's definition -- within the 100 ms target. The job watcher's figure (job first seen to
# speed first seen, each through a libvirt answer) is printed beside it but not judged here: it
# adds the watcher's own libvirt round trips, which queue behind QEMU's monitor on a loaded
# machine (CI, 2026-12-07, Debian 13: 211 and 261 ms with the guests' job copying 7 and 12 MiB
# unpaced; on a quiet host 0-34 ms over 20 runs per platform, tests/lab/results/
# repeat-governed-20-runs-2026-12-07-*.txt). The 20-run rows in docs/benchmarks.md judge every run's
# 100 ms, both figures, on a quiet host.
#   repeat_test.sh host|trixie
# trixie: skips (77) unless QCOMMIT_TEST_TRIXIE=1 and the Debian 13 platform is started.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
which=${1:-host}
kMaxMedianGovernMs=100
kMaxUnpacedMiB=32
kMaxWatcherUnpacedMiB=48
kMaxProbeMs=1000
kProbeIntervalMs=100  # passed to bench-stall as --interval
kSettleS=2            # passed as --settle: the probe's samples run that much past the merge
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
  --baseline 2 --settle "$kSettleS" --interval "$kProbeIntervalMs" --repeat "$runs" --drop-caches --out "$out" >&2 ||
  fail "scripts/bench-stall failed"
cat "$out/table.txt"
n=0 bad=0 govern=() own=() by_event=0
while read -r label _bp50 _bmax _p50 _p99 max _gap merge_s rc samples _t _p _f1 _f2 _h gov unpaced _start_max _rest_max; do
  n=$((n + 1))
  if [ "$rc" != 0 ]; then
    echo "FAIL: $label: the merge failed (rc $rc)" >&2; bad=1; continue
  fi
  if [ "$gov" = - ]; then
    echo "FAIL: $label: QEMU's job never had a speed while it ran (it escaped)" >&2; bad=1
  else
    govern+=("$gov")
    awk -v u="$unpaced" -v m="$kMaxWatcherUnpacedMiB" 'BEGIN {exit !(u <= m)}' ||
      { echo "FAIL: $label: $unpaced MiB copied before the watcher saw a speed on QEMU's job (> $kMaxWatcherUnpacedMiB MiB; govern_ms $gov)" >&2; bad=1; }
  fi
  # A probe that stopped answering reports no wait at all: at least half of the requests it
  # issues over the merge and the settle must have been answered for its max to mean anything.
  if awk -v n="$samples" -v s="$merge_s" -v st="$kSettleS" -v iv="$kProbeIntervalMs" \
    'BEGIN {exit !(n >= (s + st) * 1000 / iv / 2 && n >= 1)}'; then
    awk -v x="$max" -v m="$kMaxProbeMs" 'BEGIN {exit !(x < m)}' ||
      { echo "FAIL: $label: the guest's probe waited $max ms (>= $kMaxProbeMs ms) during the $merge_s s merge" >&2; bad=1; }
  else
    echo "FAIL: $label: the guest's probe answered $samples requests during the $merge_s s merge and its $kSettleS s settle (one every $kProbeIntervalMs ms issued)" >&2; bad=1
  fi
  # qcommitd's record of this run's job: "first speed read back from QEMU T ms after the job was
  # found (event|poll); scan began +A ms, job listed +B ms, speed taken +C ms".
  log="$out/qcommitd-${label//\//-}.log"
  line=$(grep -m1 'first speed read back from QEMU' "$log" 2>/dev/null || true)
  echo "$label: ${line:-qcommitd logged no first speed ($log)}"
  if [[ $line =~ read\ back\ from\ QEMU\ ([0-9.]+)\ ms\ after\ the\ job\ was\ found\ \(([a-z]+)\) ]]; then
    own+=("${BASH_REMATCH[1]}")
    if [ "${BASH_REMATCH[2]}" = event ]; then
      by_event=$((by_event + 1))
    else
      echo "$label: qcommitd found the job by its ${BASH_REMATCH[2]}, not by QEMU's job event"
    fi
    # qcommitd's own count of what the job copied before its first speed (more than
    # kLateAdoptionBytes, the same 32 MiB, is a late adoption).
    [[ $line != *"late adoption"* ]] ||
      { echo "FAIL: $label: qcommitd adopted the job late (${line##*late adoption: })" >&2; bad=1; }
  else
    echo "FAIL: $label: qcommitd's log has no first speed for the job" >&2; bad=1
  fi
done <"$out/results.txt"
[ "$n" = "$runs" ] || fail "$n runs recorded, $runs wanted"
((2 * by_event > n)) ||
  { echo "FAIL: qcommitd found $by_event of $n jobs by QEMU's job event (more than half wanted; the others by its poll)" >&2; bad=1; }
median_of() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
median=- watcher=-
((${#govern[@]})) && watcher=$(median_of "${govern[@]}")
if ((${#own[@]})); then
  median=$(median_of "${own[@]}")
  awk -v g="$median" -v m="$kMaxMedianGovernMs" 'BEGIN {exit !(g <= m)}' ||
    { echo "FAIL: median time to govern $median ms over ${#own[@]} runs in qcommitd's record (> $kMaxMedianGovernMs ms; runs: ${own[*]})" >&2; bad=1; }
fi
[ "$bad" = 0 ] || exit 1
echo "PASS repeat_governed ($which): $runs runs, $by_event found by QEMU's job event, each governed with at most $kMaxUnpacedMiB MiB copied before, median time to govern $median ms in qcommitd's record (runs: ${own[*]}; job watcher: median $watcher ms, runs: ${govern[*]}), probe max under $kMaxProbeMs ms ($SECONDS s)"
