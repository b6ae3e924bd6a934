# SPDX-License-Identifier: GPL-2.0-or-later
# What the integration scripts share beyond tests/lib/test.sh (setup, fail, spawn, wait_until,
# ...), which it sources; sourced (`. "$(dirname "$0")/lib.sh"`) after `set -euo pipefail`, with
# the paths of the binaries made absolute before `setup` changes the directory.
#   start_qemu SOCK ...  a real QEMU, paused, with its QMP monitor at SOCK (see there).
#   socket_stub SOCK [F] a Unix socket that closes every connection, or answers F (see there).
#   test_domain, file_disk: domain XML for libvirt's test driver (test:///FILE; no libvirtd).

. "$(dirname "${BASH_SOURCE[0]}")/../lib/test.sh"

# start_qemu SOCKET ARGS...: qemu-system-x86_64 paused (-S: block jobs and QMP work, no guest
# runs), TCG, no default devices, with its QMP monitor at SOCKET and ARGS (-blockdev, -drive,
# -device, -object iothread ...); spawned (its pid in $qemu_pid, its output in SOCKET.log), ready
# once the socket is there (at most 5 s).
start_qemu() {
  local sock=$1 i
  shift
  spawn qemu-system-x86_64 -machine q35,accel=tcg -nodefaults -display none -S \
    -qmp "unix:$sock,server=on,wait=off" "$@" >"$sock.log" 2>&1
  qemu_pid=$!
  for ((i = 0; i < 100; i++)); do
    [[ -S $sock ]] && return 0
    kill -0 "$qemu_pid" 2>/dev/null || break
    sleep 0.05
  done
  fail "QEMU did not start: $(cat "$sock.log")"
}

# socket_stub SOCKET [ANSWER_FILE]: a Unix socket server (python3), spawned, ready on return (at
# most 5 s): it closes every connection at once, or, given ANSWER_FILE, reads one request line and
# answers with the file's content, then closes.
socket_stub() {
  local i
  cat >"$work/socket_stub.py" <<'PY'
import socket, sys
answer = open(sys.argv[3], "rb").read() if len(sys.argv) > 3 else None
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(64)
open(sys.argv[2], "w").close()
while True:
    c, _ = s.accept()
    if answer is not None:
        c.makefile("r").readline()
        c.sendall(answer)
    c.close()
PY
  spawn python3 "$work/socket_stub.py" "$1" "$1.ready" ${2:+"$2"}
  for ((i = 0; i < 50; i++)); do [[ -e $1.ready ]] && return 0; sleep 0.1; done
  fail "the stub socket $1 did not start"
}

# test_domain NAME ELEMENTS: a running domain of libvirt's test driver, NAME with 64 MiB, and
# ELEMENTS (<devices>, <iothreads>, <metadata>; <test:runstate>5</test:runstate> shuts it off).
test_domain() {
  cat <<XML
  <domain type='test' xmlns:test='http://libvirt.org/schemas/domain/test/1.0'>
    <name>$1</name>
    <memory>65536</memory>
    <os><type>hvm</type></os>
$2
  </domain>
XML
}

# file_disk TARGET BUS SOURCE [BACKING] [DRIVER_ATTRIBUTES]: a qcow2 file disk, with BACKING (a
# qcow2 file, "" for none) as its backing store.
file_disk() {
  local backing=
  [[ -z ${4:-} ]] ||
    backing="<backingStore type='file'><format type='qcow2'/><source file='$4'/><backingStore/></backingStore>"
  cat <<XML
      <disk type='file' device='disk'>
        <driver name='qemu' type='qcow2' ${5:-}/>
        <source file='$3'/>
        $backing
        <target dev='$1' bus='$2'/>
      </disk>
XML
}

# findings FILE SUBJECT: the findings `qcommit doctor --output=json` wrote to FILE for SUBJECT,
# one a line as "LEVEL FINDING | REASON".
findings() {
  jq -r --arg s "$2" '.findings[] | select(.subject == $s) | "\(.level) \(.finding) | \(.reason)"' "$1"
}
# expect_finding FILE SUBJECT START: one of them starts with START, or the test fails.
expect_finding() {
  local line
  while IFS= read -r line; do [[ $line == "$3"* ]] && return 0; done < <(findings "$1" "$2")
  fail "$2: no finding '$3...' among: $(findings "$1" "$2")"
}
# no_finding FILE SUBJECT TEXT: none of them contains TEXT, or the test fails.
no_finding() {
  local line
  while IFS= read -r line; do [[ $line != *"$3"* ]] || fail "$2: '$3' found: $line"; done < <(findings "$1" "$2")
}
