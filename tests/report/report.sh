#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# report.html: a traced merge's HTML report renders in headless Chromium: a header naming TOP,
# BASE, the budget, the start (UTC) and the duration; the budget as a line on the latency plot at
# the y its axis gives the budget; pacing rate beside achieved throughput; bytes done; the window
# on a plot of its own; totals equal to the bytes the merge wrote (96 MiB, qemu-img map of BASE),
# the last tick included. A trace without the merge's "# key=value" lines (older qcommit) still
# renders, its header saying "not recorded". ~8 s.
# usage: report.sh QCOMMIT
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib/test.sh"
QCOMMIT=$(realpath "$1")
setup report.html
command -v chromium >/dev/null || fail "chromium is not installed (scripts/bootstrap installs it)"
new base.qcow2 256M -f qcow2
new top.qcow2 256M -f qcow2 -b base.qcow2 -F qcow2
qio -f qcow2 top.qcow2 'write -P 3 0 96M'
written=$((96 * 1024 * 1024))
"$QCOMMIT" merge top.qcow2 --budget 20ms --trace trace.csv >/dev/null
(($(grep -vc '^#' trace.csv) >= 3)) || fail "trace has too few rows"
mapped=$(qemu-img map --output=json base.qcow2 | jq '[.[] | select(.data) | .length] | add')
[[ $mapped == "$written" ]] || fail "BASE maps $mapped data bytes, $written were written"
"$QCOMMIT" report trace.csv -o report.html >/dev/null
# The summary's percentiles are the product's one definition (throttle/percentile.h): the nearest
# rank (ceil(n * p / 100)) of the trace's fg_max_ms column.
fg_sorted=$(grep -v '^#' trace.csv |
  awk -F, 'NR == 1 {for (i = 1; i <= NF; i++) if ($i == "fg_max_ms") c = i; next} {print $c + 0}' | sort -g)
nearest_rank() {
  awk -v p="$1" '{v[NR] = $1} END {r = int((NR * p + 99) / 100); if (r < 1) r = 1; printf "%.3f\n", v[r]}' <<<"$fg_sorted"
}
summary=$("$QCOMMIT" report trace.csv --output=json)
for p in 50 99 100; do
  key=$([ "$p" = 100 ] && echo max || echo "p$p")
  got=$(jq -r --arg k "$key" '."probe-ms"[$k]' <<<"$summary")
  want=$(nearest_rank "$p")
  awk -v g="$got" -v w="$want" 'BEGIN {exit !(g - w < 0.0005 && w - g < 0.0005)}' ||
    fail "report's probe $key is $got ms, the nearest rank of the trace's fg_max_ms is $want ms"
done
# The same trace as an older qcommit wrote it: no "# key=value" lines before the header.
grep -v '^#' trace.csv >old.csv
old_done=$(awk -F, 'NR == 1 {for (i = 1; i <= NF; i++) if ($i == "bytes_done") c = i; next} {d = $c} END {print d}' old.csv)
"$QCOMMIT" report old.csv -o old.html >/dev/null
# Bad input: a file that is not a trace gets a one-line error naming it.
echo "a,b" >bad.csv
if "$QCOMMIT" report bad.csv -o bad.html 2>err.txt; then fail "report accepted a non-trace"; fi
grep -q "bad.csv" err.txt || fail "error does not name the file: $(cat err.txt)"
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --user-data-dir="$work/profile" --window-size=1000,1800)
for html in report old; do timeout 120 chromium "${flags[@]}" --dump-dom "file://$work/$html.html" >$html-dom.html 2>/dev/null; done
python3 "$here/check_dom.py" report-dom.html new top.qcow2 base.qcow2 20 "$mapped"
python3 "$here/check_dom.py" old-dom.html old "$old_done"
timeout 120 chromium "${flags[@]}" --screenshot="$work/shot.png" "file://$work/report.html" >/dev/null 2>&1
# probe latency, budget line, pacing rate, throughput, window: each drawn on the screenshot
read -r red orange green blue purple < <(python3 "$here/png_colors.py" shot.png c0392b e67e22 27ae60 1f6fb2 8e44ad | xargs)
echo "rendered: probe-latency pixels=$red, budget=$orange, rate=$green, throughput=$blue, window=$purple"
for n in "$red" "$orange" "$green" "$blue" "$purple"; do
  ((n > 100)) || fail "a plot did not render (pixels: $red $orange $green $blue $purple)"
done
echo "report.html: OK"
