#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Backing file names resolved as QEMU resolves them, and the open policy (issue 17, defects 3-4).
#  1. "link/../base.qcow2" with link -> real/sub is real/base.qcow2 (the kernel's resolution, as
#     QEMU opens it), not ./base.qcow2: `qcommit info`/`plan` show qemu-img's chain and the merge
#     goes into real/base.qcow2, the decoy ./base.qcow2 stays byte-identical.
#  2. A backing file (or an image named on the command line) that is a FIFO, a character device,
#     a directory or a socket is refused with one line naming it, and is never opened for reading
#     or writing: strace shows no open()/openat() of it without O_PATH. The FIFO must not hang.
#  3. A backing file resolving outside the allowed directories (by '..' or through a symlink
#     inside the allowed directory) is refused before any open of it (strace).
# usage: backing-paths.sh QCOMMIT
set -euo pipefail
qcommit=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup hostile.backing_paths
for tool in qemu-img qemu-io strace jq python3; do
  command -v "$tool" >/dev/null || fail "$tool not found (scripts/bootstrap installs it)"
done
work=$(pwd -P)
checks=0
check() { checks=$((checks + 1)); }

# drop_backing_format IMAGE: turns the backing format header extension into an unknown (ignored)
# one, so that readers probe the backing file's format (qemu-img no longer creates such images).
drop_backing_format() {
  python3 - "$1" <<'PY'
import os, struct, sys
with open(sys.argv[1], 'r+b') as f:
    head = f.read(4096)
    pos = struct.unpack('>I', head[100:104])[0] if struct.unpack('>I', head[4:8])[0] >= 3 else 72
    while pos + 8 <= len(head) and head[pos:pos + 4] != bytes(4):  # up to the end marker
        magic, length = struct.unpack('>II', head[pos:pos + 8])
        if magic == 0xe2792aca:
            sys.exit(os.pwrite(f.fileno(), struct.pack('>I', 0x7e570000), pos) != 4)
        pos += 8 + ((length + 7) & ~7)
sys.exit('no backing format extension in ' + sys.argv[1])
PY
}

# refused_unopened TAG NAME REAL NEEDLE ARGS... : qcommit ARGS, run in the current directory
# under strace (following forks, fds decoded to paths with -y) for at most 10 s, fails (no
# timeout, no signal) with one line on stderr naming NAME and containing NEEDLE, and never opens
# REAL for I/O: no open()/openat() without O_PATH whose path argument ends in NAME or whose
# returned descriptor is the file REAL. Sets err (the stderr file).
refused_unopened() {
  local tag=$1 name=$2 realp=$3 needle=$4 log=$work/$1.strace rc=0 bad; shift 4
  err=$work/$tag.err
  check
  timeout 10 strace -f -y -qq -e trace=open,openat -o "$log" "$qcommit" "$@" >"$work/$tag.out" 2>"$err" || rc=$?
  [ $rc -ne 0 ] && [ $rc -lt 124 ] ||
    soft_fail "$tag: qcommit $* exited $rc (timeout or signal: >= 124), expected a refusal: $(head -3 "$err")"
  [ "$(wc -l <"$err")" -eq 1 ] || soft_fail "$tag: $(wc -l <"$err") lines on stderr, expected one: $(head -3 "$err")"
  grep -qF -- "$name" "$err" || soft_fail "$tag: error does not name $name: $(cat "$err")"
  grep -qF -- "$needle" "$err" || soft_fail "$tag: error does not say '$needle': $(cat "$err")"
  grep -q 'open' "$log" || soft_fail "$tag: strace recorded no open at all (is tracing working?)"
  bad=$(grep -E '(^|[^a-z0-9_])open(at)?\(' "$log" | grep -v 'O_PATH' | grep -F -e "\"$name\"" -e "/$name\"" -e "<$realp>" || true)
  [ -z "$bad" ] || soft_fail "$tag: $realp was opened for I/O: $bad"
  echo "  $tag: exit $rc: $(head -1 "$err")"
}

