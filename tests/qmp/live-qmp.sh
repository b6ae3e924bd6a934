#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# qmp.live: `qcommit live --qmp SOCKET DISK` against a real QEMU started directly (no libvirt),
# paused (-S: block jobs run, the guest does not), with a second QMP monitor for this test's own
# queries and for writes that arrive while the merge runs (HMP qemu-io, i.e. through the disk's
# BlockBackend like guest writes).  Chains of three qcow2 layers made by qemu-img, each written by
# qemu-io.  Cases: two-phase active (-blockdev disk), direct active (-blockdev chain on throttled
# BASE storage), non-active range (-drive disk); then, with QEMU gone, BASE (or TOP for the range)
# must show exactly what TOP showed (plus the writes made during the merge) by qemu-img compare,
# and qemu-img check must be clean.
# Also: a missing socket and a socket that is not QMP give one line naming the socket.
# usage: live-qmp.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/../lib/test.sh"
QCOMMIT=$(realpath "$1")
QMP=$(cd "$(dirname "$0")" && pwd)/qmp.py
setup qmp.live

# start_qemu NAME drive|blockdev|throttled: in $d = $work/NAME, base.qcow2 <- mid.qcow2 <- top.qcow2
# (64 MiB), distinct data in each layer, including a zeroed range in top over data of base; ref.raw
# = what top shows (~24 MiB above base: more than one 16 MiB burst of QEMU's mirror, so the direct
# case has a job to write into). QEMU paused on top.qcow2 with monitors $d/q.sock (qcommit) and
# $d/t.sock (this test).  drive: -drive id=vda + device disk0; blockdev: the active layer as
# -blockdev (QEMU opens the backing files), device vda; throttled: the whole chain as -blockdev
# nodes with BASE's writes through a 8 MiB/s throttle filter (slow target storage: a commit into
# BASE cannot end within a second), device vda.
start_qemu() {
  local how=$2 disk
  d=$work/$1
  mkdir "$d"
  layers 64M "$d/base.qcow2=write -P 0x11 0 24M;write -P 0x44 36M 4M" \
    "$d/mid.qcow2=write -P 0x22 8M 24M;write -P 0x66 50M 64k" \
    "$d/top.qcow2=write -P 0x33 16M 8M;write -z 37M 1M;write -P 0x77 60M 4k"
  qemu-img convert -f qcow2 -O raw "$d/top.qcow2" "$d/ref.raw"
  case $how in
    drive)
      disk=(-drive "file=$d/top.qcow2,if=none,id=vda,format=qcow2" -device virtio-blk-pci,drive=vda,id=disk0) ;;
    blockdev)
      disk=(-blockdev "driver=file,filename=$d/top.qcow2,node-name=top-file"
            -blockdev driver=qcow2,file=top-file,node-name=top-fmt -device virtio-blk-pci,drive=top-fmt,id=vda) ;;
    throttled)
      disk=(-object throttle-group,id=slow,x-bps-write=8388608
            -blockdev "driver=file,filename=$d/base.qcow2,node-name=base-file"
            -blockdev driver=throttle,throttle-group=slow,file=base-file,node-name=base-slow
            -blockdev driver=qcow2,file=base-slow,node-name=base-fmt
            -blockdev "driver=file,filename=$d/mid.qcow2,node-name=mid-file"
            -blockdev driver=qcow2,file=mid-file,backing=base-fmt,node-name=mid-fmt
            -blockdev "driver=file,filename=$d/top.qcow2,node-name=top-file"
            -blockdev driver=qcow2,file=top-file,backing=mid-fmt,node-name=top-fmt
            -device virtio-blk-pci,drive=top-fmt,id=vda) ;;
  esac
  spawn qemu-system-x86_64 -machine q35,accel=tcg -nodefaults -display none -S -name "qmp-$how" \
    -qmp "unix:$d/q.sock,server=on,wait=off" -qmp "unix:$d/t.sock,server=on,wait=off" \
    "${disk[@]}" >"$d/qemu.log" 2>&1
  qpid=$!
  wait_until 5 monitors_up "$d" || fail "QEMU did not start: $(cat "$d/qemu.log")"
}

