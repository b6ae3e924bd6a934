#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.hook_names: the libvirt qemu hook treats domain names as data. Names with spaces,
# quotes, $(...), backticks, globs and newlines run nothing and reach qcommit byte for byte as one
# argument after --domain-event; the hook always exits 0 quickly (libvirtd waits for it), whether
# qcommitd's socket exists or not, and calls nothing for operations it does not forward.
# usage: hook-names.sh HOOK
set -euo pipefail
. "$(dirname "$0")/../lib/test.sh"
HOOK=$(realpath "$1")
setup libvirt.hook_names
# A stand-in qcommit on PATH records every call: its arguments NUL-terminated, then a record end.
mkdir bin
printf '#!/bin/sh\nprintf "%%s\\0" "$@" >>"%s/calls"; printf "@@END@@\\0" >>"%s/calls"\n' "$work" "$work" >bin/qcommit
chmod +x bin/qcommit
names=('vm one' "vm'quote" 'vm"dq' "vm\$(touch $work/pwned1)" "vm\`touch $work/pwned2\`" 'vm;touch pwned3'
       $'vm\nnewline' 'vm*' '-rf' '--socket=/etc/passwd')
spawn python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1)' "$work/sock"
wait_until 10 test -S "$work/sock" || fail "test socket did not appear"
for sock in "$work/sock" "$work/none"; do
  for n in "${names[@]}"; do
    for op in started stopped reconnect prepare release; do
      start=$(date +%s%N)
      PATH="$work/bin:$PATH" QCOMMITD_SOCKET=$sock "$HOOK" "$n" "$op" - </dev/null >/dev/null 2>&1 ||
        fail "hook exited non-zero for name '$n' op $op"
      ms=$((($(date +%s%N) - start) / 1000000))
      ((ms < 3000)) || fail "hook took $ms ms"
    done
  done
done
for f in pwned1 pwned2 pwned3; do [[ ! -e $work/$f && ! -e $f ]] || fail "a domain name ran a command ($f)"; done
# Exactly one call per forwarded operation while the socket exists, each with the name intact.
python3 - "$work/calls" "$work/sock" "${names[@]}" <<'PY'
import sys
calls_path, sock, names = sys.argv[1], sys.argv[2], sys.argv[3:]
raw = open(calls_path, 'rb').read().decode() if __import__('os').path.exists(calls_path) else ''
fields = raw.split('\0')[:-1]
calls, cur = [], []
for f in fields:
    if f == '@@END@@':
        calls.append(cur); cur = []
    else:
        cur.append(f)
want = [['status', '--socket', sock, '--domain-event', n, op]
        for n in names for op in ('started', 'stopped', 'reconnect', 'release')]
if calls != want:
    sys.exit('hook calls differ from expected:\n got  %r\n want %r' % (calls[:6], want[:6]))
print('libvirt.hook_names: OK (%d qcommit calls, every name passed intact as one argument)' % len(calls))
PY
