#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.progress: `qcommit merge` into a log file (stderr not a terminal) writes a plain progress
# line at least every 10 s, each with the bytes done and total, the rate and the ETA; governed,
# with the guests' p99 latency; --output=json has progress events with the same members. The
# merges are paced slow (--max-rate) so that they last: 96 MiB at 8 MiB/s (~12 s, --budget off)
# and 20 and 8 MiB at most 4 MiB/s under a budget. ~35 s.
# usage: progress.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.progress
uri=test:///default
max_gap=10

# stamp: each line of stdin prefixed with the seconds since the epoch when it arrived.
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }
# spread NAME BASE N P: NAME over BASE with N MiB of data (pattern P) in 1 MiB extents, a hole after
# each (the engine reports progress per extent).
spread() {
  local io=() i
  for ((i = 0; i < $3; i++)); do io+=("write -P $4 $((i * 2))M 1M"); done
  overlay "$1" "$2" "${io[@]}"
}

# (1) --budget off, 96 MiB at 8 MiB/s, stderr into a pipe that stamps each line.
image base.qcow2 192M
spread top.qcow2 base.qcow2 96 3
start=$(date +%s.%N)
{ "$QCOMMIT" merge top.qcow2 --budget off --max-rate 8M 2>&1 >out.txt </dev/null | stamp >err.txt; } ||
  fail "(1) merge failed: $(cat out.txt err.txt)"
end=$(date +%s.%N)
grep -q "^merged " out.txt || fail "(1) no result line: $(cat out.txt)"
grep -F ' qcommit: copy ' err.txt >lines.txt || fail "(1) no progress line in the log: $(cat err.txt)"
n=$(wc -l <lines.txt)
((n >= 2)) || fail "(1) $n progress line(s) in a $(echo "$end - $start" | bc) s merge: $(cat err.txt)"
# Each line: bytes of total (percent), rate, ETA.
while read -r _ line; do
  [[ $line =~ ^qcommit:\ copy\ [0-9.]+\ [KMG]?i?B\ of\ 96\.0\ MiB\ \([0-9.]+%\),\ [0-9.]+\ [KMG]?i?B/s,\ ETA\ ([0-9]+s|unknown) ]] ||
    fail "(1) progress line without bytes, rate and ETA: '$line'"
done <lines.txt
grep -qE ", ETA [0-9]+s, " lines.txt || fail "(1) no progress line with an ETA: $(cat lines.txt)"
# No gap over 10 s: from the start to the first line, between lines, from the last to the end.
prev=$start
while read -r t _; do
  (($(echo "$t - $prev <= $max_gap" | bc))) || fail "(1) $(echo "$t - $prev" | bc) s without a progress line: $(cat err.txt)"
  prev=$t
done < <(cat lines.txt; echo "$end end")
echo "(1) $n progress lines in $(echo "$end - $start" | bc) s"

# (2) Governed (a budget, the probe beside BASE): the lines name the guests' p99; the JSON
# progress events carry bytes, rate, ETA and guest-p99-ms.
image base2.qcow2 64M
spread top2.qcow2 base2.qcow2 20 4
"$QCOMMIT" merge top2.qcow2 --budget 50ms --max-rate 4M -c "$uri" >out2.txt 2>err2.txt </dev/null ||
  fail "(2) merge failed: $(cat err2.txt)"
grep -qE "^qcommit: copy .*, guests' p99 [0-9.]+ ms$" err2.txt || fail "(2) no progress line with the guests' p99: $(cat err2.txt)"
spread top3.qcow2 base2.qcow2 8 5
"$QCOMMIT" merge top3.qcow2 --budget 50ms --max-rate 4M -c "$uri" --output=json >out3.json 2>err3.txt </dev/null ||
  fail "(3) JSON merge failed: $(cat err3.txt)"
jq -e -s '[.[] | select(.event == "progress" and .phase == "copy")] | length >= 3' out3.json >/dev/null ||
  fail "(3) fewer than 3 JSON progress events: $(cat out3.json)"
jq -e -s '[.[] | select(.event == "progress" and .phase == "copy" and .done != null and .total == 8388608 and .rate != null)] | length >= 3' out3.json >/dev/null ||
  fail "(3) progress events lack done/total/rate: $(jq -c 'select(.event == "progress")' out3.json | head -3)"
jq -e -s '[.[] | select(.event == "progress" and ."guest-p99-ms" != null)] | length >= 1' out3.json >/dev/null ||
  fail "(3) no progress event with guest-p99-ms: $(jq -c 'select(.event == "progress")' out3.json | head -5)"
[[ ! -s err3.txt ]] || fail "(3) --output=json wrote to stderr: $(cat err3.txt)"
echo "cli.progress: OK"
