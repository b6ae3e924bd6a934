#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.subcommands: every subcommand `qcommit --help` lists has `--help` with examples and an
# `--output=json` whose output is valid JSON (one document, or JSON lines for the streaming
# commands merge and live; python3 -m json.tool and jq). A subcommand without a case here fails
# the test. libvirt-facing commands use libvirt's test driver (test:///FILE: a running domain
# "vm one" whose disk has a backing chain).
# usage: cli-subcommands.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCOMMITD=$(realpath "$2")
setup cli.subcommands

# json_doc NAME FILE: one JSON document.
json_doc() {
  python3 -m json.tool "$2" >/dev/null || fail "$1: not one JSON document: $(head -c 300 "$2")"
  [[ $(jq -s length "$2") == 1 ]] || fail "$1: more than one JSON value"
}
# json_lines NAME FILE: JSON lines, every line one JSON value.
json_lines() {
  [[ -s $2 ]] || fail "$1: no output"
  while IFS= read -r line; do
    printf '%s' "$line" | python3 -m json.tool >/dev/null || fail "$1: line is not JSON: $line"
  done <"$2"
  [[ $(jq -s length "$2") == $(wc -l <"$2") ]] || fail "$1: one JSON value per line expected"
}
# bad_output CMD ARGS...: a bad --output value is a usage error (exit 2; check: 1, as qemu-img
# check) before anything runs, never ignored.
bad_output() {
  local want=2
  [[ $1 == check ]] && want=1
  try "$QCOMMIT" "$@" --output=xml
  [[ $rc == "$want" ]] || fail "$1 --output=xml: exit $rc, expected $want"
  grep -q -- 'output' err.txt || fail "$1 --output=xml: the error does not name --output: $(cat err.txt)"
}
# valid doc|lines CMD ARGS...: bad_output CMD ARGS, and `qcommit CMD ARGS --output=json` writes
# $out, one JSON document or JSON lines.
valid() {
  bad_output "${@:2}"
  "$QCOMMIT" "${@:2}" --output=json >"$out"
  "json_$1" "$2" "$out"
}

image base.qcow2 64M 'write -P 1 0 4M'
overlay top.qcow2 base.qcow2 'write -P 2 1M 2M'
for n in m r; do image $n-base.qcow2 64M; overlay $n-top.qcow2 $n-base.qcow2 'write -P 3 0 16M'; done
printf '<node>\n%s\n</node>\n' \
  "$(test_domain "vm one" "<devices>$(file_disk vda virtio "$work/top.qcow2" "$work/base.qcow2")</devices>")" >node.xml
uri="test://$work/node.xml"
# A shut-off domain for merge --domain --dry-run.
sed -e 's|<name>vm one</name>|<name>vm off</name>|' -e 's|</devices>|</devices><test:runstate>5</test:runstate>|' \
    node.xml >node-off.xml

