#!/usr/bin/env bash
# merge.kill_resume: a real qcommit merge process SIGKILLed at 20 moments spread over the copy;
# each run resumes the interrupted one (the same command again), the last one finishes. Then:
# BASE's view == TOP's view saved before, qemu-img check BASE exit 0 (leaks from the kills were
# repaired by the resumes), TOP byte-identical. After every kill qemu-img check must find no
# corruption (leaks allowed).
#
# usage: merge-kill-resume.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-kill.XXXXXX")
pid=
trap '[[ -n $pid ]] && kill -9 $pid 2>/dev/null; rm -rf "$work"' EXIT
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

MiB=$((1024 * 1024))
KILLS=${KILLS:-20}
# ~320 MiB as random 64 KiB clusters over a 2 GiB disk (write-bound: no two are adjacent).
qemu-img create -q -f qcow2 base.qcow2 2G
qemu-io -f qcow2 -c "write -P 1 0 64M" base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 2G
args=()
for ((i = 0; i < 5120; i++)); do
  args+=(-c "write -P $((i % 251)) $(((i * 2654435761 % 32768) * 65536)) 64k")
done
qemu-io -f qcow2 "${args[@]}" top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
top_sum=$(sha256sum <top.qcow2)
cp --sparse=always base.qcow2 base.orig

# Calibrate: how long does an uninterrupted merge take?
"$QCOMMIT" merge top.qcow2 --budget off --output=json >cal.json
T=$(jq -r 'select(.event == "result") | ."total-seconds"' cal.json)
echo "uninterrupted merge: $T s"
cp --sparse=always base.orig base.qcow2

runs=0 killed=0 resumed=0 leaks_seen=0 fractions=()
while ((killed < KILLS)); do
  # Kill target: a fraction of the copy, spread (stratified) over [0, 1), plus jitter in time.
  f=$(awk -v k="$killed" -v n="$KILLS" -v r="$RANDOM" 'BEGIN { printf "%.3f", (k + r / 32768) / n }')
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >run.json 2>run.err &
  pid=$!
  runs=$((runs + 1))
  t0=$(date +%s.%N)
  deadline=$(awk -v t="$T" -v f="$f" 'BEGIN { printf "%.4f", t * f }')
  # Kill when progress reaches the fraction, or when its share of the calibrated time is up.
  while kill -0 "$pid" 2>/dev/null; do
    done_frac=$(jq -rs '[.[] | select(.event == "progress" and .phase == "copy" and .total > 0) | .done / .total] | last // 0' run.json 2>/dev/null || echo 0)
    now=$(date +%s.%N)
    if awk -v d="$done_frac" -v f="$f" -v n="$now" -v t0="$t0" -v dl="$deadline" \
        'BEGIN { exit !(d >= f || n - t0 >= dl) }'; then
      break
    fi
    sleep 0.002
  done
  if kill -9 "$pid" 2>/dev/null; then
    wait "$pid" 2>/dev/null || true
    pid=
    killed=$((killed + 1))
    fractions+=("$f")
    rc=0
    qemu-img check --output=json base.qcow2 >chk.json 2>/dev/null || rc=$?
    c=$(jq '.corruptions // 0' chk.json 2>/dev/null || echo "?") l=$(jq '.leaks // 0' chk.json 2>/dev/null || echo "?")
    [[ $c == 0 && ($rc == 0 || $rc == 3) ]] || fail "after kill $killed (fraction $f): qemu-img check exit $rc, corruptions $c"
    ((l > 0)) && leaks_seen=$((leaks_seen + 1))
  else
    # It finished before the kill: start over from the original BASE to keep killing.
    wait "$pid" || fail "a merge run failed: $(cat run.err)"
    pid=
    cp --sparse=always base.orig base.qcow2
    rm -f .base.qcow2.qcommit-merge
  fi
  if grep -q '"resumed-from"' run.json 2>/dev/null; then resumed=$((resumed + 1)); fi
done
"$QCOMMIT" merge top.qcow2 --budget off --output=json >final.json 2>final.err || fail "final run failed: $(cat final.err)"
echo "final run: $(jq -c 'select(.event == "result") | {"resumed-from", "leaks-repaired", copied, "total-seconds"}' final.json)"
echo "kills: $killed at fractions ${fractions[*]}; runs $runs; $leaks_seen kills left leaked clusters"
qemu-img compare -f raw -F qcow2 view.raw base.qcow2 >/dev/null || fail "BASE differs from TOP's view"
qemu-img check -q base.qcow2 || fail "qemu-img check BASE not clean after the final run"
[[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP was modified"
[[ -e .base.qcow2.qcommit-merge ]] && fail "checkpoint left behind"
if ((${#failures[@]})); then printf '  %s\n' "${failures[@]}" >&2; exit 1; fi
echo "merge.kill_resume: OK"
