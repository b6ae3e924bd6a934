#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.peer_gone: a libvirt socket whose server closes every connection at once (libvirtd going
# away between two calls). live and merge --domain say so in one line on stderr and exit 1;
# doctor reports it among its findings ("libvirt: cannot connect to URI"). None dies of SIGPIPE
# (exit 141, nothing said). The close races the client's first write, so each command is run 20
# times: with SIGPIPE not ignored, about one run in three died silently.
# With SIGPIPE ignored, `status --watch` must still end when its reader does (`| head`).
# usage: peer-gone.sh QCOMMIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCOMMITD=$(realpath "$2")
setup cli.peer_gone
kRuns=20

socket_stub "$work/libvirt-sock"
uri="qemu:///system?socket=$work/libvirt-sock"

# each_run NAME CHECK CMD...: runs CMD kRuns times (try); none may die of SIGPIPE, and after each
# CHECK (a function, given the exit code) judges out.txt and err.txt.
each_run() {
  local name=$1 check=$2 i rc
  shift 2
  for ((i = 0; i < kRuns; i++)); do
    try "$@"
    ((rc != 141)) || fail "$name: killed by SIGPIPE (exit 141) in run $((i + 1)), nothing said"
    "$check" "$name" "$rc"
  done
}
# One line on stderr naming the socket, exit 1.
one_line() {
  [[ $2 == 1 && $(wc -l <err.txt) == 1 ]] || fail "$1: exit $2, expected 1 and one line: $(head -c 300 err.txt)"
  grep -qF "$work/libvirt-sock" err.txt || fail "$1: the error does not name the socket: $(cat err.txt)"
}
# doctor's finding on stdout.
cannot_connect_finding() {
  grep -qF "libvirt: cannot connect to $uri" out.txt || fail "$1: exit $2, no 'cannot connect' finding: $(cat out.txt err.txt | head -c 400)"
}

each_run live one_line "$QCOMMIT" live nodom vda -c "$uri"
each_run "merge --domain" one_line "$QCOMMIT" merge --domain nodom --disk vda -c "$uri"
each_run doctor cannot_connect_finding "$QCOMMIT" doctor nodom -c "$uri"
# status --watch into a pipe whose reader exits: it ends rather than redrawing into the void.
spawn "$QCOMMITD" --uri test:///default --socket "$work/qcd.sock" 2>qcd.log
wait_until 5 test -S "$work/qcd.sock" || fail "qcommitd did not start: $(cat qcd.log)"
set +o pipefail
timeout 20 "$QCOMMIT" status --watch 100ms --socket "$work/qcd.sock" | head -c 1 >/dev/null
rc=${PIPESTATUS[0]}
set -o pipefail
((rc != 124)) || fail "status --watch went on drawing for 20 s after its reader exited"

echo "cli.peer_gone: OK ($kRuns runs each of live, merge --domain, doctor; status --watch | head ends)"
