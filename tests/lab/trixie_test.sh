#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# ctest lab-trixie.governed_merges: qcommitd and qcommit against Debian 13's libvirt 11 and
# QEMU 10 (scripts/trixie-platform, started), the lab's slow storage and probe guest in the
# platform's shared directory. The binaries are those built inside the platform against trixie's
# libvirt and GLib (`scripts/trixie-platform build`, run in the chroot and talking to its libvirtd
# as qemu:///system) when that build has them, else the host's (talking to it by socket URI);
# QCOMMIT_TRIXIE_BINARIES=inside|host chooses, and `inside` fails when the build is missing.
#
# Case virsh: qcommitd --uri <trixie> runs; a plain `virsh blockcommit DOM vda --active --pivot
#   --wait` of a filled overlay; qcommitd must list the job and set its speed (libvirt reports
#   a bandwidth), the pivot must land on base.raw.
# Case live: `qcommit live DOM vda --pivot --uri <trixie>` (no qcommitd); pivot on base.raw.
# Case filter: as virsh with cache=none and a qcow2 base (libvirt 11 opens a raw image without a
#   format node, which the filter goes under): qcommitd's log and `qcommit status` say its
#   throttle filter is in, QEMU has it (a throttle node qcommit-tf-*) while the job copies;
#   qcommitd is then killed (SIGKILL) and started again, and the new one must remove the filter
#   the dead one left, and a lone throttle group named as the dead one's (as if killed between
#   adding the group and the filter);
#   after the pivot no qcommit node or throttle group is left in QEMU; data read from a raw copy
#   of the base (qemu-img convert).
# All: the fill written before the merge and every probe write completed before and during it
# read back from base.raw after the domain is shut down (tests/lab/live_verify.py); the probe's
# max latency and the longest gap between two probe completions are reported.
#
# Skips (exit 77) unless QCOMMIT_TEST_TRIXIE=1 and the platform is started
# (scripts/trixie-platform setup && scripts/trixie-platform start).
#   trixie_test.sh [virsh|live|filter|all]
# Environment: QCOMMIT_LAB_CACHE (guest kernel/initramfs cache, default <build>/lab-cache),
# TRIXIE_FILL_MIB (default 128: unthrottled, its writeback alone would freeze the guest for
# ~2.7 s at the lab's 50 MB/s).
# Judged in both cases: no guest freeze of a second or more (the longest time between two probe
# completions, during the merge and 2 s after; the users' "stalls under 1 s"), which also
# catches a frozen QEMU monitor. The latency targets themselves are judged by bench-stall on a
# quiet host, not here.
set -euo pipefail
here=$(dirname "$0")
src=$(cd "$here/../.." && pwd)
platform=$src/scripts/trixie-platform

skip() {
  echo "SKIP lab-trixie: $*"
  exit 77
}
[ "${QCOMMIT_TEST_TRIXIE:-0}" = 1 ] || skip "QCOMMIT_TEST_TRIXIE is not 1"
[ "$(id -u)" -eq 0 ] || skip "needs root"
"$platform" status >/dev/null 2>&1 || skip "the trixie platform is not started (scripts/trixie-platform setup && start)"

# The platform's stack for every run (tests/lab/platform.sh): runs in its shared directory
# (same path for the host's FUSE storage and trixie's QEMU), its libvirtd only, and the binaries
# QCOMMIT_TRIXIE_BINARIES chooses.
source "$here/platform.sh"
lab_platform trixie "${QCOMMIT_TRIXIE_BINARIES:-auto}" || { echo "FAIL: lab_platform trixie" >&2; exit 1; }
source "$here/lab.sh"
source "$here/live_lib.sh"
LAB_CACHE=${QCOMMIT_LAB_CACHE:-$LAB_CACHE}
kFill=${TRIXIE_FILL_MIB:-128}
kMaxGapMs=1000
echo "platform: $(lab_platform_describe)"
echo "binaries: $LIVE_QCOMMIT, $LIVE_QCOMMITD ($("$LIVE_QCOMMIT" --version 2>&1 | head -1)), URI $LIVE_URI"

prepare_guest() {
  lab_guest_ready --baseline 3 --cache "${1:-writeback}" --fill "$kFill" --interval 100 --disk-size 1024M
}

