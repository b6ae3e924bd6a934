#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# ctest lab.stall_reproduces: the users' stall reproduces in the lab.
# Guest on 50 MB/s sync storage (cache=writeback, libvirt's default), 256 MiB written into the
# overlay, baseline probe latency must be low; an unthrottled active commit must stall the probe
# (max latency >= 10x baseline p50) because the guest's flush waits behind the base's writeback.
# Afterwards nothing of the run may be left: domain, mount, processes.
set -euo pipefail
source "$(dirname "$0")/lab.sh"

kBaselineS=6
kBaselineMaxMs=250   # a 4 KiB O_DSYNC write on idle 50 MB/s storage takes ~2 ms (TCG noise allowed)
kStallFactor=10

# Runs killed earlier (e.g. by a ctest timeout) could not tear down; clear them first.
"$LAB_SOURCE_DIR/scripts/lab-cleanup" >&2
lab_init stalltest
lab_guest_ready --wait 180 --baseline "$kBaselineS" --cache writeback --fill 256 --interval 100
lab_merge virsh blockcommit "$LAB_DOM" vda --active --pivot --verbose
sleep 3
lab_collect commit "$kBaselineS" 2

[ "$LAB_MERGE_RC" -eq 0 ] || fail "blockcommit failed: $(tail -n 3 "$LAB_DIR/merge.log")"
virsh -q domblklist "$LAB_DOM" | grep -q "vda *$LAB_BASE\$" || fail "domain does not run on base.raw after pivot"
[ "$LAB_STATS_base_n" -ge $((kBaselineS * 10 / 2)) ] || fail "probe too slow: $LAB_STATS_base_n baseline samples in ${kBaselineS}s"
awk -v m="$LAB_STATS_base_max" -v lim="$kBaselineMaxMs" 'BEGIN {exit !(m < lim)}' ||
  fail "baseline max latency ${LAB_STATS_base_max} ms >= ${kBaselineMaxMs} ms"
awk -v m="$LAB_STATS_max" -v p="$LAB_STATS_base_p50" -v k="$kStallFactor" 'BEGIN {exit !(m >= k * p)}' ||
  fail "no stall: max ${LAB_STATS_max} ms < ${kStallFactor} x baseline p50 ${LAB_STATS_base_p50} ms"
# The mechanism: while the worst probe write waited, the FIFO storage was busy serving the
# commit's writeback of base.raw (not the overlay the guest flushes).
read -r worst_done worst_ms < <(sort -k2 -n -r "$LAB_DIR/samples.txt" | head -n1)
base_ino=$(stat -c %i "$LAB_DIR/backing/base.raw")
ahead=$(awk -F, -v a="$worst_done" -v l="$worst_ms" -v ino="$base_ino" '
  NR > 1 && $2 == "W" && $3 == ino { done = $1 + ($8 + $9) / 1000; if (done > a - l / 1000 && done <= a) sum += $5 }
  END {print sum + 0}' "$LAB_DIR/slowfs.csv")
[ "$ahead" -ge $((32 << 20)) ] || fail "worst probe write did not wait behind base.raw writeback (${ahead} B served meanwhile)"

echo "baseline: p50 ${LAB_STATS_base_p50} ms, max ${LAB_STATS_base_max} ms; commit ${LAB_STATS_merge_s}s:" \
  "probe p99 ${LAB_STATS_p99} ms, max ${LAB_STATS_max} ms, max gap ${LAB_STATS_max_gap} ms;" \
  "base.raw writeback served during the worst probe write: $((ahead >> 20)) MiB"
lab_teardown
lab_assert_clean || fail "run $LAB_ID left resources behind"
echo "PASS lab.stall_reproduces ($SECONDS s)"