echo "1. symlink/.. backing names: QEMU's chain, merged into the file QEMU uses"
mkdir -p "$work/dotdot/real/sub" && cd "$work/dotdot"
ln -s real/sub link
layers 8M real/base.qcow2='write -P 0x11 0 2M'
layers 8M base.qcow2='write -P 0xdd 0 4M'
new top.qcow2 8M -f qcow2 -b link/../base.qcow2 -F qcow2
qio top.qcow2 'write -P 0x22 1M 2M' 'write -z 6M 64k'
# A two-level chain: mid.qcow2 lives in real/sub and names "../base.qcow2"; QEMU joins it to
# "link/" (the directory part of mid's name as top names it): link/../base.qcow2 again.
new real/sub/mid.qcow2 8M -f qcow2 -b ../base.qcow2 -F qcow2
qio real/sub/mid.qcow2 'write -P 0x33 4M 1M'
new top2.qcow2 8M -f qcow2 -b link/mid.qcow2 -F qcow2

# chain_matches TAG DIR IMAGE: from DIR, qcommit info's chain equals qemu-img's, by name (what
# QEMU calls the filename) and by the file the kernel resolves it to.
chain_matches() {
  local tag=$1 dir=$2 image=$3 want got want_real got_real f
  check
  want=$(cd "$dir" && qemu-img info --backing-chain --output=json "$image" | jq -r '.[].filename') || true
  got=$(cd "$dir" && "$qcommit" info --output=json "$image" | jq -r '.chain[].filename') || true
  [ -n "$want" ] && [ "$want" = "$got" ] || soft_fail "$tag: chain $(echo $got) != qemu-img's $(echo $want)"
  want_real=$(cd "$dir" && while read -r f; do realpath "$f"; done <<<"$want")
  got_real=$(cd "$dir" && "$qcommit" info --output=json "$image" | jq -r '.chain[].resolved') || true
  [ "$want_real" = "$got_real" ] || soft_fail "$tag: resolved chain $(echo $got_real) != $(echo $want_real)"
  echo "  $tag: $(echo $got)"
}
chain_matches relative "$work/dotdot" top.qcow2
chain_matches dot-slash "$work/dotdot" ./top.qcow2
chain_matches absolute / "$work/dotdot/top.qcow2"
chain_matches from-parent "$work" dotdot/top.qcow2
chain_matches two-level "$work/dotdot" top2.qcow2
chain_matches two-level-absolute / "$work/dotdot/top2.qcow2"

check
plan=$("$qcommit" plan --output=json --budget off top.qcow2) || true
[ "$(jq -r '."resolved-base"' <<<"$plan")" = "$work/dotdot/real/base.qcow2" ] &&
  [ "$(jq -r '.base' <<<"$plan")" = "link/../base.qcow2" ] ||
  soft_fail "plan: base $(jq -c '{base, "resolved-base"}' <<<"$plan"), expected link/../base.qcow2 -> real/base.qcow2"
"$qcommit" plan --budget off top.qcow2 | grep -qF "link/../base.qcow2 -> $work/dotdot/real/base.qcow2" ||
  soft_fail "plan: human output does not show the resolved base: $("$qcommit" plan --budget off top.qcow2)"

qemu-img convert -f qcow2 -O raw top.qcow2 "$work/top-view.raw"
decoy_before=$(sha256sum base.qcow2)
check
merged=1  # 0 once a check of the merge failed
"$qcommit" merge --budget off top.qcow2 >"$work/merge.out" 2>"$work/merge.err" ||
  { merged=0; soft_fail "merge of top.qcow2 failed: $(cat "$work/merge.err")"; }
[ "$(sha256sum base.qcow2)" = "$decoy_before" ] || { merged=0; soft_fail "merge changed the decoy ./base.qcow2"; }
qemu-img compare -q -f raw -F qcow2 "$work/top-view.raw" real/base.qcow2 ||
  { merged=0; soft_fail "real/base.qcow2 after the merge differs from TOP's original view"; }
qemu-img check -q real/base.qcow2 || { merged=0; soft_fail "qemu-img check real/base.qcow2 after the merge"; }
((!merged)) || echo "  merge: into real/base.qcow2, decoy untouched"