verify_data() {
  virsh -q domblklist "$LAB_DOM" | grep -q "vda *$LAB_BASE\$" ||
    fail "domain does not run on $LAB_BASE after the pivot: $(virsh -q domblklist "$LAB_DOM")"
  sleep 1
  lab_collect "$1" 3 2
  awk -v g="$LAB_STATS_max_gap" -v l="$kMaxGapMs" 'BEGIN {exit !(g >= 0 && g < l)}' ||
    fail "the guest froze: ${LAB_STATS_max_gap} ms between two probe completions (limit ${kMaxGapMs} ms)"
  lab_guest_stop
  sync
  local image=$LAB_BASE
  if [ "${LAB_BASE_FORMAT:-raw}" = qcow2 ]; then
    image=$LAB_DIR/base-flat.raw
    qemu-img convert -f qcow2 -O raw "$LAB_BASE" "$image"
  fi
  python3 "$here/live_verify.py" "$image" "$kFill" "$LAB_DIR/console.log" ||
    fail "data written before/during the merge does not read back from $LAB_BASE"
  [ "$image" = "$LAB_BASE" ] || rm -f "$image"
}

qmp() { virsh -q qemu-monitor-command "$LAB_DOM" "$1"; }
# QEMU's block nodes now, one a line: "name drv file".
qemu_nodes() {
  qmp '{"execute":"query-named-block-nodes","arguments":{"flat":true}}' |
    python3 -c 'import json,sys
for n in json.load(sys.stdin)["return"]: print(n["node-name"], n["drv"], n["file"])'
}

run_filter() {
  export LAB_BASE_FORMAT=qcow2
  lab_init filter
  trap 'live_cleanup; lab_teardown' EXIT
  live_qcd_start --budget 20ms
  prepare_guest none
  (lab_merge virsh blockcommit "$LAB_DOM" vda --active --pivot --wait --verbose; echo "$LAB_MERGE_RC" >"$LAB_DIR/merge.rc") &
  local merge_pid=$! seen=""
  filter_seen() { seen=$(qemu_nodes 2>/dev/null | grep '^qcommit-tf-[^ ]* throttle ' || true); [ -n "$seen" ] || gone "$merge_pid"; }
  wait_until 900 filter_seen || true
  [ -n "$seen" ] || fail "QEMU never had a qcommit throttle node while the job copied"
  grep -q "throttle filter under $LAB_BASE in" "$LAB_DIR/qcommitd.log" ||
    fail "qcommitd's log does not say the filter went in"
  "$LIVE_QCOMMIT" status --socket "$LIVE_SOCK" >"$LAB_DIR/status.txt" || fail "qcommit status failed"
  grep -qxF "throttle filter: $LAB_DOM vda: on" "$LAB_DIR/status.txt" ||
    fail "qcommit status does not show the filter: $(cat "$LAB_DIR/status.txt")"
  # qcommitd killed with its filter in: the next one removes that filter when it connects (and
  # puts its own in if the job still copies).
  local old_pid
  old_pid=$(sed -n 's/^qcommit-tf-\([0-9]*\)-.*/\1/p' <<<"$seen")
  live_qcd_stop KILL
  kill -KILL "$old_pid" 2>/dev/null || true
  wait_until 5 gone "$old_pid" || true
  # A group the killed qcommitd added without its filter yet (killed between the two steps).
  qmp '{"execute":"object-add","arguments":{"qom-type":"throttle-group","id":"qcommit-tg-'"$old_pid"'-99","limits":{}}}' >/dev/null ||
    fail "could not add a lone throttle group"
  live_qcd_start --budget 20ms
  wait_until 10 grep -q "throttle filter removed qcommit-tf-$old_pid-" "$LAB_DIR/qcommitd.log" ||
    fail "the filter of the killed qcommitd ($old_pid) was not removed by the next one"
  wait "$merge_pid" || true
  [ "$(cat "$LAB_DIR/merge.rc")" = 0 ] || fail "virsh blockcommit --active --pivot failed"
  local left="" groups=""
  none_left() {
    left=$(qemu_nodes | grep '^qcommit-' || true)
    groups=$(qmp '{"execute":"qom-list","arguments":{"path":"/objects"}}' | grep -o '"name":"qcommit-[^"]*"' || true)
    [ -z "$left$groups" ]
  }
  wait_until 3 none_left || true
  [ -z "$left" ] || fail "qcommit nodes left in QEMU after the pivot: $left"
  [ -z "$groups" ] || fail "qcommit throttle groups left in QEMU after the pivot: $groups"
  verify_data filter
  echo "filter: in ($(cut -d' ' -f1 <<<"$seen")), removed after a kill -9 of its qcommitd, merge ${LAB_STATS_merge_s} s," \
    "probe p99 ${LAB_STATS_p99} ms max ${LAB_STATS_max} ms gap ${LAB_STATS_max_gap} ms, pivot OK, data intact" |
    tee "$LAB_DIR/result"
  live_cleanup
  lab_teardown
  lab_assert_clean || fail "run $LAB_ID left resources behind"
}

