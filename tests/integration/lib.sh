# SPDX-License-Identifier: GPL-2.0-or-later
# What the integration scripts share beyond tests/lib/test.sh, which it sources: a paused QEMU, socket stubs, domain XML for libvirt's test driver (test:///FILE; no libvirtd),
# doctor's findings. Sourced (`. "$(dirname "$0")/lib.sh"`) after `set -euo pipefail`, with the
# binaries' paths made absolute before `setup` changes the directory.

. "$(dirname "${BASH_SOURCE[0]}")/../lib/test.sh"

# qcommitd_refuses CONF TEXT: $QCOMMITD --config CONF exits, within 20 s and not 0, saying TEXT.
qcommitd_refuses() {
  try timeout 20 "$QCOMMITD" --config "$1" --uri test:///default --socket "$work/qcd.sock"
  [[ $rc != 0 && $rc != 124 ]] || fail "qcommitd started with $1: $(tr '\n' ' ' <"$1")(exit $rc)"
  grep -qF -- "$2" err.txt || fail "qcommitd's error lacks '$2': $(cat err.txt)"
}

# start_qemu SOCKET ARGS...: qemu-system-x86_64 paused (-S: block jobs and QMP work, no guest
# runs), TCG, no default devices, with its QMP monitor at SOCKET and ARGS (-blockdev, -drive,
# -device, -object iothread ...); spawned (its pid in $qemu_pid, its output in SOCKET.log), ready
# once the socket is there (at most 5 s).
start_qemu() {
  local sock=$1
  shift
  spawn qemu-system-x86_64 -machine q35,accel=tcg -nodefaults -display none -S \
    -qmp "unix:$sock,server=on,wait=off" "$@" >"$sock.log" 2>&1
  qemu_pid=$!
  wait_until 5 _socket_or_gone "$sock" && [[ -S $sock ]] || fail "QEMU did not start: $(cat "$sock.log")"
}
_socket_or_gone() { [[ -S $1 ]] || gone "$qemu_pid"; }

# socket_stub SOCKET [ANSWER_FILE]: a Unix socket server (python3), spawned, ready on return (at
# most 5 s): it closes every connection at once, or, given ANSWER_FILE, reads one request line and
# answers with the file's content, then closes.
socket_stub() {
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
  wait_until 5 test -e "$1.ready" || fail "the stub socket $1 did not start"
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
