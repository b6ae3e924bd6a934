#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# bench-stall merge actions with qcommit (run as a row command: LAB_DOM, LAB_DIR set).
#   live_row.sh daemon [--budget 20ms] [--page-cache SOURCE]
#                                        qcommitd running (private socket, trace in LAB_DIR),
#                                        the user's `virsh blockcommit DOM vda --active --pivot`
#   live_row.sh daemon-late [--budget 20ms] [--late SECONDS]
#                                        the user's `virsh blockcommit DOM vda --active --pivot`
#                                        started first, qcommitd only SECONDS (0.5) later: a job
#                                        that escaped governance (a daemon restart, a late start)
#   live_row.sh live [OPTIONS...]        qcommit live DOM vda --pivot OPTIONS...
# Exits with the merge command's status.
set -euo pipefail
here=$(dirname "$0")
source "$here/lab.sh"
source "$here/live_lib.sh"
mode=${1:?usage: live_row.sh daemon|live [...]}
shift
case $mode in
  daemon)
    budget=20ms
    while [ $# -gt 0 ]; do
      case $1 in
        --budget) budget=$2; shift 2 ;;
        --page-cache) LIVE_QCOMMITD_ARGS="${LIVE_QCOMMITD_ARGS:-} --page-cache $2"; shift 2 ;;
        *) lab_die "live_row.sh daemon: unknown option $1" ;;
      esac
    done
    trap live_cleanup EXIT
    live_qcd_start --budget "$budget"
    rc=0
    t0=$(date +%s.%N)
    virsh blockcommit "$LAB_DOM" vda --active --pivot || rc=$?
    # qcommitd's CPU time during the merge (utime + stime, clock ticks): its page-cache
    # readings once took most of a core, which guests on 2 cores felt as latency.
    ticks=$(awk '{print $14 + $15}' "/proc/$LIVE_QCD_PID/stat" 2>/dev/null || echo 0)
    lab_log "qcommitd CPU: $(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" -v t0="$t0" -v t1="$(date +%s.%N)" \
      'BEGIN {printf "%.1f s over %.0f s of merge (%.0f%% of a core)", t / hz, t1 - t0, 100 * t / hz / (t1 - t0)}')"
    live_qcd_stop TERM
    exit "$rc"
    ;;
  daemon-late)
    budget=20ms late=0.5
    while [ $# -gt 0 ]; do
      case $1 in
        --budget) budget=$2; shift 2 ;;
        --late) late=$2; shift 2 ;;
        *) lab_die "live_row.sh daemon-late: unknown option $1" ;;
      esac
    done
    trap live_cleanup EXIT
    virsh blockcommit "$LAB_DOM" vda --active --pivot &
    commit_pid=$!
    sleep "$late"
    live_qcd_start --budget "$budget"
    rc=0
    wait "$commit_pid" || rc=$?
    live_qcd_stop TERM
    exit "$rc"
    ;;
  live)
    exec "$LIVE_QCOMMIT" live "$LAB_DOM" vda --pivot ${LIVE_URI:+--uri "$LIVE_URI"} "$@"
    ;;
  *) lab_die "live_row.sh: unknown mode $mode" ;;
esac
