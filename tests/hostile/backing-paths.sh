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
set -uo pipefail
qcommit=$(realpath "$1")
for tool in qemu-img qemu-io strace jq python3; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool not found (scripts/bootstrap installs it)"; exit 1; }
done
work=$(mktemp -d /tmp/qcommit-paths.XXXXXX)
trap 'rm -rf "$work"' EXIT
work=$(realpath "$work")
fails=0 checks=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
check() { checks=$((checks + 1)); }
kTimeout=10

# drop_backing_format IMAGE: turns the backing format header extension into an unknown (ignored)
# one, so that readers probe the backing file's format (qemu-img no longer creates such images).
drop_backing_format() {
  python3 - "$1" <<'PY'
import struct, sys
with open(sys.argv[1], 'r+b') as f:
    head = f.read(4096)
    pos = struct.unpack('>I', head[100:104])[0] if struct.unpack('>I', head[4:8])[0] >= 3 else 72
    while pos + 8 <= len(head):
        magic, length = struct.unpack('>II', head[pos:pos + 8])
        if magic == 0:
            break
        if magic == 0xe2792aca:
            f.seek(pos)
            f.write(struct.pack('>I', 0x7e570000))
            sys.exit(0)
        pos += 8 + ((length + 7) & ~7)
sys.exit('no backing format extension in ' + sys.argv[1])
PY
}

# traced TAG ARGS... : runs qcommit ARGS in the current directory under strace (following forks,
# fds decoded to paths with -y), at most kTimeout seconds. Sets rc, err (stderr file), log.
traced() {
  local tag=$1; shift
  log=$work/$tag.strace err=$work/$tag.err rc=0
  timeout "$kTimeout" strace -f -y -qq -e trace=open,openat -o "$log" "$qcommit" "$@" \
    >"$work/$tag.out" 2>"$err" || rc=$?
}

# opened_for_io LOG NAME REAL: the open()/openat() lines without O_PATH whose path argument ends
# in NAME, or whose returned descriptor is the file REAL.
opened_for_io() {
  grep -E '(^|[^a-z0-9_])open(at)?\(' "$1" | grep -v 'O_PATH' |
    grep -F -e "\"$2\"" -e "/$2\"" -e "<$3>" || true
}

# refused_unopened TAG NAME REAL NEEDLE ARGS... : qcommit ARGS fails (no timeout, no signal) with
# one line on stderr naming NAME and containing NEEDLE, and never opens REAL for I/O.
refused_unopened() {
  local tag=$1 name=$2 realp=$3 needle=$4; shift 4
  traced "$tag" "$@"
  check
  if [ $rc -eq 0 ] || [ $rc -ge 124 ]; then
    fail "$tag: qcommit $* exited $rc (timeout or signal: >= 124), expected a refusal: $(head -3 "$err")"
  fi
  [ "$(wc -l <"$err")" -eq 1 ] || fail "$tag: $(wc -l <"$err") lines on stderr, expected one: $(head -3 "$err")"
  grep -qF -- "$name" "$err" || fail "$tag: error does not name $name: $(cat "$err")"
  grep -qF -- "$needle" "$err" || fail "$tag: error does not say '$needle': $(cat "$err")"
  grep -q 'open' "$log" || fail "$tag: strace recorded no open at all (is tracing working?)"
  local bad; bad=$(opened_for_io "$log" "$name" "$realp")
  [ -z "$bad" ] || fail "$tag: $realp was opened for I/O: $bad"
  echo "  $tag: exit $rc: $(head -1 "$err")"
}

echo "1. symlink/.. backing names: QEMU's chain, merged into the file QEMU uses"
mkdir -p "$work/dotdot/real/sub" && cd "$work/dotdot" || exit 1
ln -s real/sub link
qemu-img create -q -f qcow2 real/base.qcow2 8M
qemu-io -f qcow2 -c 'write -P 0x11 0 2M' real/base.qcow2 >/dev/null
qemu-img create -q -f qcow2 base.qcow2 8M
qemu-io -f qcow2 -c 'write -P 0xdd 0 4M' base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b link/../base.qcow2 -F qcow2 top.qcow2 8M
qemu-io -f qcow2 -c 'write -P 0x22 1M 2M' -c 'write -z 6M 64k' top.qcow2 >/dev/null
# A two-level chain: mid.qcow2 lives in real/sub and names "../base.qcow2"; QEMU joins it to
# "link/" (the directory part of mid's name as top names it): link/../base.qcow2 again.
qemu-img create -q -f qcow2 -b ../base.qcow2 -F qcow2 real/sub/mid.qcow2 8M
qemu-io -f qcow2 -c 'write -P 0x33 4M 1M' real/sub/mid.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b link/mid.qcow2 -F qcow2 top2.qcow2 8M

# chain_matches TAG DIR IMAGE: from DIR, qcommit info's chain equals qemu-img's, by name (what
# QEMU calls the filename) and by the file the kernel resolves it to.
chain_matches() {
  local tag=$1 dir=$2 image=$3 want got want_real got_real f
  check
  want=$(cd "$dir" && qemu-img info --backing-chain --output=json "$image" | jq -r '.[].filename')
  got=$(cd "$dir" && "$qcommit" info --output=json "$image" | jq -r '.chain[].filename')
  [ -n "$want" ] && [ "$want" = "$got" ] || fail "$tag: chain $(echo $got) != qemu-img's $(echo $want)"
  want_real=$(cd "$dir" && while read -r f; do realpath "$f"; done <<<"$want")
  got_real=$(cd "$dir" && "$qcommit" info --output=json "$image" | jq -r '.chain[].resolved')
  [ "$want_real" = "$got_real" ] || fail "$tag: resolved chain $(echo $got_real) != $(echo $want_real)"
  echo "  $tag: $(echo $got)"
}
chain_matches relative "$work/dotdot" top.qcow2
chain_matches dot-slash "$work/dotdot" ./top.qcow2
chain_matches absolute / "$work/dotdot/top.qcow2"
chain_matches from-parent "$work" dotdot/top.qcow2
chain_matches two-level "$work/dotdot" top2.qcow2
chain_matches two-level-absolute / "$work/dotdot/top2.qcow2"

