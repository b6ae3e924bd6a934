#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.conventions: qcommit spells what qemu-img and other tools spell the same way.
#   check: -r leaks|all as qemu-img check takes it (and --repair), the verdict lines qemu-img
#   check prints (clean, leaked, corrupt, repaired: every line of standard output but the image
#   end offset, which differs after a repair because qemu-img truncates the file);
#   `qcommit help merge` is `qcommit merge --help`; `qcommit --version`;
#   `report` of a missing file names the reason (errno text); its time axis on a 0.25 s trace has
#   labels that all differ, evenly spaced;
#   a dry run's zeros add up to the merge's (written + already zeros); plan --measure names its
#   scratch file;
#   bash completion: values after --output= and --repair=, none but durations for live --budget,
#   the commands after `help`. ~3 s.
# usage: conventions.sh QCOMMIT COMPLETION
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
COMPLETION=$(realpath "$2")
PATCH=$(realpath "$(dirname "$0")/../hostile/qcow2_patch.py")
setup cli.conventions

# --- check: the verdict and -r, against qemu-img check ------------------------------------------
# Two data clusters (64k, the default) in a 4M image: clean, leaky, corrupt.
for name in clean leaky corrupt; do image $name.qcow2 4M 'write -P 1 0 64k' 'write -P 2 64k 64k'; done
python3 "$PATCH" leaky.qcow2 l2-entry 1 0 >/dev/null
python3 "$PATCH" corrupt.qcow2 refcount-of 0 0 >/dev/null
# same_verdict NAME ARGS...: qcommit check and qemu-img check ARGS on copies of NAME: the same
# exit status and the same standard output but the image end offset.
same_verdict() {
  local name=$1 rc_q=0 rc_i=0
  shift
  cp "$name.qcow2" q.qcow2 && cp "$name.qcow2" i.qcow2
  "$QCOMMIT" check "$@" q.qcow2 >q.out 2>q.err || rc_q=$?
  qemu-img check "$@" i.qcow2 >i.out 2>i.err || rc_i=$?
  [[ $rc_q == "$rc_i" ]] || fail "check $* $name: exit $rc_q, qemu-img $rc_i: $(cat q.out q.err)"
  diff <(grep -v '^Image end offset' i.out) <(grep -v '^Image end offset' q.out) >diff.txt ||
    fail "check $* $name: the output differs from qemu-img check's (< qemu-img, > qcommit): $(cat diff.txt)"
  rm -f q.qcow2 i.qcow2 q.out i.out q.err i.err
}
# shellcheck disable=SC2086  # NAME, then the options
for v in clean leaky corrupt "leaky -r leaks" "leaky -r all" "clean -r leaks"; do same_verdict $v; done
# --repair stays, as before.
cp leaky.qcow2 r.qcow2
"$QCOMMIT" check --repair r.qcow2 >r.out 2>&1 || fail "check --repair: $(cat r.out)"
qemu-img check r.qcow2 >/dev/null || fail "check --repair left the leak"
try "$QCOMMIT" check -r leaky.qcow2
[[ $rc == 1 ]] && grep -qF -- "-r needs 'leaks' or 'all'" err.txt || fail "check -r without a value: exit $rc: $(cat err.txt)"