monitors_up() { [[ -S $1/q.sock && -S $1/t.sock ]]; }
# stop_qemu IMG: QEMU quits, then IMG must show ref.raw and be clean.
stop_qemu() {
  "$QMP" "$d/t.sock" quit >/dev/null || true
  wait "$qpid" 2>/dev/null || true
  local img=$d/$1
  qemu-img compare -f raw -F qcow2 "$d/ref.raw" "$img" >/dev/null ||
    fail "$img differs from what TOP showed: $(qemu-img compare -f raw -F qcow2 "$d/ref.raw" "$img" 2>&1 | head -3)"
  qemu-img check -q "$img" || fail "qemu-img check $img: not clean"
}

# active_chain DIR: the disk's chain as QEMU shows it (query-block), filenames top to bottom.
active_chain() {
  "$QMP" "$1/t.sock" query-block | jq -r '.[0].inserted.image | [recurse(."backing-image"; . != null) | .filename] | join(" ")'
}

# write_during DIR HMP-DEVICE: once a block job runs, write 1 MiB of 0x55 at 40M through the
# disk (and into ref.raw), as the guest would.
job_runs() { [[ $("$QMP" "$1/t.sock" query-block-jobs | jq length) -gt 0 ]]; }
write_during() {
  local d=$1 dev=$2 jobs
  wait_until 10 job_runs "$d" || true
  jobs=$("$QMP" "$d/t.sock" query-block-jobs | jq -c '[.[] | {device, type, status}]')
  "$QMP" "$d/t.sock" human-monitor-command \
    "{\"command-line\": \"qemu-io $dev \\\"write -P 0x55 40M 1M\\\"\"}" >"$d/hmp.out"
  [[ $(cat "$d/hmp.out") == '""' ]] || fail "HMP qemu-io $dev: $(cat "$d/hmp.out")"
  qio -f raw "$d/ref.raw" 'write -P 0x55 40M 1M'
  echo "  wrote 1 MiB through the disk while jobs were $jobs"
}

one_line_error() {  # one_line_error SOCKET EXPECTED-SUBSTRING [OPTION...]: exit 1, one line (in err.txt)
  fails_with 1 "$2" timeout 30 "$QCOMMIT" live --qmp "$1" vda --pivot "${@:3}"
  echo "  $1 -> exit $rc: $(cat err.txt)"
  grep -qF "$1" err.txt || fail "the error does not name the socket"
}
run_live() {  # run_live DIR ARGS...: qcommit live --qmp DIR/q.sock ARGS, output in DIR/out
  local d=$1 rc=0 t0=$SECONDS
  shift
  timeout 90 "$QCOMMIT" live --qmp "$d/q.sock" "$@" >"$d/out" 2>"$d/err" || rc=$?
  echo "  qcommit live --qmp q.sock $* -> exit $rc in $((SECONDS - t0)) s; $(grep -c . "$d/err" || true) progress lines"
  [[ $rc == 0 ]] || fail "exit $rc: $(cat "$d/out" "$d/err")"
  grep -q "^qcommit live: done" "$d/out" || fail "no 'done': $(cat "$d/out")"
}
# merge_writing DIR ARGS...: run_live DIR vda --pivot --budget 20ms ARGS while write_during writes.
merge_writing() {
  local d=$1 wpid
  shift
  write_during "$d" "-d vda/virtio-backend" &
  wpid=$!
  run_live "$d" vda --pivot --budget 20ms "$@"
  wait "$wpid" || fail "the write during the merge failed: $(cat "$d/hmp.out" 2>/dev/null)"
}