echo "2. backing files that are not regular files or block devices are never opened"
mkdir -p "$work/special" && cd "$work/special"
mkfifo fifo
mkdir dir
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' sock
kinds=(fifo:"a FIFO" dir:"a directory" sock:"a socket")
# A character device of our own (the null device's numbers); never a system one such as a
# watchdog. Without the right to mknod, /dev/null itself (opening it has no side effect).
if mknod cdev c 1 3 2>/dev/null; then kinds+=(cdev:"a character device")
else kinds+=(/dev/null:"a character device"); fi
for entry in "${kinds[@]}"; do
  name=${entry%%:*} kind=${entry#*:} tag=$(basename "$name")
  realp=$(realpath "$name")
  qemu-img create -q -f qcow2 -u -b "$name" -F raw "top-$tag.qcow2" 4M
  qemu-img create -q -f qcow2 -u -b "$name" -F raw "top-probed-$tag.qcow2" 4M
  drop_backing_format "top-probed-$tag.qcow2" || soft_fail "$tag: cannot drop the backing format"
  for cmd in info map plan; do
    args=("$cmd" "top-$tag.qcow2"); [ "$cmd" = plan ] && args+=(--budget off)
    refused_unopened "$tag-$cmd" "$name" "$realp" "$kind" "${args[@]}"
  done
  refused_unopened "$tag-probed" "$name" "$realp" "$kind" info "top-probed-$tag.qcow2"
  before=$(sha256sum "top-$tag.qcow2")
  refused_unopened "$tag-merge" "$name" "$realp" "$kind" merge "top-$tag.qcow2" --budget off
  [ "$(sha256sum "top-$tag.qcow2")" = "$before" ] || soft_fail "$tag-merge: changed top-$tag.qcow2"
  # Named directly, as the image of info, map and check.
  for cmd in info map check; do
    refused_unopened "$tag-direct-$cmd" "$name" "$realp" "$kind" "$cmd" "$name"
  done
done
# A symlink to a FIFO: the kind is the file's, whatever the name.
ln -s fifo fifo-link
qemu-img create -q -f qcow2 -u -b fifo-link -F raw top-fifo-link.qcow2 4M
refused_unopened fifo-link-info fifo-link "$work/special/fifo" "a FIFO" info top-fifo-link.qcow2

echo "3. backing files outside the allowed directories are refused before any open"
mkdir -p "$work/policy/allowed" "$work/policy/outside" && cd "$work/policy"
layers 4M outside/base.qcow2='write -P 0x44 0 1M'
outside_real=$work/policy/outside/base.qcow2
ln -s ../outside/base.qcow2 allowed/link.qcow2
ln -s ../outside allowed/dirlink
outside_before=$(sha256sum outside/base.qcow2)
for t in dotdot:../outside/base.qcow2 link:link.qcow2 dirlink:dirlink/base.qcow2 absolute:"$outside_real"; do
  tag=${t%%:*} name=${t#*:}
  new "allowed/top-$tag.qcow2" 4M -f qcow2 -b "$name" -F qcow2
  for cmd in info map; do
    refused_unopened "policy-$tag-$cmd" "$name" "$outside_real" "outside the allowed directories" \
      "$cmd" "allowed/top-$tag.qcow2"
    # The refusal names the exact option and directory that would let the chain be followed.
    grep -qF -- "add --allow-backing-dir $work/policy/outside" "$err" ||
      soft_fail "policy-$tag-$cmd: the error does not name --allow-backing-dir $work/policy/outside: $(cat "$err")"
  done
  refused_unopened "policy-$tag-merge" "$name" "$outside_real" "outside the allowed directories" \
    merge "allowed/top-$tag.qcow2" --budget off
  # Widened by --allow-backing-dir: the same chain opens (the setup is not refused for another
  # reason), through the kernel's resolution.
  check
  got=$("$qcommit" info --output=json --allow-backing-dir "$work/policy/outside" "allowed/top-$tag.qcow2" |
        jq -r '.chain[1].resolved') || true
  [ "$got" = "$outside_real" ] || soft_fail "policy-$tag: with --allow-backing-dir the chain's base is '$got'"
done
[ "$(sha256sum outside/base.qcow2)" = "$outside_before" ] || soft_fail "policy: outside/base.qcow2 changed"

finish "backing-paths: $checks checks, no failures"