check
plan=$("$qcommit" plan --output=json --budget off top.qcow2)
[ "$(jq -r '."resolved-base"' <<<"$plan")" = "$work/dotdot/real/base.qcow2" ] &&
  [ "$(jq -r '.base' <<<"$plan")" = "link/../base.qcow2" ] ||
  fail "plan: base $(jq -c '{base, "resolved-base"}' <<<"$plan"), expected link/../base.qcow2 -> real/base.qcow2"
"$qcommit" plan --budget off top.qcow2 | grep -qF "link/../base.qcow2 -> $work/dotdot/real/base.qcow2" ||
  fail "plan: human output does not show the resolved base: $("$qcommit" plan --budget off top.qcow2)"

qemu-img convert -f qcow2 -O raw top.qcow2 "$work/top-view.raw"
decoy_before=$(sha256sum base.qcow2)
check
merge_fails=$fails
if ! "$qcommit" merge --budget off top.qcow2 >"$work/merge.out" 2>"$work/merge.err"; then
  fail "merge of top.qcow2 failed: $(cat "$work/merge.err")"
fi
[ "$(sha256sum base.qcow2)" = "$decoy_before" ] || fail "merge changed the decoy ./base.qcow2"
qemu-img compare -q -f raw -F qcow2 "$work/top-view.raw" real/base.qcow2 ||
  fail "real/base.qcow2 after the merge differs from TOP's original view"
qemu-img check -q real/base.qcow2 || fail "qemu-img check real/base.qcow2 after the merge"
[ $fails -eq $merge_fails ] && echo "  merge: into real/base.qcow2, decoy untouched"

echo "2. backing files that are not regular files or block devices are never opened"
mkdir -p "$work/special" && cd "$work/special" || exit 1
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
  drop_backing_format "top-probed-$tag.qcow2" || fail "$tag: cannot drop the backing format"
  for cmd in info map plan; do
    args=("$cmd" "top-$tag.qcow2"); [ "$cmd" = plan ] && args+=(--budget off)
    refused_unopened "$tag-$cmd" "$name" "$realp" "$kind" "${args[@]}"
  done
  refused_unopened "$tag-probed" "$name" "$realp" "$kind" info "top-probed-$tag.qcow2"
  before=$(sha256sum "top-$tag.qcow2")
  refused_unopened "$tag-merge" "$name" "$realp" "$kind" merge "top-$tag.qcow2" --budget off
  [ "$(sha256sum "top-$tag.qcow2")" = "$before" ] || fail "$tag-merge: changed top-$tag.qcow2"
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
mkdir -p "$work/policy/allowed" "$work/policy/outside" && cd "$work/policy" || exit 1
qemu-img create -q -f qcow2 outside/base.qcow2 4M
qemu-io -f qcow2 -c 'write -P 0x44 0 1M' outside/base.qcow2 >/dev/null
outside_real=$work/policy/outside/base.qcow2
ln -s ../outside/base.qcow2 allowed/link.qcow2
ln -s ../outside allowed/dirlink
qemu-img create -q -f qcow2 -b ../outside/base.qcow2 -F qcow2 allowed/top-dotdot.qcow2 4M
qemu-img create -q -f qcow2 -b link.qcow2 -F qcow2 allowed/top-link.qcow2 4M
qemu-img create -q -f qcow2 -b dirlink/base.qcow2 -F qcow2 allowed/top-dirlink.qcow2 4M
qemu-img create -q -f qcow2 -b "$outside_real" -F qcow2 allowed/top-absolute.qcow2 4M
outside_before=$(sha256sum outside/base.qcow2)
for t in dotdot:../outside/base.qcow2 link:link.qcow2 dirlink:dirlink/base.qcow2 absolute:"$outside_real"; do
  tag=${t%%:*} name=${t#*:}
  for cmd in info map; do
    refused_unopened "policy-$tag-$cmd" "$name" "$outside_real" "outside the allowed directories" \
      "$cmd" "allowed/top-$tag.qcow2"
    # The refusal names the exact option and directory that would let the chain be followed.
    grep -qF -- "add --allow-backing-dir $work/policy/outside" "$err" ||
      fail "policy-$tag-$cmd: the error does not name --allow-backing-dir $work/policy/outside: $(cat "$err")"
  done
  refused_unopened "policy-$tag-merge" "$name" "$outside_real" "outside the allowed directories" \
    merge "allowed/top-$tag.qcow2" --budget off
  # Widened by --allow-backing-dir: the same chain opens (the setup is not refused for another
  # reason), through the kernel's resolution.
  check
  got=$("$qcommit" info --output=json --allow-backing-dir "$work/policy/outside" "allowed/top-$tag.qcow2" |
        jq -r '.chain[1].resolved')
  [ "$got" = "$outside_real" ] || fail "policy-$tag: with --allow-backing-dir the chain's base is '$got'"
done
[ "$(sha256sum outside/base.qcow2)" = "$outside_before" ] || fail "policy: outside/base.qcow2 changed"

echo "backing-paths: $checks checks, $fails failures"
[ $fails -eq 0 ]