echo "case 1: two-phase active commit with pivot, -blockdev disk"
start_qemu two-phase blockdev
[[ $(active_chain "$d") == "$d/top.qcow2 $d/mid.qcow2 $d/base.qcow2" ]] || fail "unexpected chain: $(active_chain "$d")"
merge_writing "$d"
grep -q "create external overlay $d/top.qcommit-" "$d/out" || fail "no overlay step: $(cat "$d/out")"
chain=$(active_chain "$d")
echo "  query-block after the pivot: $chain"
[[ $chain == "$d/base.qcow2" ]] || fail "active layer after the pivot is not BASE: $chain"
compgen -G "$d/top.qcommit-*.qcow2" >/dev/null && fail "the fresh overlay was not removed"
stop_qemu base.qcow2
echo "  base.qcow2 = TOP's view + the write, qemu-img check clean"

echo "case 2: direct active commit with pivot, -blockdev chain on throttled BASE storage"
start_qemu direct throttled
merge_writing "$d" --strategy direct
grep -q "overlay" "$d/out" && fail "direct strategy created an overlay: $(cat "$d/out")"
# BASE behind a filter has a json: pseudo-filename; its node is base-fmt.
active=$("$QMP" "$d/t.sock" query-block | jq -r '.[0].inserted | ."node-name" + " " + (.image."backing-image" == null | tostring)')
echo "  query-block after the pivot: active node and no backing: $active"
[[ $active == "base-fmt true" ]] || fail "active layer after the pivot is not BASE's node: $active"
stop_qemu base.qcow2
echo "  base.qcow2 = TOP's view + the write, qemu-img check clean"

echo "case 3: non-active commit mid -> base (disk named disk0)"
start_qemu range drive
# Refusals first: another client holds the monitor (QEMU sends it no greeting), and a job that
# someone else started (default job id = the drive id) runs on the disk.
python3 -c 'import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(4096)
open(sys.argv[2], "w").close(); time.sleep(8)' "$d/q.sock" "$d/held" &
hold=$!
wait_until 5 test -e "$d/held" || fail "the test client did not get the monitor"
one_line_error "$d/q.sock" "no QMP greeting within 5 s"
stop "$hold"
"$QMP" "$d/t.sock" block-commit "{\"device\": \"vda\", \"top\": \"$d/mid.qcow2\", \"speed\": 1}" >/dev/null
one_line_error "$d/q.sock" "the commit block job on" --wait 0
grep -qF "was not started by qcommit live and --wait is 0" err.txt || fail "the refusal does not say why"
# The same job, cancelled 2 s later by its owner: qcommit live waits it out (saying so once), then
# plans on the chain that job left and merges.
: >"$d/err"
(wait_until 30 grep -q "waiting up to" "$d/err" || true
  sleep 2; "$QMP" "$d/t.sock" block-job-cancel '{"device": "vda"}' >/dev/null) &
canceller=$!
t_wait=$SECONDS
run_live "$d" disk0 --top "$d/mid.qcow2" --base "$d/base.qcow2" --budget 20ms --wait 30s
wait "$canceller"
grep -c "waiting up to 30s for the commit block job on .* vda" "$d/err" | grep -qx 1 ||
  fail "the wait for the foreign job was not said exactly once: $(cat "$d/err")"
((SECONDS - t_wait >= 2)) || fail "qcommit live did not wait for the foreign job"
chain=$(active_chain "$d")
echo "  query-block after the commit: $chain"
[[ $chain == "$d/top.qcow2 $d/base.qcow2" ]] || fail "chain after the commit: $chain"
stop_qemu top.qcow2
qemu-img check -q "$d/base.qcow2" || fail "qemu-img check base.qcow2: not clean"
[[ $(qemu-img info --output=json "$d/top.qcow2" | jq -r '."backing-filename"') == "$d/base.qcow2" ]] ||
  fail "top.qcow2's backing file is not base.qcow2"
echo "  top.qcow2 -> base.qcow2 shows TOP's view, both clean"

echo "case 4: sockets that are not a usable QMP monitor"
one_line_error "$work/missing.sock" "No such file or directory"
spawn python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1)
while True:
    c, _ = s.accept(); c.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian\r\n"); time.sleep(0.2); c.close()
' "$work/ssh.sock"
wait_until 5 test -S "$work/ssh.sock" || true
one_line_error "$work/ssh.sock" "not a QMP monitor"
echo "qmp.live: OK"
