# SPDX-License-Identifier: GPL-2.0-or-later
# shellcheck shell=bash
# qcommitd in the lab: start/stop a private daemon and read its status.  Source after lab.sh.
#
#   live_qcd_start [--budget 20ms] [--floor 1M]
#                            qcommitd with a test config in a temp dir (LIVE_TMP), control
#                            socket $LIVE_SOCK, log $LAB_DIR/qcommitd.log; sets LIVE_QCD_PID;
#                            extra daemon options from LIVE_QCOMMITD_ARGS (e.g. --page-cache meminfo),
#                            extra [default] keys from LIVE_QCD_CONF_EXTRA (lines, e.g. "probe=off\n");
#                            libvirt URI from LIVE_URI (default qemu:///system)
#   live_qcd_stop [SIGNAL]   stops our qcommitd (by its pid; default TERM) and waits for it
#   live_status              `qcommit status --output=json` of our daemon (empty when down)
#   live_job_field DOM DISK FIELD
#                            a field of the governed job DOM/DISK from live_status ("" if absent)
#   live_job_listed DOM DISK true when our qcommitd lists the job DOM/DISK
#   live_job_bandwidth DOM DISK
#                            bandwidth of the block job as libvirt reports it (bytes/s; "" if none)
#   live_job_cur_end DOM DISK
#                            "cur end" of the block job (virsh blockjob --info --bytes)
#   live_samples_between T0 T1
#                            "n p50 p99 max" (ms) of probe writes completed in [T0, T1) (epoch s)

# The binaries, the URI they use and where their private files go: the host's build by default,
# the Debian 13 platform's when tests/lab/platform.sh set LAB_QCOMMIT, LAB_QCOMMITD,
# LAB_QCOMMIT_URI and LAB_TMP_ROOT.
LIVE_QCOMMITD=${LAB_QCOMMITD:-$LAB_BUILD_DIR/qcommitd}
LIVE_QCOMMIT=${LAB_QCOMMIT:-$LAB_BUILD_DIR/qcommit}
LIVE_URI=${LIVE_URI:-${LAB_QCOMMIT_URI:-}}
LIVE_QCD_PID=""

live_qcd_start() {
  local budget=20ms floor=1M
  while [ $# -gt 0 ]; do
    case $1 in
      --budget) budget=$2; shift 2 ;;
      --floor) floor=$2; shift 2 ;;
      *) lab_die "live_qcd_start: unknown option $1" ;;
    esac
  done
  [ -x "$LIVE_QCOMMITD" ] || lab_die "$LIVE_QCOMMITD missing: build target qcommitd"
  [ -x "$LIVE_QCOMMIT" ] || lab_die "$LIVE_QCOMMIT missing: build target qcommit"
  LIVE_TMP=${LIVE_TMP:-$(mktemp -d "${LAB_TMP_ROOT:-/tmp}/qcommit-live.XXXXXX")}
  LIVE_SOCK=$LIVE_TMP/qcommitd.sock
  printf '[default]\nbudget=%s\nfloor=%s\n%s' "$budget" "$floor" "${LIVE_QCD_CONF_EXTRA:-}" >"$LIVE_TMP/qcommitd.conf"
  "$LIVE_QCOMMITD" --config "$LIVE_TMP/qcommitd.conf" --uri "${LIVE_URI:-qemu:///system}" --socket "$LIVE_SOCK" \
    --trace "$LAB_DIR/qcommitd-trace.csv" ${LIVE_QCOMMITD_ARGS:-} \
    </dev/null >>"$LAB_DIR/qcommitd.log" 2>&1 &
  LIVE_QCD_PID=$!
  wait_until 30 _live_qcd_up || lab_die "qcommitd did not connect to libvirtd: $(tail -n 3 "$LAB_DIR/qcommitd.log")"
  gone "$LIVE_QCD_PID" && lab_die "qcommitd exited: $(tail -n 3 "$LAB_DIR/qcommitd.log")"
  lab_log "qcommitd running (pid $LIVE_QCD_PID, socket $LIVE_SOCK)"
}
# Connected to libvirtd, or exited.
_live_qcd_up() { { [ -S "$LIVE_SOCK" ] && live_status | grep -q '"connected":true'; } || gone "$LIVE_QCD_PID"; }

live_qcd_stop() {
  local sig=${1:-TERM}
  [ -n "$LIVE_QCD_PID" ] || return 0
  kill -"$sig" "$LIVE_QCD_PID" 2>/dev/null || true
  wait_until 10 gone "$LIVE_QCD_PID" || kill -KILL "$LIVE_QCD_PID" 2>/dev/null || true
  wait "$LIVE_QCD_PID" 2>/dev/null || true
  LIVE_QCD_PID=""
}

live_cleanup() {
  live_qcd_stop TERM
  [ -n "${LIVE_TMP:-}" ] && rm -rf "$LIVE_TMP"
  LIVE_TMP=""
}

live_status() {
  [ -S "${LIVE_SOCK:-}" ] || return 0
  "$LIVE_QCOMMIT" status --output=json --socket "$LIVE_SOCK" 2>/dev/null || true
}

live_job_field() {
  live_status | python3 -c '
import json, sys
dom, disk, field = sys.argv[1:4]
try:
    st = json.load(sys.stdin)
except Exception:
    sys.exit(0)
for j in st.get("jobs", []):
    if j.get("domain") == dom and j.get("disk") == disk:
        v = j.get(field)
        print("" if v is None else (str(v).lower() if isinstance(v, bool) else v))
' "$1" "$2" "$3"
}

live_job_listed() { [ -n "$(live_job_field "$1" "$2" domain)" ]; }

live_job_bandwidth() {
  virsh -q blockjob "$1" "$2" --raw --bytes 2>/dev/null | awk -F= '$1 ~ /bandwidth/ {print $2}'
}

live_job_cur_end() {
  virsh -q blockjob "$1" "$2" --raw 2>/dev/null | awk -F= '$1 ~ /cur/ {c=$2} $1 ~ /end/ {e=$2} END {if (e != "") print c, e}'
}

live_samples_between() {
  lab_samples | awk -v a="$1" -v b="$2" "$LAB_AWK_PCT"'
    $1 >= a && $1 < b { n++; l[n] = $2; if ($2 > mx) mx = $2 }
    END {
      if (n == 0) { print 0, -1, -1, -1; exit }
      printf "%d %.1f %.1f %.1f\n", n, pct(l, n, 0.5), pct(l, n, 0.99), mx
    }'
}
