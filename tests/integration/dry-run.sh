#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.dry_run: a dry run writes nothing, on every path of every subcommand that takes --dry-run:
# before and after each run, the sha256 of every file under the image directory and a listing of
# every entry (type, size, mode, mtime, ctime; a directory's mtime moves when a file is created in
# it and removed again) must be identical. Paths (each with --dry-run):
#   merge TOP, alone, with --delete, --rebase CHILD, --base, a budget (the policy is resolved, no
#     governor: no probe file), --config;
#   merge --domain (a shut-off domain; one with an interrupted merge's journal in its definition)
#     and --pool/--vol, each with --delete (libvirt's test driver);
#   live DOMAIN DISK (test driver) and live --qmp SOCKET DISK (a real QEMU, paused);
# and the refusals that come with a dry run (--trace, a --rebase CHILD that is not TOP's child).
# The report of a plain dry run is checked too: what would be copied, rebased and deleted.
# usage: dry-run.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.dry_run
img=$work/img  # everything a dry run could write to; checked
run=$work/run  # this test's own outputs, sockets and logs
mkdir -p "$img" "$run"

state() {
  (cd "$img" && find . -printf '%p %y %s %m %T@ %C@\n' | LC_ALL=C sort &&
    find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum)
}
# dry EXPECTED_EXIT ARGS...: runs qcommit ARGS (stdout in $run/out, stderr in $run/err); its exit
# status must be EXPECTED_EXIT and nothing under $img may differ afterwards.
dry() {
  local want=$1 rc=0 name
  shift
  name="qcommit ${*//$work\//}"
  state >"$run/before"
  "$QCOMMIT" "$@" >"$run/out" 2>"$run/err" </dev/null || rc=$?
  state >"$run/after"
  diff -u "$run/before" "$run/after" >"$run/diff" || fail "$name: the dry run changed files:
$(cat "$run/diff")
stdout: $(head -c 600 "$run/out")"
  [[ $rc == "$want" ]] || fail "$name: exit $rc, expected $want: $(head -c 600 "$run/err")"
  echo "ok: $name (exit $rc, nothing written)"
}

