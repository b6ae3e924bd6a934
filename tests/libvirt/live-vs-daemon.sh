#!/usr/bin/env bash
# libvirt.live_vs_daemon: one governor per job. While qcommitd answers on its socket,
# `qcommit live` refuses before touching anything, naming the daemon and the way out.
# usage: live-vs-daemon.sh QCOMMIT QCOMMITD
set -euo pipefail
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-livevsd.XXXXXX")
dpid=
cleanup() { [[ -n $dpid ]] && kill "$dpid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
printf '[default]\nbudget=20ms\n' >"$work/qcommitd.conf"
"$QCOMMITD" --config "$work/qcommitd.conf" --uri test:///default --socket "$work/d.sock" >"$work/d.log" 2>&1 &
dpid=$!
for ((i = 0; i < 100; i++)); do [[ -S $work/d.sock ]] && break; sleep 0.05; done
[[ -S $work/d.sock ]] || { echo "qcommitd did not start: $(cat "$work/d.log")" >&2; exit 1; }
rc=0
"$QCOMMIT" live --daemon-socket "$work/d.sock" --uri test:///default test vda >"$work/out" 2>"$work/err" || rc=$?
echo "qcommit live with qcommitd running: exit $rc: $(cat "$work/err")"
[[ $rc == 1 ]] || { echo "expected exit 1" >&2; exit 1; }
[[ $(wc -l <"$work/err") == 1 ]] || { echo "expected one line" >&2; exit 1; }
grep -q "qcommitd is running" "$work/err" && grep -q "virsh blockcommit" "$work/err" || { echo "unclear refusal" >&2; exit 1; }
# Without the daemon the same command gets past that check (and fails later for its own reason:
# the test driver's domain has no block jobs).
kill "$dpid"; wait "$dpid" 2>/dev/null || true; dpid=
rc=0
"$QCOMMIT" live --daemon-socket "$work/d.sock" --uri test:///default test vda --dry-run >"$work/out2" 2>"$work/err2" || rc=$?
if grep -q "qcommitd is running" "$work/err2"; then echo "refused although qcommitd is gone" >&2; exit 1; fi
echo "libvirt.live_vs_daemon: OK"
