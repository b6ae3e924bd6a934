#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Lab experiment (not a ctest): what a QEMU commit job whose chunks qcommit was spacing (the chunk
# gate, cache=none, QEMU < 8.1) does when the governing process dies with SIGKILL.
# `qcommit live DOM vda --pivot` (two-phase; its governor runs in-process) on a cache=none guest
# with a FILL_MIB overlay; SIGKILL after KILL_AFTER_S, in its first phase (the non-active commit of
# the old overlay); then the job is left alone.  Prints when the job made progress again, when it
# finished, and its bandwidth as libvirt reports it.  The job must finish.
#   QCOMMIT_BUILD_DIR=build-q tests/lab/with-lab-lock.sh tests/lab/gate_kill_experiment.sh [FILL_MIB [KILL_AFTER_S]]
set -euo pipefail
here=$(dirname "$0")
source "$here/lab.sh"
source "$here/live_lib.sh"
fill=${1:-512}
kill_after=${2:-10}

lab_init gatekill
lab_guest_ready --wait 240 --cache none --fill "$fill" --interval 100 --disk-size 2560M

t0=$(lab_now)
"$LIVE_QCOMMIT" live "$LAB_DOM" vda --pivot --budget 20ms >"$LAB_DIR/live.log" 2>&1 &
live_pid=$!
sleep "$kill_after"
kill -KILL "$live_pid"
wait "$live_pid" 2>/dev/null || true
t_kill=$(lab_now)
read -r cur0 end0 < <(live_job_cur_end "$LAB_DOM" vda) || true
lab_log "qcommit live killed $(awk -v a="$t0" -v b="$t_kill" 'BEGIN {printf "%.1f", b - a}') s after it started; job at $cur0 of $end0 bytes, bandwidth $(live_job_bandwidth "$LAB_DOM" vda) B/s"
last=$cur0 t_moved="" t_done=""
while :; do
  sleep 0.5
  cur_end=$(live_job_cur_end "$LAB_DOM" vda || true)
  if [ -z "$cur_end" ]; then
    t_done=$(lab_now)
    break
  fi
  read -r cur end <<<"$cur_end"
  if [ -z "$t_moved" ] && [ "$cur" -gt "$last" ]; then
    t_moved=$(lab_now)
    lab_log "job moved again $(awk -v a="$t_kill" -v b="$t_moved" 'BEGIN {printf "%.1f", b - a}') s after the kill (at $cur of $end), bandwidth $(live_job_bandwidth "$LAB_DOM" vda) B/s"
  fi
  last=$cur
  if awk -v a="$t_kill" -v b="$(lab_now)" 'BEGIN {exit !(b - a > 900)}'; then
    lab_die "job not finished 900 s after the kill (at $cur of $end)"
  fi
done
lab_log "job finished $(awk -v a="$t_kill" -v b="$t_done" 'BEGIN {printf "%.1f", b - a}') s after the kill ($(awk -v a="$t0" -v b="$t_done" 'BEGIN {printf "%.1f", b - a}') s after qcommit live started)"
virsh domblklist "$LAB_DOM" >&2
