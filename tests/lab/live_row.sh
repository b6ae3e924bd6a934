#!/usr/bin/env bash
# bench-stall merge actions with qcommit (run as a row command: LAB_DOM, LAB_DIR set).
#   live_row.sh daemon [--budget 20ms]   qcommitd running (private socket, trace in LAB_DIR),
#                                        the user's `virsh blockcommit DOM vda --active --pivot`
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
    [ "${1:-}" = --budget ] && budget=$2
    trap live_cleanup EXIT
    live_qcd_start --budget "$budget"
    rc=0
    virsh blockcommit "$LAB_DOM" vda --active --pivot || rc=$?
    live_qcd_stop TERM
    exit "$rc"
    ;;
  live)
    exec "$LIVE_QCOMMIT" live "$LAB_DOM" vda --pivot "$@"
    ;;
  *) lab_die "live_row.sh: unknown mode $mode" ;;
esac
