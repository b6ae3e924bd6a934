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

qemu-img create -q -f qcow2 base.qcow2 16M
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2
qemu-io -c 'write -P 1 0 1M' top.qcow2 >/dev/null

# expect_usage CMD...: exit 2, one line on stderr naming --budget and showing the fix.
refused() {  # refused WANT_RC PATTERN CMD...
  local want=$1 pattern=$2 rc=0
  shift 2
  "$@" >out.txt 2>err.txt </dev/null || rc=$?
  [[ $rc == "$want" ]] || fail "$*: exit $rc, expected $want: $(cat err.txt)"
  [[ $(wc -l <err.txt) == 1 ]] || fail "$*: the error is not one line: $(cat err.txt)"
  grep -qF -- "$pattern" err.txt || fail "$*: error '$(cat err.txt)' does not contain '$pattern'"
}

# --- the command line -----------------------------------------------------------------------
fix='--budget 20: a duration needs a unit: 20ms or 20s'
refused 2 "$fix" "$QCOMMIT" merge top.qcow2 --budget 20
[[ -e top.qcow2 ]] && qemu-img compare -q top.qcow2 top.qcow2 || fail "merge --budget 20 touched TOP"
[[ -z $(qemu-img map --output=json base.qcow2 | jq -r '.[] | select(.data) | .start') ]] ||
  fail "merge --budget 20 wrote into BASE"
refused 2 "$fix" "$QCOMMIT" merge top.qcow2 --budget=20 --dry-run
refused 2 "$fix" "$QCOMMIT" plan top.qcow2 --budget 20 --connect "$uri"
refused 2 "$fix" "$QCOMMIT" live vm1 vda --budget 20 --uri "$uri" --dry-run
refused 2 "$fix" "$QCOMMIT" live vm1 vda --budget=20 --uri "$uri" --dry-run
refused 2 '--budget 1.5: a duration needs a unit: 1.5ms or 1.5s' "$QCOMMIT" merge top.qcow2 --budget 1.5
refused 2 "--budget 20m: bad duration unit in '20m' (use ns, us, ms or s)" "$QCOMMIT" merge top.qcow2 --budget 20m
refused 2 "--budget 1e3ms: bad duration unit" "$QCOMMIT" merge top.qcow2 --budget 1e3ms
refused 2 "--budget -5ms: bad duration '-5ms'" "$QCOMMIT" merge top.qcow2 --budget=-5ms
refused 2 "--budget fast: bad duration 'fast'" "$QCOMMIT" plan top.qcow2 --budget fast
refused 2 "--budget 0ms: must be more than 0" "$QCOMMIT" plan top.qcow2 --budget 0ms
refused 2 "--budget 2h: bad duration unit" "$QCOMMIT" plan top.qcow2 --budget 2h
refused 2 "--budget 3601s: duration '3601s' is longer than one hour" "$QCOMMIT" plan top.qcow2 --budget 3601s

budget_ms() {  # budget_ms ARGS...: the budget plan reports, in ms
  "$QCOMMIT" plan top.qcow2 --connect "$uri" --output=json "$@" | jq -r '."budget-ms"'
}
for spelling in 20ms '20 ms' 0.02s .02s 20000us 20000000ns ' 20ms '; do
  [[ $(budget_ms --budget "$spelling") == 20 ]] || fail "plan --budget '$spelling': $(budget_ms --budget "$spelling") ms, expected 20"
done
[[ $(budget_ms --budget 1.5s) == 1500 ]] || fail "plan --budget 1.5s"
[[ $(budget_ms --budget 500us) == 0.5 ]] || fail "plan --budget 500us: $(budget_ms --budget 500us)"
# The merge takes the same spelling and runs.
"$QCOMMIT" merge "$work/top.qcow2" --budget 20ms --probe off --connect "$uri" --output=json >merge.json 2>merge.err ||
  fail "merge --budget 20ms failed: $(cat merge.err)"
[[ $(jq -r 'select(.event == "result") | ."budget-ms"' merge.json) == 20 ]] || fail "merge --budget 20ms: $(tail -n 1 merge.json)"

# --- the configuration (qcommit and qcommitd read the same file) -----------------------------
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top2.qcow2
printf '[default]\nbudget=20\n' >bare.conf
refused 1 "bare.conf: [default] budget: a duration needs a unit: 20ms or 20s" \
  "$QCOMMIT" plan top2.qcow2 --config bare.conf --connect "$uri"
refused 1 "bare.conf: [default] budget: a duration needs a unit: 20ms or 20s" \
  "$QCOMMIT" merge top2.qcow2 --config bare.conf --connect "$uri"
qemu-img compare -q top2.qcow2 top2.qcow2 && [[ -e top2.qcow2 ]] || fail "merge with a bad config touched TOP"
printf '[default]\nbudget=20ms\n[pool:x]\nbudget=7\n' >pool.conf
refused 1 "pool.conf: [pool:x] budget: a duration needs a unit: 7ms or 7s" \
  "$QCOMMIT" plan top2.qcow2 --config pool.conf --connect "$uri"
rc=0
timeout 20 "$QCOMMITD" --config bare.conf --uri "$uri" --socket "$work/qcd.sock" >qcd.out 2>qcd.err || rc=$?
[[ $rc != 0 && $rc != 124 ]] || fail "qcommitd started with budget=20 (exit $rc)"
grep -qF "a duration needs a unit: 20ms or 20s" qcd.err || fail "qcommitd's error does not show the fix: $(cat qcd.err)"
for spelling in '20 ms' 0.02s 20ms; do
  printf '[default]\nbudget=%s\n' "$spelling" >ok.conf
  [[ $("$QCOMMIT" plan top2.qcow2 --config ok.conf --connect "$uri" --output=json | jq -r '."budget-ms"') == 20 ]] ||
    fail "budget=$spelling in the configuration is not 20 ms"
done
# status --watch takes the same grammar: a bare number is refused with the fix, and the
# interval has a floor; with a unit it redraws until stopped (here: no daemon, exit 1).
refused 2 "--watch 0.5: a duration needs a unit: 0.5ms or 0.5s" "$QCOMMIT" status --watch 0.5 --socket "$work/none.sock"
refused 2 "--watch interval must be at least 100ms" "$QCOMMIT" status --watch 20ms --socket "$work/none.sock"
refused 1 "none.sock: cannot connect to qcommitd" "$QCOMMIT" status --watch 500ms --socket "$work/none.sock"
echo "cli.durations: OK"
