#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.subcommands: every subcommand `qcommit --help` lists has `--help` with examples and an
# `--output=json` whose output is valid JSON (one document, or JSON lines for the streaming
# commands merge and live), checked with python3 -m json.tool and jq. A subcommand added to the
# list without a case here fails the test. libvirt-facing commands use libvirt's test driver
# (test:///FILE: a running domain "vm one" whose disk has a backing chain), no libvirtd needed.
# usage: cli-subcommands.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCOMMITD=$(realpath "$2")
setup cli.subcommands

# One JSON document on stdout.
json_doc() {  # json_doc NAME FILE
  python3 -m json.tool "$2" >/dev/null || fail "$1: not one JSON document: $(head -c 300 "$2")"
  [[ $(jq -s length "$2") == 1 ]] || fail "$1: more than one JSON value"
}
# A bad --output value is a usage error (exit 2; check: 1, as qemu-img check) before anything
# runs, never ignored.
bad_output() {  # bad_output CMD ARGS...
  local rc=0 want=2
  [[ $1 == check ]] && want=1
  "$QCOMMIT" "$@" --output=xml >/dev/null 2>bad.err </dev/null || rc=$?
  [[ $rc == "$want" ]] || fail "$1 --output=xml: exit $rc, expected $want"
  grep -q -- 'output' bad.err || fail "$1 --output=xml: the error does not name --output: $(cat bad.err)"
}
# JSON lines: every line one JSON value.
json_lines() {  # json_lines NAME FILE
  [[ -s $2 ]] || fail "$1: no output"
  while IFS= read -r line; do
    printf '%s' "$line" | python3 -m json.tool >/dev/null || fail "$1: line is not JSON: $line"
  done <"$2"
  [[ $(jq -s length "$2") == $(wc -l <"$2") ]] || fail "$1: one JSON value per line expected"
}

qemu-img create -q -f qcow2 base.qcow2 64M
qemu-io -c 'write -P 1 0 4M' base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2
qemu-io -c 'write -P 2 1M 2M' top.qcow2 >/dev/null
for n in m r; do
  qemu-img create -q -f qcow2 $n-base.qcow2 64M
  qemu-img create -q -f qcow2 -b $n-base.qcow2 -F qcow2 $n-top.qcow2
  qemu-io -c 'write -P 3 0 16M' $n-top.qcow2 >/dev/null