[[ $("$QCOMMIT" --version) =~ ^qcommit\ [0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "qcommit --version: $("$QCOMMIT" --version)"
[[ $("$QCOMMITD" --version) =~ ^qcommitd\ [0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "qcommitd --version"
"$QCOMMITD" --help | grep -q '^examples:' || fail "qcommitd --help has no examples"
mapfile -t cmds < <("$QCOMMIT" --help | sed -n '/^commands:/,/^$/p' | awk '/^  [a-z]/ {print $1}')
((${#cmds[@]} >= 10)) || fail "qcommit --help lists only ${#cmds[@]} commands: ${cmds[*]}"
for cmd in "${cmds[@]}"; do
  # --help: exit 0, an examples section with at least one full command line, --output listed.
  "$QCOMMIT" "$cmd" --help >help.txt || fail "$cmd --help exited non-zero"
  grep -q '^examples:' help.txt || fail "$cmd --help has no examples"
  grep -q "^  qcommit $cmd" help.txt || fail "$cmd --help examples do not show 'qcommit $cmd ...'"
  grep -q -- '--output' help.txt || fail "$cmd --help does not mention --output"
  # One name for the libvirt connection across commands: -c/--connect (virsh's), --uri beside it.
  if grep -q -- '--uri' help.txt; then
    grep -qE -- '-c(, | \[ )--connect' help.txt || fail "$cmd --help has --uri but not -c/--connect"
  fi
  # Without its argument: one line that names it as the synopsis does (IMAGE, TOP), never
  # Program_options' "the option '--image' is required but missing".
  case $cmd in
    info|map|check|plan|report)
      try "$QCOMMIT" "$cmd"
      [[ $rc != 0 && $(wc -l <err.txt) == 1 ]] || fail "$cmd without its argument: exit $rc: $(cat err.txt)"
      grep -qE "missing [A-Z_.]+ " err.txt || fail "$cmd without its argument: $(cat err.txt)"
      grep -q "the option '--" err.txt && fail "$cmd without its argument: $(cat err.txt)" ;;
  esac

  out=$cmd.json
  case $cmd in
    info) valid doc info top.qcow2
          [[ $(jq -r '.chain | length' "$out") == 2 ]] || fail "info: chain of 2 expected"
          # qemu-img info's key names, with its values, where the meaning is the same; from
          # another directory too (the backing name joined to the image's directory as given).
          for img in top.qcow2 "$work/top.qcow2" ../"$(basename "$work")"/top.qcow2; do
            "$QCOMMIT" info "$img" --output=json >"$out"
            qemu-img info -U --output=json "$img" >qemu-info.json
            for key in backing-filename backing-filename-format full-backing-filename virtual-size \
                       cluster-size dirty-flag actual-size; do
              want=$(jq -c --arg k "$key" '.[$k]' qemu-info.json) got=$(jq -c --arg k "$key" '.chain[0][$k]' "$out")
              [[ $want != null && $got == "$want" ]] || fail "info $img: $key is $got, qemu-img info says $want"
            done
          done ;;
    map) valid doc map top.qcow2
         [[ $(jq -r 'type' "$out") == array ]] || fail "map: array expected" ;;
    check) valid doc check base.qcow2
           [[ $(jq -r '.corruptions' "$out") == 0 ]] || fail "check: corruptions in a fresh image"
           # Exit codes as qemu-img check's: a raw file has no checks (63), a bad option is 1.
           qemu-img create -q -f raw plain.raw 1M
           try "$QCOMMIT" check plain.raw
           qrc=0; qemu-img check plain.raw >/dev/null 2>&1 || qrc=$?
           [[ $rc == 63 && $qrc == 63 ]] || fail "check of a raw file: exit $rc (qemu-img check: $qrc), want 63"
           grep -q "plain.raw: not a qcow2 image" err.txt || fail "check of a raw file: $(cat err.txt)"
           try "$QCOMMIT" check --bogus base.qcow2
           [[ $rc == 1 ]] || fail "check --bogus: exit $rc, want 1 (2 would read as corruptions)" ;;
    plan) valid doc plan top.qcow2
          [[ $(jq -r '."data-bytes"' "$out") == $((2 << 20)) ]] || fail "plan: 2 MiB to copy expected"
          # --measure rehearses the copy beside BASE (paced by the budget, co-tenants from the
          # test driver): TOP's file is larger than its data, so the whole copy is rehearsed and
          # its time is the ETA; nothing is left beside BASE, BASE is unchanged.
          sum=$(md5sum <base.qcow2)
          "$QCOMMIT" plan top.qcow2 --measure --budget 20ms --connect "$uri" --output=json >"$out"; json_doc "$cmd --measure" "$out"
          jq -e '."eta-source" == "measured" and .measured.bytes >= 2097152 and .measured.seconds > 0
                 and ."eta-low-seconds" <= ."eta-seconds" and ."eta-seconds" <= ."eta-high-seconds"
                 and .measured."paced-by" == "the budget 20ms" and .rate > 0' "$out" >/dev/null ||
            fail "plan --measure: $(cat "$out")"
          "$QCOMMIT" plan top.qcow2 --measure --budget off >"$cmd.txt"
          grep -q '^ETA: *about [0-9.]* s for the copy$' "$cmd.txt" || fail "plan --measure: $(cat "$cmd.txt")"
          grep -q 'paced by none' "$cmd.txt" || fail "plan --measure --budget off: $(cat "$cmd.txt")"
          [[ -z $(ls -A | grep qcommit-measure) ]] || fail "plan --measure left its scratch file"
          [[ $(md5sum <base.qcow2) == "$sum" ]] || fail "plan --measure changed BASE" ;;
    merge) valid lines merge m-top.qcow2 --budget off
           [[ $(tail -1 "$out" | jq -r '.event + " " + (.copied | tostring)') == "result $((16 << 20))" ]] ||
             fail "merge: last line is not the result of a 16 MiB merge: $(tail -1 "$out")"
           "$QCOMMIT" merge --domain "vm off" --disk vda --uri "test://$work/node-off.xml" --dry-run --output=json >"$out" 2>/dev/null
           json_lines "$cmd --dry-run" "$out"
           [[ $(jq -r 'select(.event == "dry-run") | .event + " " + .base' "$out") == "dry-run $work/base.qcow2" ]] ||
             fail "merge --dry-run: $(cat "$out")"
           # An unknown pool is named as such, not with libvirt's words for a malformed UUID.
           try "$QCOMMIT" merge --pool no-such-pool --vol x.qcow2 -c "$uri" --dry-run
           [[ $rc == 1 ]] && grep -q "pool no-such-pool: no such storage pool" err.txt &&
             ! grep -qi uuid err.txt || fail "merge --pool no-such-pool: rc $rc, $(cat err.txt)" ;;
    report) "$QCOMMIT" merge r-top.qcow2 --budget 20ms --trace trace.csv >/dev/null 2>&1
            bad_output report trace.csv
            "$QCOMMIT" report trace.csv -o r.html --output=json >"$out"; json_doc "$cmd" "$out"
            [[ -s r.html ]] || fail "report: -o r.html wrote nothing"
            rows=$(($(grep -vc '^#' trace.csv) - 1))  # "# key=value" lines, then the header
            [[ $(jq -r '.rows' "$out") == "$rows" ]] || fail "report: rows $(jq .rows "$out") != $rows"
            done_col=$(grep -v '^#' trace.csv | head -1 | tr ',' '\n' | grep -nx bytes_done | cut -d: -f1)
            last_done=$(tail -1 trace.csv | cut -d, -f"$done_col")
            ((last_done > 0)) && [[ $(jq -r '."copied-bytes"' "$out") == "$last_done" ]] ||
              fail "report: copied-bytes $(jq '."copied-bytes"' "$out") != the trace's last bytes_done $last_done"
            [[ $(jq -r '."budget-ms"' "$out") == 20 && $(jq -r .top "$out") == */r-top.qcow2 ]] ||
              fail "report: the merge's parameters: budget-ms $(jq '."budget-ms"' "$out"), top $(jq .top "$out")"
            # Without -o: the summary only; --output FILE (the old spelling) is a usage error.
            "$QCOMMIT" report trace.csv --output=json >"$out"; json_doc "$cmd (no -o)" "$out"
            [[ $(jq -r '.html' "$out") == null ]] || fail "report: html should be null without -o"
            try "$QCOMMIT" report trace.csv --output r.html
            [[ $rc == 2 ]] && grep -q -- '-o/--html' err.txt || fail "report --output FILE: rc $rc, $(cat err.txt)" ;;
    demo) valid doc demo
          [[ $(jq -r '.passed' "$out") == true ]] || fail "demo: not passed"
          [[ $(jq -r '.merge.event' "$out") == result ]] || fail "demo: no merge result" ;;
    status) spawn "$QCOMMITD" --uri "$uri" --socket "$work/qcd.sock" 2>qcd.log; daemon=$!
            wait_until 5 test -S "$work/qcd.sock" || fail "status: qcommitd did not start: $(cat qcd.log)"
            valid doc status --socket "$work/qcd.sock"
            [[ $(jq -r '.ok' "$out") == true ]] || fail "status: ok is not true"
            stop "$daemon" ;;
    doctor) bad_output doctor --uri "$uri"
            "$QCOMMIT" doctor --uri "$uri" --socket "$work/none.sock" --output=json >"$out" 2>doctor.err ||
              [[ $? == 1 ]] || fail "doctor exited with $?"
            json_doc "$cmd" "$out" ;;
    live) valid lines live "vm one" vda --uri "$uri" --dry-run
          [[ $(jq -r '.event + " " + .domain' "$out") == "plan vm one" ]] || fail "live: no plan event"
          (($(jq -r '.steps | length' "$out") >= 1)) || fail "live: plan without steps"
          # --overlay-dir: the fresh overlay goes there; a missing directory and the direct
          # strategy are refused.
          mkdir -p "$work/local"
          "$QCOMMIT" live "vm one" vda -c "$uri" --dry-run --overlay-dir "$work/local" --output=json >"$out"
          jq -r '.steps[0]' "$out" | grep -q "create external overlay $work/local/top.qcommit-" ||
            fail "live --overlay-dir: first step $(jq -c '.steps[0]' "$out")"
          try "$QCOMMIT" live "vm one" vda --uri "$uri" --dry-run --overlay-dir "$work/nowhere"
          [[ $rc == 1 ]] && grep -q "$work/nowhere: not a directory" err.txt || fail "live --overlay-dir missing: rc $rc, $(cat err.txt)"
          try "$QCOMMIT" live "vm one" vda --uri "$uri" --dry-run --overlay-dir "$work/local" --strategy direct
          [[ $rc == 2 ]] || fail "live --overlay-dir --strategy direct: rc $rc" ;;
    *) fail "new subcommand '$cmd': add its --output=json case to this test" ;;
  esac
  echo "$cmd: --help with examples, --output=json valid"
done
echo "cli.subcommands: OK (${#cmds[@]} subcommands)"
