#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# qmp.live: `qcommit live --qmp SOCKET DISK` against a real QEMU started directly (no libvirt),
# paused (-S: block jobs run, the guest does not), with a second QMP monitor for this test's own
# queries and for writes that arrive while the merge runs (HMP qemu-io, i.e. through the disk's
# BlockBackend like guest writes).  Chains of three qcow2 layers made by qemu-img, each written by
# qemu-io.  Cases: two-phase active (-blockdev disk), direct active (-drive disk), non-active
# range; then, with QEMU gone, BASE (or TOP for the range) must show exactly what TOP showed
# (plus the writes made during the merge) by qemu-img compare, and qemu-img check must be clean.
# Also: a missing socket and a socket that is not QMP give one line naming the socket.
# usage: live-qmp.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
HERE=$(cd "$(dirname "$0")" && pwd)
QMP="$HERE/qmp.py"
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-qmp.XXXXXX")
qpid= spid=
cleanup() {
  [[ -n $qpid ]] && kill "$qpid" 2>/dev/null
  [[ -n $spid ]] && kill "$spid" 2>/dev/null
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# make_chain DIR: base.qcow2 <- mid.qcow2 <- top.qcow2 (64 MiB), distinct data in each layer,
# including a zeroed range in top over data of base; ref.raw = what top shows.  ~24 MiB above
# base: more than one 16 MiB burst of QEMU's mirror, so the direct case has a job to write into.
make_chain() {
  local d=$1
  mkdir -p "$d"
  qemu-img create -q -f qcow2 "$d/base.qcow2" 64M
  qemu-img create -q -f qcow2 -b "$d/base.qcow2" -F qcow2 "$d/mid.qcow2"
  qemu-img create -q -f qcow2 -b "$d/mid.qcow2" -F qcow2 "$d/top.qcow2"
  qemu-io -f qcow2 -c 'write -P 0x11 0 24M' -c 'write -P 0x44 36M 4M' "$d/base.qcow2" >/dev/null
  qemu-io -f qcow2 -c 'write -P 0x22 8M 24M' -c 'write -P 0x66 50M 64k' "$d/mid.qcow2" >/dev/null
  qemu-io -f qcow2 -c 'write -P 0x33 16M 8M' -c 'write -z 37M 1M' -c 'write -P 0x77 60M 4k' \
    "$d/top.qcow2" >/dev/null
  qemu-img convert -f qcow2 -O raw "$d/top.qcow2" "$d/ref.raw"
}

# start_qemu DIR drive|blockdev|throttled: QEMU paused on DIR/top.qcow2 with monitors DIR/q.sock
# (qcommit) and DIR/t.sock (this test).  drive: -drive id=vda + device disk0; blockdev: the
# active layer as -blockdev (QEMU opens the backing files), device vda; throttled: the whole
# chain as -blockdev nodes with BASE's writes through a 8 MiB/s throttle filter (slow target
# storage: a commit into BASE cannot end within a second), device vda.
start_qemu() {
  local d=$1 how=$2 disk
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
  qemu-system-x86_64 -machine q35,accel=tcg -nodefaults -display none -S -name "qmp-$how" \
    -qmp "unix:$d/q.sock,server=on,wait=off" -qmp "unix:$d/t.sock,server=on,wait=off" \
    "${disk[@]}" >"$d/qemu.log" 2>&1 &
  qpid=$!
  for ((i = 0; i < 100; i++)); do [[ -S $d/q.sock && -S $d/t.sock ]] && return; sleep 0.05; done
  fail "QEMU did not start: $(cat "$d/qemu.log")"
}

stop_qemu() {
  local d=$1
  "$QMP" "$d/t.sock" quit >/dev/null || true
  wait "$qpid" 2>/dev/null || true
  qpid=
}

# active_chain DIR: the disk's chain as QEMU shows it (query-block), filenames top to bottom.
active_chain() {
  "$QMP" "$1/t.sock" query-block | jq -r '.[0].inserted.image | [recurse(."backing-image"; . != null) | .filename] | join(" ")'
}

# write_during DIR HMP-DEVICE: once a block job runs, write 1 MiB of 0x55 at 40M through the
# disk (and into ref.raw), as the guest would.
write_during() {
  local d=$1 dev=$2
  for ((i = 0; i < 200; i++)); do
    [[ $("$QMP" "$d/t.sock" query-block-jobs | jq length) -gt 0 ]] && break
    sleep 0.05
  done
  local jobs
  jobs=$("$QMP" "$d/t.sock" query-block-jobs | jq -c '[.[] | {device, type, status}]')
  "$QMP" "$d/t.sock" human-monitor-command \
    "{\"command-line\": \"qemu-io $dev \\\"write -P 0x55 40M 1M\\\"\"}" >"$d/hmp.out"
  [[ $(cat "$d/hmp.out") == '""' ]] || fail "HMP qemu-io $dev: $(cat "$d/hmp.out")"
  qemu-io -f raw -c 'write -P 0x55 40M 1M' "$d/ref.raw" >/dev/null
  echo "  wrote 1 MiB through the disk while jobs were $jobs"
}

verify_image() {  # verify_image REF IMAGE
  qemu-img compare -f raw -F qcow2 "$1" "$2" >/dev/null || fail "$2 differs from what TOP showed: $(qemu-img compare -f raw -F qcow2 "$1" "$2" 2>&1 | head -3)"
  qemu-img check -q "$2" || fail "qemu-img check $2: not clean"
}

one_line_error() {  # one_line_error SOCKET EXPECTED-SUBSTRING [OPTION...]
  local rc=0 sock=$1 want=$2
  shift 2
  timeout 30 "$QCOMMIT" live --qmp "$sock" vda --pivot "$@" >"$work/out" 2>"$work/err" || rc=$?
  set -- "$sock" "$want"
  echo "  $1 -> exit $rc: $(cat "$work/err")"
  [[ $rc == 1 ]] || fail "expected exit 1"
  [[ $(wc -l <"$work/err") == 1 ]] || fail "expected one line"
  grep -qF "$1" "$work/err" || fail "the error does not name the socket"
  grep -qF "$2" "$work/err" || fail "the error does not say '$2'"
}
run_live() {  # run_live DIR ARGS...: qcommit live --qmp DIR/q.sock ARGS, output in DIR/out
  local d=$1
  shift
  local rc=0 t0=$SECONDS
  timeout 90 "$QCOMMIT" live --qmp "$d/q.sock" "$@" >"$d/out" 2>"$d/err" || rc=$?
  echo "  qcommit live --qmp q.sock $* -> exit $rc in $((SECONDS - t0)) s; $(grep -c . "$d/err" || true) progress lines"
  [[ $rc == 0 ]] || fail "exit $rc: $(cat "$d/out" "$d/err")"
  grep -q "^qcommit live: done" "$d/out" || fail "no 'done': $(cat "$d/out")"
}

# --- 1. active layer, two-phase (default), -blockdev disk --------------------------------------
echo "case 1: two-phase active commit with pivot, -blockdev disk"
d=$work/two-phase
make_chain "$d"
start_qemu "$d" blockdev
[[ $(active_chain "$d") == "$d/top.qcow2 $d/mid.qcow2 $d/base.qcow2" ]] || fail "unexpected chain: $(active_chain "$d")"
write_during "$d" "-d vda/virtio-backend" &
wpid=$!
run_live "$d" vda --pivot --budget 20ms
wait "$wpid" || fail "the write during the merge failed: $(cat "$d/hmp.out" 2>/dev/null)"
grep -q "create external overlay $d/top.qcommit-" "$d/out" || fail "no overlay step: $(cat "$d/out")"
chain=$(active_chain "$d")
echo "  query-block after the pivot: $chain"
[[ $chain == "$d/base.qcow2" ]] || fail "active layer after the pivot is not BASE: $chain"
compgen -G "$d/top.qcommit-*.qcow2" >/dev/null && fail "the fresh overlay was not removed"
stop_qemu "$d"
verify_image "$d/ref.raw" "$d/base.qcow2"
echo "  base.qcow2 = TOP's view + the write, qemu-img check clean"

# --- 2. active layer, direct, -drive disk -------------------------------------------------------
echo "case 2: direct active commit with pivot, -blockdev chain on throttled BASE storage"
d=$work/direct
make_chain "$d"
start_qemu "$d" throttled
write_during "$d" "-d vda/virtio-backend" &
wpid=$!
run_live "$d" vda --pivot --budget 20ms --strategy direct
wait "$wpid" || fail "the write during the merge failed: $(cat "$d/hmp.out" 2>/dev/null)"
grep -q "overlay" "$d/out" && fail "direct strategy created an overlay: $(cat "$d/out")"
# BASE behind a filter has a json: pseudo-filename; its node is base-fmt.
active=$("$QMP" "$d/t.sock" query-block | jq -r '.[0].inserted | ."node-name" + " " + (.image."backing-image" == null | tostring)')
echo "  query-block after the pivot: active node and no backing: $active"
[[ $active == "base-fmt true" ]] || fail "active layer after the pivot is not BASE's node: $active"
stop_qemu "$d"
verify_image "$d/ref.raw" "$d/base.qcow2"
echo "  base.qcow2 = TOP's view + the write, qemu-img check clean"

# --- 3. non-active range mid -> base, disk named by its device id -------------------------------
echo "case 3: non-active commit mid -> base (disk named disk0)"
d=$work/range
make_chain "$d"
start_qemu "$d" drive
# Refusals first: another client holds the monitor (QEMU sends it no greeting), and a job that
# someone else started (default job id = the drive id) runs on the disk.
python3 -c 'import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(4096)
open(sys.argv[2], "w").close(); time.sleep(8)' "$d/q.sock" "$d/held" &
hold=$!
for ((i = 0; i < 100; i++)); do [[ -e $d/held ]] && break; sleep 0.05; done
[[ -e $d/held ]] || fail "the test client did not get the monitor"
one_line_error "$d/q.sock" "no QMP greeting within 5 s"
kill "$hold"
wait "$hold" 2>/dev/null || true
"$QMP" "$d/t.sock" block-commit "{\"device\": \"vda\", \"top\": \"$d/mid.qcow2\", \"speed\": 1}" >/dev/null
one_line_error "$d/q.sock" "the commit block job on" --wait 0
grep -qF "was not started by qcommit live and --wait is 0" "$work/err" || fail "the refusal does not say why"
# The same job, cancelled 2 s later by its owner: qcommit live waits it out (saying so once), then
# plans on the chain that job left and merges.
( for ((i = 0; i < 300; i++)); do grep -q "waiting up to" "$d/err" 2>/dev/null && break; sleep 0.1; done
  sleep 2; "$QMP" "$d/t.sock" block-job-cancel '{"device": "vda"}' >/dev/null ) &
canceller=$!
t_wait=$SECONDS
: >"$d/err"
run_live "$d" disk0 --top "$d/mid.qcow2" --base "$d/base.qcow2" --budget 20ms --wait 30s
wait "$canceller"
grep -c "waiting up to 30s for the commit block job on .* vda" "$d/err" | grep -qx 1 ||
  fail "the wait for the foreign job was not said exactly once: $(cat "$d/err")"
((SECONDS - t_wait >= 2)) || fail "qcommit live did not wait for the foreign job"
chain=$(active_chain "$d")
echo "  query-block after the commit: $chain"
[[ $chain == "$d/top.qcow2 $d/base.qcow2" ]] || fail "chain after the commit: $chain"
stop_qemu "$d"
verify_image "$d/ref.raw" "$d/top.qcow2"
qemu-img check -q "$d/base.qcow2" || fail "qemu-img check base.qcow2: not clean"
[[ $(qemu-img info --output=json "$d/top.qcow2" | jq -r '."backing-filename"') == "$d/base.qcow2" ]] ||
  fail "top.qcow2's backing file is not base.qcow2"
echo "  top.qcow2 -> base.qcow2 shows TOP's view, both clean"

# --- 4. sockets that are not a usable QMP monitor ---------------------------------------------
echo "case 4: bad sockets"
one_line_error "$work/missing.sock" "No such file or directory"
python3 -c '
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1)
while True:
    c, _ = s.accept(); c.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian\r\n"); time.sleep(0.2); c.close()
' "$work/ssh.sock" &
spid=$!
for ((i = 0; i < 100; i++)); do [[ -S $work/ssh.sock ]] && break; sleep 0.05; done
one_line_error "$work/ssh.sock" "not a QMP monitor"
echo "qmp.live: OK"
