#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# hostile.refuse_before_writing: a merge refused for a reason it can know before writing leaves
# every file byte for byte as it was (BASE's persistent bitmaps and header included) and no
# checkpoint; `merge --dry-run` and `plan` refuse the same chains with the same exit code as the
# real merge (0 success, 1 error, 3 corrupt image).
#
#   chain            why                                                        exit
#   valid            -                                                          0
#   l1-limit         BASE (512-byte clusters, a bitmap) cannot grow to TOP's
#                    200 GiB: its L1 table would exceed 32 MiB                   1
#   marked-corrupt   BASE has the corrupt bit set                               3
#   base-refcount    BASE's data cluster has refcount 0 (check: corruption)     3
#   top-cut-short    TOP's tables point past its end                            3
#   small-blockdev   a raw BASE on a loop device smaller than TOP (root only)   1
#
# usage: refuse-before-writing.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-refuse.XXXXXX")
loop=
cleanup() {
  [[ -n $loop ]] && losetup -d "$loop" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

# Sets bit 1 (corrupt) of a v3 image's incompatible features.
mark_corrupt() {
  python3 - "$1" <<'PY'
import struct, sys
with open(sys.argv[1], 'r+b') as f:
    f.seek(72)
    v = struct.unpack('>Q', f.read(8))[0] | 2
    f.seek(72)
    f.write(struct.pack('>Q', v))
PY
}

# Each chain in a directory of its own: base.qcow2 (or BASE given by the case) <- top.qcow2.
setup_case() {
  local name=$1
  rm -rf "$work/$name"
  mkdir -p "$work/$name"
  cd "$work/$name"
  case $name in
    valid)
      qemu-img create -q -f qcow2 base.qcow2 64M
      qemu-io -f qcow2 -c "write -P 1 0 4M" base.qcow2 >/dev/null
      qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M
      qemu-io -f qcow2 -c "write -P 7 1M 2M" top.qcow2 >/dev/null ;;
    l1-limit)
      qemu-img create -q -f qcow2 -o cluster_size=512 base.qcow2 1G
      qemu-io -f qcow2 -c "write -P 1 0 1M" base.qcow2 >/dev/null
      qemu-img bitmap --add base.qcow2 backup-0
      qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 200G
      qemu-io -f qcow2 -c "write -P 7 150G 1M" top.qcow2 >/dev/null ;;
    marked-corrupt)
      qemu-img create -q -f qcow2 base.qcow2 64M
      qemu-io -f qcow2 -c "write -P 1 0 4M" base.qcow2 >/dev/null
      qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M
      qemu-io -f qcow2 -c "write -P 7 1M 2M" top.qcow2 >/dev/null
      mark_corrupt base.qcow2 ;;
    base-refcount)
      qemu-img create -q -f qcow2 base.qcow2 4M
      qemu-io -f qcow2 -c "write -P 0xaa 0 64k" base.qcow2 >/dev/null
      python3 "$here/qcow2_patch.py" base.qcow2 refcount-of 0 0
      qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M
      qemu-io -f qcow2 -c "write -P 0x11 1M 64k" top.qcow2 >/dev/null ;;
    top-cut-short)
      qemu-img create -q -f qcow2 base.qcow2 4M
      qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 4M
      qemu-io -f qcow2 -c "write -P 0x11 0 192k" top.qcow2 >/dev/null
      truncate -s -64k top.qcow2 ;;
    small-blockdev)
      truncate -s 32M disk.img
      loop=$(losetup --find --show disk.img 2>/dev/null) || { skipped=1; return 0; }
      qemu-io -f raw -c "write -P 3 0 32M" "$loop" >/dev/null
      qemu-img create -q -f qcow2 -b "$loop" -F raw top.qcow2 64M
      qemu-io -f qcow2 -c "write -P 9 40M 1M" top.qcow2 >/dev/null ;;
  esac
}

base_of() { [[ $1 == small-blockdev ]] && echo "$loop" || echo base.qcow2; }

# Exit code of a command (never fails the script).
rc_of() { local rc=0; "$@" >/dev/null 2>"$work/last.err" || rc=$?; echo "$rc"; }

check_case() {
  local name=$1 want=$2
  local base; base=$(base_of "$name")
  local extra=()
  [[ $name == small-blockdev ]] && extra=(--allow-backing-dir /dev)
  local dry plan real
  dry=$(rc_of "$QCOMMIT" merge top.qcow2 --budget off --dry-run "${extra[@]}")
  plan=$(rc_of "$QCOMMIT" plan top.qcow2 --budget off "${extra[@]}")
  sha256sum top.qcow2 >before.sum
  head -c 64M "$base" | sha256sum >base-before.sum
  real=$(rc_of "$QCOMMIT" merge top.qcow2 --budget off "${extra[@]}")
  local err; err=$(head -c 300 "$work/last.err")
  [[ $real == "$want" ]] || fail "$name: merge exit $real, expected $want ($err)"
  [[ $dry == "$real" ]] || fail "$name: merge --dry-run exit $dry, the merge's $real"
  [[ $plan == "$real" ]] || fail "$name: plan exit $plan, the merge's $real"
  if [[ $want != 0 ]]; then
    [[ $(wc -l <"$work/last.err") == 1 ]] || fail "$name: the refusal is not one line: $err"
    sha256sum -c --quiet before.sum || fail "$name: the refused merge changed TOP"
    head -c 64M "$base" | sha256sum | cmp -s - base-before.sum ||
      fail "$name: the refused merge changed BASE"
    local cp=.base.qcow2.qcommit-merge
    if [[ $name == small-blockdev ]]; then
      [[ -z $(ls -A "$QCOMMIT_STATE_DIR" 2>/dev/null) ]] || fail "$name: the refused merge left a checkpoint"
    else
      [[ ! -e $cp ]] || fail "$name: the refused merge left a checkpoint ($cp)"
    fi
  fi
  if [[ $name == l1-limit ]]; then
    qemu-img info --output=json base.qcow2 | grep -q '"backup-0"' ||
      fail "$name: the refused merge removed BASE's bitmap"
  fi
}

export QCOMMIT_STATE_DIR=$work/state
for row in valid:0 l1-limit:1 marked-corrupt:3 base-refcount:3 top-cut-short:3 small-blockdev:1; do
  name=${row%%:*} want=${row##*:}
  skipped=0
  setup_case "$name"
  if ((skipped)); then
    echo "skip $name: no loop device"
    continue
  fi
  check_case "$name" "$want"
  if [[ -n $loop ]]; then losetup -d "$loop" 2>/dev/null || true; loop=; fi
done

if ((${#failures[@]})); then
  echo "${#failures[@]} failure(s)"
  exit 1
fi
echo "refusals before writing: every refused merge left its files as they were"
