#!/usr/bin/env bash
# libvirt.hook_names: the libvirt qemu hook treats domain names as data. Names with spaces,
# quotes, $(...), backticks, globs and newlines run nothing, and the hook always exits 0 quickly
# (libvirtd waits for it), whether qcommitd's socket exists or not.
# usage: hook-names.sh HOOK
set -euo pipefail
HOOK=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-hook.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
# A stand-in qcommit on PATH records every call's arguments.
mkdir bin
printf '#!/bin/sh\nprintf "%%s\\n" "$@" >>"%s/calls"\n' "$work" >bin/qcommit
chmod +x bin/qcommit
names=('vm one' "vm'quote" 'vm"dq' "vm\$(touch $work/pwned1)" "vm\`touch $work/pwned2\`" 'vm;touch pwned3'
       $'vm\nnewline' 'vm*' '-rf' '--socket=/etc/passwd')
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1)' "$work/sock" &
sleep 0.3
for sock in "$work/sock" "$work/none"; do
  for n in "${names[@]}"; do
    for op in started stopped reconnect prepare release; do
      start=$(date +%s%N)
      PATH="$work/bin:$PATH" QCOMMITD_SOCKET=$sock "$HOOK" "$n" "$op" - </dev/null >/dev/null 2>&1 ||
        { echo "hook exited non-zero for name '$n' op $op" >&2; exit 1; }
      ms=$((($(date +%s%N) - start) / 1000000))
      ((ms < 3000)) || { echo "hook took $ms ms" >&2; exit 1; }
    done
  done
done
for f in pwned1 pwned2 pwned3; do [[ ! -e $work/$f && ! -e $f ]] || { echo "a domain name ran a command ($f)" >&2; exit 1; }; done
# The name never reaches the command line of anything the hook runs.
if [[ -e calls ]] && grep -q '^vm' calls; then echo "domain name passed to qcommit: $(cat calls)" >&2; exit 1; fi
echo "libvirt.hook_names: OK ($(wc -l <calls 2>/dev/null || echo 0) qcommit calls, none with a name)"
