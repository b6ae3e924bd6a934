#!/usr/bin/env bash
# report.html: a traced merge's HTML report renders its plots in headless Chromium.
# usage: report.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-report.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
command -v chromium >/dev/null || { echo "chromium is not installed (scripts/bootstrap installs it)" >&2; exit 1; }
qemu-img create -q -f qcow2 base.qcow2 256M
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2
qemu-io -c 'write -P 3 0 96M' top.qcow2 >/dev/null
"$QCOMMIT" merge top.qcow2 --budget 20ms --trace trace.csv >/dev/null
[[ $(wc -l <trace.csv) -ge 3 ]] || { echo "trace has too few rows" >&2; exit 1; }
"$QCOMMIT" report trace.csv -o report.html >/dev/null
# Bad input: a file that is not a trace gets a one-line error naming it.
echo "a,b" >bad.csv
if "$QCOMMIT" report bad.csv -o bad.html 2>err.txt; then echo "report accepted a non-trace" >&2; exit 1; fi
grep -q "bad.csv" err.txt || { echo "error does not name the file: $(cat err.txt)" >&2; exit 1; }
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --user-data-dir="$work/profile" --window-size=1000,1000)
timeout 120 chromium "${flags[@]}" --dump-dom "file://$work/report.html" >dom.html 2>/dev/null
plots=$(grep -o '<svg id="[a-z]*" class="plot"' dom.html | wc -l)
series=$(grep -o '<polyline class="series"' dom.html | wc -l)
[[ $plots == 2 && $series == 4 ]] || { echo "DOM has $plots plots and $series series, expected 2 and 4" >&2; exit 1; }
timeout 120 chromium "${flags[@]}" --screenshot="$work/shot.png" "file://$work/report.html" >/dev/null 2>&1
read -r red green < <(python3 "$here/png_colors.py" shot.png c0392b 27ae60 | xargs)
echo "rendered: probe-latency pixels=$red, rate pixels=$green"
[[ $red -gt 100 && $green -gt 100 ]] || { echo "the plots did not render (red=$red green=$green)" >&2; exit 1; }
echo "report.html: OK"
