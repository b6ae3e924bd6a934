#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.grammar: one grammar of sizes, rates and durations (common/units.h), with the same bounds,
# for every option of merge, plan and live and every key of the configuration; each value checked
# whatever the other options are; and what the user asked for that cannot be done (a libvirt URI
# named with -c that does not connect, a --trace file that cannot be created) refused before
# anything is written. Each refusal: one line on stderr, exit 2 for a usage error (1 for the
# configuration file or the connection), BASE and TOP unchanged. ~5 s.
# usage: grammar.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCOMMITD=$(realpath "$2")
setup cli.grammar
uri=test:///default

image base.qcow2 16M
overlay top.qcow2 base.qcow2 'write -P 7 0 1M'
# The images and the directory listing (the configuration and try's out.txt, err.txt aside).
sums() { md5sum base.qcow2 top.qcow2; ls | grep -vE '\.conf$|^(out|err)\.txt$'; }
sums >before.txt
unchanged() { sums | cmp -s - before.txt || fail "$1 the images or the directory changed"; }
# refused WANT_RC TEXT ARGS...: qcommit ARGS exits WANT_RC with one line containing TEXT on
# stderr (fails_with), and the images and the directory are as before.
refused() { fails_with "$1" "$2" "$QCOMMIT" "${@:3}"; unchanged "qcommit ${*:3}: refused, but"; }
# accepted ARGS...: qcommit ARGS exits 0 (a dry run or a plan: nothing written).
accepted() { try "$QCOMMIT" "$@"; ((rc == 0)) || fail "qcommit $*: refused: $(cat err.txt)"; unchanged "qcommit $*:"; }

# --- durations: a unit, more than 0, a budget at most 60 s, --wait may be 0 --------------------
for cmd in "merge top.qcow2 --dry-run" "plan top.qcow2" "live vm1 vda --dry-run"; do
  read -ra args <<<"$cmd" && set -- "${args[@]}"
  refused 2 "--budget 90s: must be at most 60s" "$@" --budget 90s -c "$uri"
  refused 2 "--budget 61s: must be at most 60s" "$@" --budget 61s -c "$uri"
  refused 2 "--budget 0: a duration needs a unit, and must be more than 0" "$@" --budget 0 -c "$uri"
  refused 2 "--budget 0ms: must be more than 0" "$@" --budget 0ms -c "$uri"
  refused 2 "--budget 20: a duration needs a unit: 20ms or 20s" "$@" --budget 20 -c "$uri"
done
accepted merge top.qcow2 --dry-run --budget 60s -c "$uri"
accepted plan top.qcow2 --budget 60s -c "$uri"
for cmd in "merge top.qcow2 --dry-run --budget off" "live vm1 vda --dry-run"; do
  read -ra args <<<"$cmd" && set -- "${args[@]}"
  refused 2 "--wait 20: a duration needs a unit: 20ms or 20s" "$@" --wait 20 -c "$uri"
  refused 2 "--wait soon: bad duration 'soon'" "$@" --wait soon -c "$uri"
done
for wait in 0 0s 1.5s; do accepted merge top.qcow2 --dry-run --budget off --wait $wait; done
refused 2 "--budget off: bad duration 'off'" live vm1 vda --dry-run --budget off -c "$uri"

# --- sizes and rates: the same grammar for --max-rate and plan --rate ---------------------------
for opt in "merge top.qcow2 --dry-run --budget off --max-rate" "plan top.qcow2 --budget off --rate"; do
  read -ra args <<<"$opt" && set -- "${args[@]}"
  name=${*: -1}
  refused 2 "$name 1X: bad size unit in '1X'" "$@" 1X
  refused 2 "$name fast: bad size 'fast'" "$@" fast
  refused 2 "$name -5M: bad size '-5M'" "$@" -5M
  refused 2 "$name 1e3: bad size unit" "$@" 1e3
  refused 2 "$name 0: at least 4K (bytes per second)" "$@" 0
  refused 2 "$name 2T: at most 1T (bytes per second)" "$@" 2T
  for rate in 50M 50M/s 50MiB/s; do accepted "$@" $rate; done
done
refused 2 "--rate and --measure exclude each other" plan top.qcow2 --rate 80M --measure --budget off
refused 2 "--max-rate 32K: at least 64K for a block job" live vm1 vda --dry-run --max-rate 32K -c "$uri"

# --- every value checked, whatever the other options --------------------------------------------
refused 2 "--probe must be 'on' or 'off', not 'bogus'" merge top.qcow2 --budget off --probe bogus
refused 2 "--cotenants must be 'on' or 'off', not 'maybe'" merge top.qcow2 --budget off --cotenants maybe
refused 2 "--cotenants must be 'on' or 'off', not 'maybe'" merge top.qcow2 --dry-run --cotenants maybe -c "$uri"
refused 2 "--output must be 'human' or 'json', not 'xml'" merge top.qcow2 --budget off --output xml
refused 2 "--output must be 'human' or 'json', not 'xml'" plan top.qcow2 --budget off --output xml
refused 2 "--budget 90s: must be at most 60s" plan top.qcow2 --budget 90s --rate 10M
refused 2 "--budget 5: a duration needs a unit" merge nosuch.qcow2 --budget 5

# --- the configuration: the same grammar and bounds for qcommit and qcommitd ---------------------
conf() { printf '%b' "$1" >grammar.conf; }
for case in '[default]\nbudget=90s\n|[default]: budget must be at most 60s' \
  '[default]\nbudget=0ms\n|[default]: budget must be more than 0' \
  '[default]\nbudget=20\n|[default] budget: a duration needs a unit: 20ms or 20s' \
  '[default]\nfloor=1X\n|[default] floor: bad size unit' \
  '[default]\nfloor=1K\n|[default]: floor must be >= 4K' \
  '[default]\nceiling=2T\n|[default]: ceiling must be <= 1T' \
  '[pool:x]\nprobe=20\n|[pool:x] probe: a duration needs a unit: 20ms or 20s'; do
  conf "${case%%|*}"
  want=${case#*|}
  refused 1 "grammar.conf: $want" plan top.qcow2 --config grammar.conf -c "$uri"
  refused 1 "grammar.conf: $want" merge top.qcow2 --config grammar.conf -c "$uri"
  qcommitd_refuses grammar.conf "$want"
done
conf '[default]\nbudget=60s\nfloor=4K\nceiling=1T\n'
accepted plan top.qcow2 --config grammar.conf -c "$uri"
rm -f grammar.conf

# --- what was asked for and cannot be done: refused before anything is written -----------------
refused 1 "qemu:///sytem" merge top.qcow2 -c qemu:///sytem
refused 1 "qemu:///sytem" merge top.qcow2 --connect qemu:///sytem --dry-run
refused 1 "qemu:///sytem" plan top.qcow2 -c qemu:///sytem
refused 1 "/nonexistent/t.csv" merge top.qcow2 -c "$uri" --probe off --trace /nonexistent/t.csv
echo "cli.grammar: OK"