run_virsh() {
  lab_init virsh
  trap 'live_cleanup; lab_teardown' EXIT
  live_qcd_start --budget 20ms
  grep -qF -- "--uri $LIVE_URI" <(ps -o args= -p "$LIVE_QCD_PID") || fail "qcommitd is not on $LIVE_URI"
  prepare_guest
  (lab_merge virsh blockcommit "$LAB_DOM" vda --active --pivot --wait --verbose; echo "$LAB_MERGE_RC" >"$LAB_DIR/merge.rc") &
  local merge_pid=$! bw=""
  wait_until 10 live_job_listed "$LAB_DOM" vda || fail "qcommitd never listed the job (status: $(live_status))"
  speed_seen() { bw=$(live_job_bandwidth "$LAB_DOM" vda); [ -n "$bw" ] && [ "$bw" != 0 ] || gone "$merge_pid"; }
  wait_until 5 speed_seen || true
  live_status >"$LAB_DIR/status-during.json"
  wait "$merge_pid" || true
  [ "$(cat "$LAB_DIR/merge.rc")" = 0 ] || fail "virsh blockcommit --active --pivot failed"
  [ -n "$bw" ] && [ "$bw" != 0 ] || fail "qcommitd listed the job but libvirt reports no speed set"
  grep -q "$LAB_DOM" "$LAB_DIR/qcommitd.log" || fail "qcommitd's log does not mention $LAB_DOM"
  verify_data governed
  echo "virsh: qcommitd listed and governed the job (bandwidth $bw B/s), merge ${LAB_STATS_merge_s} s," \
    "probe p99 ${LAB_STATS_p99} ms max ${LAB_STATS_max} ms gap ${LAB_STATS_max_gap} ms, pivot OK, data intact" |
    tee "$LAB_DIR/result"
  live_cleanup
  lab_teardown
  lab_assert_clean || fail "run $LAB_ID left resources behind"
}

run_live() {
  lab_init live
  trap 'lab_teardown' EXIT
  prepare_guest
  lab_merge "$LIVE_QCOMMIT" live "$LAB_DOM" vda --pivot --uri "$LIVE_URI" \
    --daemon-socket "$LAB_DIR/no-qcommitd.sock"
  [ "$LAB_MERGE_RC" = 0 ] || fail "qcommit live --pivot failed"
  verify_data live
  echo "live: qcommit live --pivot in ${LAB_STATS_merge_s} s, probe p99 ${LAB_STATS_p99} ms" \
    "max ${LAB_STATS_max} ms gap ${LAB_STATS_max_gap} ms, pivot OK, data intact" | tee "$LAB_DIR/result"
  lab_teardown
  lab_assert_clean || fail "run $LAB_ID left resources behind"
}

case ${1:-all} in
  virsh) (run_virsh) || exit 1 ;;
  live) (run_live) || exit 1 ;;
  filter) (run_filter) || exit 1 ;;
  all)
    (run_virsh) || exit 1
    (run_live) || exit 1
    (run_filter) || exit 1
    ;;
  *) echo "usage: trixie_test.sh [virsh|live|filter|all]" >&2; exit 2 ;;
esac
echo "PASS lab-trixie ($SECONDS s)"