done
cat >node.xml <<EOF
<node>
$(test_domain "vm one" "    <devices>
$(file_disk vda virtio "$work/top.qcow2" "$work/base.qcow2")
    </devices>")
</node>
EOF
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
      rc=0; "$QCOMMIT" "$cmd" </dev/null >/dev/null 2>noarg.err || rc=$?
      [[ $rc != 0 && $(wc -l <noarg.err) == 1 ]] || fail "$cmd without its argument: exit $rc: $(cat noarg.err)"
      grep -qE "missing [A-Z_.]+ " noarg.err || fail "$cmd without its argument: $(cat noarg.err)"
      grep -q "the option '--" noarg.err && fail "$cmd without its argument: $(cat noarg.err)" ;;
  esac

  out=$cmd.json
  case $cmd in
    info) bad_output info top.qcow2
          "$QCOMMIT" info top.qcow2 --output=json >"$out"; json_doc "$cmd" "$out"
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
    map) bad_output map top.qcow2
         "$QCOMMIT" map top.qcow2 --output=json >"$out"; json_doc "$cmd" "$out"
         [[ $(jq -r 'type' "$out") == array ]] || fail "map: array expected" ;;
    check) bad_output check base.qcow2
           "$QCOMMIT" check base.qcow2 --output=json >"$out"; json_doc "$cmd" "$out"
           [[ $(jq -r '.corruptions' "$out") == 0 ]] || fail "check: corruptions in a fresh image"
           # Exit codes as qemu-img check's: a raw file has no checks (63), a bad option is 1.
           qemu-img create -q -f raw plain.raw 1M
           rc=0; "$QCOMMIT" check plain.raw 2>err.txt || rc=$?
           qrc=0; qemu-img check plain.raw >/dev/null 2>&1 || qrc=$?
           [[ $rc == 63 && $qrc == 63 ]] || fail "check of a raw file: exit $rc (qemu-img check: $qrc), want 63"
           grep -q "plain.raw: not a qcow2 image" err.txt || fail "check of a raw file: $(cat err.txt)"
           rc=0; "$QCOMMIT" check --bogus base.qcow2 2>/dev/null || rc=$?
           [[ $rc == 1 ]] || fail "check --bogus: exit $rc, want 1 (2 would read as corruptions)" ;;
    plan) bad_output plan top.qcow2
          "$QCOMMIT" plan top.qcow2 --output=json >"$out"; json_doc "$cmd" "$out"
          [[ $(jq -r '."data-bytes"' "$out") == $((2 << 20)) ]] || fail "plan: 2 MiB to copy expected"
          # --measure rehearses the copy beside BASE (paced by the budget, co-tenants from the
          # test driver): TOP's file is larger than its data, so the whole copy is rehearsed and
          # its time is the ETA; nothing is left beside BASE, BASE is unchanged.
          sum=$(md5sum <base.qcow2)
          "$QCOMMIT" plan top.qcow2 --measure --budget 20ms --connect "$uri" --output=json >"$out"
          json_doc "$cmd --measure" "$out"
          jq -e '."eta-source" == "measured" and .measured.bytes >= 2097152 and .measured.seconds > 0
                 and ."eta-low-seconds" <= ."eta-seconds" and ."eta-seconds" <= ."eta-high-seconds"
                 and .measured."paced-by" == "the budget 20ms" and .rate > 0' "$out" >/dev/null ||
            fail "plan --measure: $(cat "$out")"
          "$QCOMMIT" plan top.qcow2 --measure --budget off >"$cmd.txt"
          grep -q '^ETA: *about [0-9.]* s for the copy$' "$cmd.txt" || fail "plan --measure: $(cat "$cmd.txt")"
          grep -q 'paced by none' "$cmd.txt" || fail "plan --measure --budget off: $(cat "$cmd.txt")"
          [[ -z $(ls -A | grep qcommit-measure) ]] || fail "plan --measure left its scratch file"
          [[ $(md5sum <base.qcow2) == "$sum" ]] || fail "plan --measure changed BASE" ;;
    merge) bad_output merge m-top.qcow2 --budget off
           "$QCOMMIT" merge m-top.qcow2 --budget off --output=json >"$out"; json_lines "$cmd" "$out"
           [[ $(tail -1 "$out" | jq -r '.event + " " + (.copied | tostring)') == "result $((16 << 20))" ]] ||
             fail "merge: last line is not the result of a 16 MiB merge: $(tail -1 "$out")"
           "$QCOMMIT" merge --domain "vm off" --disk vda --uri "test://$work/node-off.xml" --dry-run \
             --output=json >"$out" 2>/dev/null
           json_lines "$cmd --dry-run" "$out"
           [[ $(jq -r 'select(.event == "dry-run") | .event + " " + .base' "$out") == "dry-run $work/base.qcow2" ]] ||
             fail "merge --dry-run: $(cat "$out")"
           # An unknown pool is named as such, not with libvirt's words for a malformed UUID.
           rc=0; "$QCOMMIT" merge --pool no-such-pool --vol x.qcow2 -c "$uri" --dry-run 2>err.txt || rc=$?
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
            rc=0; "$QCOMMIT" report trace.csv --output r.html 2>err.txt || rc=$?
            [[ $rc == 2 ]] && grep -q -- '-o/--html' err.txt || fail "report --output FILE: rc $rc, $(cat err.txt)" ;;
    demo) bad_output demo
          "$QCOMMIT" demo --output=json >"$out"; json_doc "$cmd" "$out"
          [[ $(jq -r '.passed' "$out") == true ]] || fail "demo: not passed"
          [[ $(jq -r '.merge.event' "$out") == result ]] || fail "demo: no merge result" ;;
    status) bad_output status --socket "$work/qcd.sock"
            spawn "$QCOMMITD" --uri "$uri" --socket "$work/qcd.sock" 2>qcd.log
            daemon=$!
            for _ in $(seq 50); do [[ -S $work/qcd.sock ]] && break; sleep 0.1; done
            "$QCOMMIT" status --socket "$work/qcd.sock" --output=json >"$out"; json_doc "$cmd" "$out"
            [[ $(jq -r '.ok' "$out") == true ]] || fail "status: ok is not true"
            stop "$daemon" ;;
    doctor) bad_output doctor --uri "$uri"
            "$QCOMMIT" doctor --uri "$uri" --socket "$work/none.sock" --output=json >"$out" 2>doctor.err ||
              [[ $? == 1 ]] || fail "doctor exited with $?"
            json_doc "$cmd" "$out" ;;
    live) bad_output live "vm one" vda --uri "$uri" --dry-run
          "$QCOMMIT" live "vm one" vda --uri "$uri" --dry-run --output=json >"$out"; json_lines "$cmd" "$out"
          [[ $(jq -r '.event + " " + .domain' "$out") == "plan vm one" ]] || fail "live: no plan event"
          (($(jq -r '.steps | length' "$out") >= 1)) || fail "live: plan without steps"
          # --overlay-dir: the fresh overlay goes there; a missing directory and the direct
          # strategy are refused.
          mkdir -p "$work/local"
          "$QCOMMIT" live "vm one" vda -c "$uri" --dry-run --overlay-dir "$work/local" --output=json >"$out"
          jq -r '.steps[0]' "$out" | grep -q "create external overlay $work/local/top.qcommit-" ||
            fail "live --overlay-dir: first step $(jq -c '.steps[0]' "$out")"
          rc=0; "$QCOMMIT" live "vm one" vda --uri "$uri" --dry-run --overlay-dir "$work/nowhere" 2>err.txt || rc=$?
          [[ $rc == 1 ]] && grep -q "$work/nowhere: not a directory" err.txt || fail "live --overlay-dir missing: rc $rc, $(cat err.txt)"
          rc=0; "$QCOMMIT" live "vm one" vda --uri "$uri" --dry-run --overlay-dir "$work/local" --strategy direct 2>err.txt || rc=$?
          [[ $rc == 2 ]] || fail "live --overlay-dir --strategy direct: rc $rc" ;;
    *) fail "new subcommand '$cmd': add its --output=json case to this test" ;;
  esac
  echo "$cmd: --help with examples, --output=json valid"
done
echo "cli.subcommands: OK (${#cmds[@]} subcommands)"
