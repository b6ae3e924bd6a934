#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.durations: one duration grammar on the command line and in the configuration
# (plugin::read_duration; qcommit(1), DURATIONS). A bare number is refused with the fix
# ("--budget 20: a duration needs a unit: 20ms or 20s", exit 2 on the command line; the file,
# section and key in the configuration, for qcommit and qcommitd alike); spellings with a unit
# give the same budget everywhere (`qcommit plan --output=json` reports it in ms).
# usage: durations.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCOMMITD=$(realpath "$2")
setup cli.durations
uri=test:///default
image base.qcow2 16M
overlay top.qcow2 base.qcow2 'write -P 1 0 1M'
refused() { fails_with "$1" "$2" "$QCOMMIT" "${@:3}"; }  # refused RC TEXT ARGS...

# --- the command line -----------------------------------------------------------------------
fix='--budget 20: a duration needs a unit: 20ms or 20s'
refused 2 "$fix" merge top.qcow2 --budget 20
[[ -e top.qcow2 ]] && qemu-img compare -q top.qcow2 top.qcow2 || fail "merge --budget 20 touched TOP"
[[ -z $(qemu-img map --output=json base.qcow2 | jq -r '.[] | select(.data) | .start') ]] ||
  fail "merge --budget 20 wrote into BASE"
refused 2 "$fix" merge top.qcow2 --budget=20 --dry-run
refused 2 "$fix" plan top.qcow2 --budget 20 --connect "$uri"
refused 2 "$fix" live vm1 vda --budget 20 --uri "$uri" --dry-run
refused 2 "$fix" live vm1 vda --budget=20 --uri "$uri" --dry-run
refused 2 '--budget 1.5: a duration needs a unit: 1.5ms or 1.5s' merge top.qcow2 --budget 1.5
refused 2 "--budget 20m: bad duration unit in '20m' (use ns, us, ms or s)" merge top.qcow2 --budget 20m
refused 2 "--budget 1e3ms: bad duration unit" merge top.qcow2 --budget 1e3ms
refused 2 "--budget -5ms: bad duration '-5ms'" merge top.qcow2 --budget=-5ms
refused 2 "--budget fast: bad duration 'fast'" plan top.qcow2 --budget fast
refused 2 "--budget 0ms: must be more than 0" plan top.qcow2 --budget 0ms
refused 2 "--budget 2h: bad duration unit" plan top.qcow2 --budget 2h
refused 2 "--budget 3601s: duration '3601s' is longer than one hour" plan top.qcow2 --budget 3601s
# SPELLING=MS: plan --budget SPELLING reports MS.
for case in 20ms=20 '20 ms=20' 0.02s=20 .02s=20 20000us=20 20000000ns=20 ' 20ms =20' 1.5s=1500 500us=0.5; do
  got=$("$QCOMMIT" plan top.qcow2 --connect "$uri" --output=json --budget "${case%=*}" | jq -r '."budget-ms"')
  [[ $got == "${case##*=}" ]] || fail "plan --budget '${case%=*}': $got ms, expected ${case##*=}"
done
# The merge takes the same spelling and runs.
"$QCOMMIT" merge "$work/top.qcow2" --budget 20ms --probe off --connect "$uri" --output=json >merge.json 2>merge.err ||
  fail "merge --budget 20ms failed: $(cat merge.err)"
[[ $(jq -r 'select(.event == "result") | ."budget-ms"' merge.json) == 20 ]] || fail "merge --budget 20ms: $(tail -n 1 merge.json)"

# --- the configuration (qcommit and qcommitd read the same file) -----------------------------
overlay top2.qcow2 base.qcow2
printf '[default]\nbudget=20\n' >bare.conf
refused 1 "bare.conf: [default] budget: a duration needs a unit: 20ms or 20s" plan top2.qcow2 --config bare.conf --connect "$uri"
refused 1 "bare.conf: [default] budget: a duration needs a unit: 20ms or 20s" merge top2.qcow2 --config bare.conf --connect "$uri"
qemu-img compare -q top2.qcow2 top2.qcow2 && [[ -e top2.qcow2 ]] || fail "merge with a bad config touched TOP"
printf '[default]\nbudget=20ms\n[pool:x]\nbudget=7\n' >pool.conf
refused 1 "pool.conf: [pool:x] budget: a duration needs a unit: 7ms or 7s" plan top2.qcow2 --config pool.conf --connect "$uri"
qcommitd_refuses bare.conf "a duration needs a unit: 20ms or 20s"
for spelling in '20 ms' 0.02s 20ms; do
  printf '[default]\nbudget=%s\n' "$spelling" >ok.conf
  [[ $("$QCOMMIT" plan top2.qcow2 --config ok.conf --connect "$uri" --output=json | jq -r '."budget-ms"') == 20 ]] ||
    fail "budget=$spelling in the configuration is not 20 ms"
done
# status --watch takes the same grammar: a bare number is refused with the fix, and the
# interval has a floor; with a unit it redraws until stopped (here: no daemon, exit 1).
refused 2 "--watch 0.5: a duration needs a unit: 0.5ms or 0.5s" status --watch 0.5 --socket "$work/none.sock"
refused 2 "--watch interval must be at least 100ms" status --watch 20ms --socket "$work/none.sock"
refused 1 "none.sock: cannot connect to qcommitd" status --watch 500ms --socket "$work/none.sock"
echo "cli.durations: OK"
