#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.max_rate: `qcommit merge --max-rate SIZE`, a per-run cap in bytes per second without a
# configuration file (like virsh blockcommit --bandwidth), in the one size grammar.
#   (1) --budget off --max-rate 8M: 24 MiB of data take at least 2.5 s (without the cap the same
#       merge takes a fraction of that here); the result equals TOP's view (qemu-img compare).
#   (2) with a budget: the policy line says "(--max-rate)", the ceiling is the cap, and no
#       controller tick in --trace paces above it; JSON: the policy event has "max-rate".
#   (3) refused with one line and exit 2: 0, below 4K, a bad unit.
# usage: max-rate.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.max_rate
uri=test:///default

# make_chain: base.qcow2 (64 MiB, some data) <- top.qcow2 (24 MiB of data), and TOP's view.
make_chain() {
  rm -f base.qcow2 top.qcow2 view.raw
  image base.qcow2 64M 'write -P 1 0 8M'
  overlay top.qcow2 base.qcow2 'write -P 2 4M 24M'
  qemu-img convert -O raw top.qcow2 view.raw
}
# merged WHAT OUT ARGS...: TOP of a fresh chain merged with ARGS (its output in OUT, the seconds
# it took in $secs); BASE then equals TOP's view.
merged() {
  local what=$1 out=$2 t0
  shift 2
  make_chain
  t0=$(date +%s.%N)
  "$QCOMMIT" merge top.qcow2 -c "$uri" "$@" >"$out" 2>&1 || fail "$what merge failed: $(cat "$out")"
  secs=$(echo "$(date +%s.%N) - $t0" | bc)
  qemu-img compare -q base.qcow2 view.raw || fail "$what: BASE differs from TOP's view"
}

# (1) Without a budget: paced at the cap alone.
merged "(1) uncapped" free.txt --budget off
free=$secs
merged "(1) capped" capped.txt --budget off --max-rate 8M
capped=$secs
echo "(1) 24 MiB: ${free} s without a cap, ${capped} s at --max-rate 8M"
grep -qE "at most 8(\.0)? MiB/s \(--max-rate\)" capped.txt || fail "(1) no cap line: $(cat capped.txt)"
(($(echo "$capped >= 2.5" | bc))) || fail "(1) 24 MiB at 8 MiB/s took ${capped} s (< 2.5 s): not capped"

# (2) With a budget: the cap is the controller's ceiling.
merged "(2)" gov.txt --budget 50ms --max-rate 4M/s --trace t.csv
grep -qE "rate .* \.\. 4(\.0)? MiB/s \(--max-rate\)" gov.txt || fail "(2) the policy line does not show the cap: $(cat gov.txt)"
top_rate=$(awk -F, '/^#/ {next} !h {h = 1; for (i = 1; i <= NF; i++) if ($i == "rate_bytes_per_s") c = i; next} $c > m {m = $c} END {printf "%.0f", m}' t.csv)
echo "(2) largest paced rate in the trace: $top_rate bytes/s"
[[ -n $top_rate ]] && ((top_rate > 0 && top_rate <= 4 * 1024 * 1024)) || fail "(2) paced at $top_rate bytes/s, above the 4 MiB/s cap"
make_chain
"$QCOMMIT" merge top.qcow2 --max-rate 6M -c "$uri" --output=json >gov.json 2>gov.err || fail "(2) JSON merge failed: $(cat gov.err)"
jq -se 'map(select(.event == "policy"))[0] | .["max-rate"] == 6291456 and .ceiling == 6291456' gov.json >/dev/null ||
  fail "(2) the JSON policy event lacks max-rate/ceiling 6291456: $(jq -c 'select(.event == "policy")' gov.json)"

# (3) Refused: one line, exit 2.
for bad in 0 1K 12Q; do fails_with 2 "" "$QCOMMIT" merge top.qcow2 --max-rate "$bad" -c "$uri"; done
echo "cli.max_rate: OK"