# --- help, version, report ----------------------------------------------------------------------
"$QCOMMIT" help merge >help.txt || fail "qcommit help merge failed"
"$QCOMMIT" merge --help >merge-help.txt
cmp -s help.txt merge-help.txt || fail "qcommit help merge differs from qcommit merge --help: $(head -3 help.txt)"
grep -q '^usage: qcommit merge' help.txt || fail "qcommit help merge: $(head -3 help.txt)"
try "$QCOMMIT" help nosuch
[[ $rc == 2 ]] && grep -qF "unknown command 'nosuch'" err.txt || fail "qcommit help nosuch: exit $rc: $(cat err.txt)"
"$QCOMMIT" --version | grep -qE '^qcommit [0-9]+\.[0-9]+' || fail "qcommit --version: $("$QCOMMIT" --version)"
fails_with 1 "nope.csv: cannot open: No such file or directory" "$QCOMMIT" report nope.csv
# The report's time axis of a short trace (its first 0.25 s): labels that all differ, evenly spaced.
image tb.qcow2 16M
overlay tt.qcow2 tb.qcow2 'write -P 1 0 4M'
"$QCOMMIT" merge tt.qcow2 --budget 20ms --cotenants off --trace trace.csv >/dev/null || fail "traced merge failed"
awk -F, '!/^[0-9]/ || $1 <= 0.25' trace.csv >short.csv
(($(grep -c '^[0-9]' short.csv) >= 2)) || fail "the trace has fewer than 2 rows in its first 0.25 s: $(cat trace.csv)"
"$QCOMMIT" report short.csv -o short.html >/dev/null || fail "report short.csv failed"
ticks=$(grep -o '<text class="xtick"[^>]*>[^<]*' short.html | sed 's/.*>//' | awk '$1 == 0 && NR > 1 {print ""} {printf "%s ", $1}')
[[ -n $ticks ]] || fail "report: no time axis labels (class xtick) in short.html"
while read -r axis; do
  [[ $(tr ' ' '\n' <<<"$axis" | sed '/^$/d' | sort -u | wc -l) == $(wc -w <<<"$axis") ]] ||
    fail "report: time axis labels repeat: $axis"
  python3 -c 'import sys; v=[float(x) for x in sys.argv[1:]]; d=[b-a for a,b in zip(v,v[1:])]; sys.exit(0 if len(v) >= 3 and max(d)-min(d) < 1e-9 else 1)' $axis ||
    fail "report: time axis labels not evenly spaced (or fewer than 3): $axis"
done <<<"$ticks"

# --- the same words for the same bytes ----------------------------------------------------------
# A dry run's zeros are what must read as zeros; the merge's, those it wrote and those BASE
# already read as zeros: the two add up to the dry run's figure.
image zb.qcow2 16M 'write -P 9 4M 1M'
overlay zt.qcow2 zb.qcow2 'write -P 1 0 1M' 'write -z 2M 1M' 'write -z 4M 1M'
"$QCOMMIT" merge zt.qcow2 --dry-run --budget off >dry.txt
grep -qE "; 2\.0 MiB must read as zeros" dry.txt || fail "dry run: no '2.0 MiB must read as zeros': $(cat dry.txt)"
"$QCOMMIT" merge zt.qcow2 --budget off >merged.txt
grep -qE "1\.0 MiB of zeros written \(1\.0 MiB already read as zeros\)" merged.txt ||
  fail "merge: the zeros written and already there do not add up to the dry run's 2.0 MiB: $(cat merged.txt)"
# plan --measure says where its rehearsal writes.
image pb.qcow2 16M
overlay pt.qcow2 pb.qcow2 'write -P 1 0 1M'
"$QCOMMIT" plan pt.qcow2 --measure --budget off >plan.txt
head -n 1 plan.txt | grep -qF "scratch file beside BASE" || fail "plan --measure: the first line does not name its scratch file: $(head -n 1 plan.txt)"
head -n 1 plan.txt | grep -qF "nothing written" && fail "plan --measure says 'nothing written': $(head -n 1 plan.txt)"

# --- bash completion ----------------------------------------------------------------------------
# complete_words LINE: what the completion offers for LINE (the cursor at its end), split as
# bash splits it (COMP_WORDBREAKS: '=' is a word of its own).
complete_words() {
  bash -c '
    . "$1"
    line=$2
    COMP_LINE=$line COMP_POINT=${#line}
    read -ra COMP_WORDS <<<"${line//=/ = }"
    [[ $line == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    _qcommit
    printf "%s\n" "${COMPREPLY[@]}"' _ "$COMPLETION" "$1"
}
# LINE|WORDS: the completion of LINE is exactly WORDS.
while IFS='|' read -r -u 3 line words; do
  got=$(complete_words "$line" | sort | tr '\n' ' ')
  want=$(tr ' ' '\n' <<<"$words" | sort | tr '\n' ' ')
  [[ $got == "$want" ]] || fail "completion of '$line': '$got', expected '$want'"
done 3<<'EOF'
qcommit merge top.qcow2 --output=|human json
qcommit merge top.qcow2 --output=j|json
qcommit merge top.qcow2 --output |human json
qcommit check --repair=|leaks all
qcommit check -r |leaks all
qcommit live vm1 vda --budget |10ms 20ms 50ms
qcommit merge top.qcow2 --budget |10ms 20ms 50ms off
qcommit help me|merge
EOF
echo "cli.conventions: OK"