cd "$img"
# chain BASE (64M) <- MID <- TOP (96M) <- CHILD, each with data of its own; OTHER, alone.
image base.qcow2 64M 'write -P 1 0 4M'
overlay mid.qcow2 base.qcow2 64M 'write -P 2 4M 1M'
overlay top.qcow2 mid.qcow2 96M 'write -P 3 1M 2M' 'write -z 8M 1M'
overlay child.qcow2 top.qcow2 'write -P 4 5M 64k'
image other.qcow2 64M
# A shut-off domain (d-*), a running one (l-*), a domain with an interrupted merge's journal
# (j-*), a dir pool over $img with a volume (p-*).
for p in d l j p; do image $p-base.qcow2 64M; overlay $p-top.qcow2 $p-base.qcow2 'write -P 5 0 3M'; done
printf '[default]\nbudget=9ms\n' >qcommitd.conf
disk() { file_disk vda virtio "$img/$1-top.qcow2" "$img/$1-base.qcow2"; }  # disk PREFIX
cat >"$run/node.xml" <<EOF
<node>
$(test_domain "vm off" "    <devices>$(disk d)</devices>
    <test:runstate>5</test:runstate>")
$(test_domain "vm one" "    <devices>$(disk l)</devices>")
$(test_domain "vm journal" "    <metadata>
      <qcommit:merge xmlns:qcommit='urn:qcommit:domain-merge' version='2' disk='vda' switch-source='yes' delete-merged='yes'>
        <qcommit:top>$img/j-top.qcow2</qcommit:top>
        <qcommit:base>$img/j-base.qcow2</qcommit:base>
        <qcommit:merged>$img/j-top.qcow2</qcommit:merged>
      </qcommit:merge>
    </metadata>
    <devices>$(disk j)</devices>
    <test:runstate>5</test:runstate>")
  <pool type='dir'>
    <name>imgpool</name>
    <uuid>35bb2ad9-388a-cdfe-461a-b8907f6e53fe</uuid>
    <target><path>$img</path></target>
    <volume type='file'>
      <name>p-top.qcow2</name>
      <capacity unit='M'>64</capacity>
      <target><path>$img/p-top.qcow2</path><format type='qcow2'/></target>
    </volume>
  </pool>
</node>
EOF
uri="test://$run/node.xml"

# --- merge TOP --------------------------------------------------------------------------------
dry 0 merge top.qcow2 --base base.qcow2 --dry-run --budget off
grep -q "^would merge top.qcow2 into base.qcow2 (nothing written)" "$run/out" || fail "merge --dry-run report: $(cat "$run/out")"
# CHILD is backed by TOP and not named with --rebase: --delete would orphan it, so the dry run
# exits 1 as the merge would, naming it.
dry 1 merge top.qcow2 --dry-run --delete --budget off
grep -q "would delete top.qcow2" "$run/out" || fail "merge --dry-run --delete does not say what it would delete: $(cat "$run/out")"
grep -q "would refuse --delete: image .*child.qcow2" "$run/out" || fail "merge --dry-run --delete does not name the child it would orphan: $(cat "$run/out")"
dry 0 merge top.qcow2 --dry-run --delete --rebase child.qcow2 --base base.qcow2 --budget off
grep -q "would rebase child.qcow2 onto base.qcow2" "$run/out" && grep -q "would delete mid.qcow2" "$run/out" ||
  fail "merge --dry-run --delete --rebase report: $(cat "$run/out")"
dry 0 merge top.qcow2 --dry-run --delete --rebase child.qcow2 --base base.qcow2 --budget off --output=json
ev=$(jq -c 'select(.event == "dry-run")' "$run/out")
[[ $(jq -r '.base' <<<"$ev") == base.qcow2 && $(jq -r '.delete | join(" ")' <<<"$ev") == "top.qcow2 mid.qcow2" &&
   $(jq -r '.rebase | join(" ")' <<<"$ev") == child.qcow2 && $(jq -r '."grow-base"' <<<"$ev") == true &&
   $(jq -r '."data-bytes"' <<<"$ev") == $(((2 + 1) << 20)) ]] || fail "merge --dry-run JSON: $ev"
# Governed (the default; the budget from --config, then given): the policy is resolved and
# shown; no governor, so no probe file.
dry 0 merge top.qcow2 --dry-run --delete --rebase child.qcow2 --config qcommitd.conf --connect "$uri"
grep -q "^budget 9 ms" "$run/out" || fail "governed dry run does not show the budget: $(cat "$run/out")"
dry 0 merge top.qcow2 --dry-run --rebase child.qcow2 --budget 20ms --probe on --connect "$uri"
# Refused: a trace is written by a running merge only; a CHILD that is not on TOP.
dry 2 merge top.qcow2 --dry-run --trace "$img/t.csv" --connect "$uri"
dry 1 merge top.qcow2 --dry-run --rebase other.qcow2 --delete --budget off
grep -q "other.qcow2: its backing file is not top.qcow2" "$run/err" || fail "not-a-child refusal: $(cat "$run/err")"

# --- merge --domain (one with an interrupted merge's journal), --pool/--vol ----------------------
dry 0 merge --domain "vm off" --disk vda --uri "$uri" --dry-run --delete --budget off --output=json
ev=$(jq -c 'select(.event == "dry-run")' "$run/out")
[[ $(jq -r '.delete | join(" ")' <<<"$ev") == "$img/d-top.qcow2" && $(jq -r '.definition' <<<"$ev") != null ]] ||
  fail "merge --domain --dry-run JSON: $ev"
dry 0 merge --domain "vm off" --disk vda --uri "$uri" --dry-run --delete --config qcommitd.conf
dry 0 merge --domain "vm journal" --disk vda --uri "$uri" --dry-run --budget off
grep -q "would finish the interrupted merge" "$run/out" || fail "journal dry run: $(cat "$run/out")"
dry 0 merge --pool imgpool --vol p-top.qcow2 --uri "$uri" --dry-run --delete --budget off --output=json
ev=$(jq -c 'select(.event == "dry-run")' "$run/out")
[[ $(jq -r '.base' <<<"$ev") == "$img/p-base.qcow2" && $(jq -r '.delete | join(" ")' <<<"$ev") == "$img/p-top.qcow2" ]] ||
  fail "merge --pool --dry-run JSON: $ev"
dry 0 merge --pool imgpool --vol p-top.qcow2 --uri "$uri" --dry-run --delete --config qcommitd.conf

# --- live ----------------------------------------------------------------------------------------
dry 0 live "vm one" vda --uri "$uri" --dry-run --budget 20ms
dry 0 live "vm one" vda --uri "$uri" --dry-run --pivot --overlay-dir "$img" --output=json
if command -v qemu-system-x86_64 >/dev/null; then
  # A real QEMU, paused, on the chain (it holds its image locks; qcommit only asks over QMP).
  start_qemu "$run/q.sock" \
    -drive "file=$img/l-top.qcow2,if=none,id=vda,format=qcow2" -device virtio-blk-pci,drive=vda,id=disk0
  dry 0 live --qmp "$run/q.sock" vda --dry-run --pivot
  grep -q "^  1\. " "$run/out" || fail "live --qmp --dry-run printed no steps: $(cat "$run/out")"
  dry 0 live --qmp "$run/q.sock" vda --dry-run --strategy direct --output=json
  stop "$qemu_pid"
else
  echo "skipped: live --qmp (no qemu-system-x86_64)"
fi
echo "cli.dry_run: OK"
