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
. "$here/../lib/test.sh"
setup hostile.refuse_before_writing
loop=
on_exit '[[ -z $loop ]] || losetup -d "$loop" 2>/dev/null'

mark_corrupt() {  # sets bit 1 (corrupt) of a v3 image's incompatible features (big-endian at 72)
  python3 -c 'import sys; f = open(sys.argv[1], "r+b"); f.seek(79); b = f.read(1)[0]; f.seek(79); f.write(bytes([b | 2]))' "$1"
}

# Each chain in a directory of its own: base.qcow2 (or BASE given by the case) <- top.qcow2.
setup_case() {
  local name=$1
  mkdir -p "$work/$name"
  cd "$work/$name"
  case $name in
    valid) small_chain ;;
    marked-corrupt) small_chain; mark_corrupt base.qcow2 ;;
    l1-limit)
      new base.qcow2 1G -f qcow2 -o cluster_size=512
      qio base.qcow2 "write -P 1 0 1M"
      qemu-img bitmap --add base.qcow2 backup-0
      new top.qcow2 200G -f qcow2 -b base.qcow2 -F qcow2
      qio top.qcow2 "write -P 7 150G 1M" ;;
    base-refcount)
      new base.qcow2 4M -f qcow2
      qio base.qcow2 "write -P 0xaa 0 64k"
      python3 "$here/qcow2_patch.py" base.qcow2 refcount-of 0 0
      new top.qcow2 4M -f qcow2 -b base.qcow2 -F qcow2
      qio top.qcow2 "write -P 0x11 1M 64k" ;;
    top-cut-short)
      layers 4M base.qcow2 top.qcow2="write -P 0x11 0 192k"
      truncate -s -64k top.qcow2 ;;
    small-blockdev)
      truncate -s 32M disk.img
      loop=$(losetup --find --show disk.img 2>/dev/null) || { skipped=1; return 0; }
      qio -f raw "$loop" "write -P 3 0 32M"
      new top.qcow2 64M -f qcow2 -b "$loop" -F raw
      qio top.qcow2 "write -P 9 40M 1M" ;;
  esac
}

# Exit code of a command (never fails the script).
rc_of() { local rc=0; "$@" >/dev/null 2>"$work/last.err" || rc=$?; echo "$rc"; }

check_case() {
  local name=$1 want=$2 base=base.qcow2 extra=() dry plan real err cp=.base.qcow2.qcommit-merge
  [[ $name != small-blockdev ]] || base=$loop extra=(--allow-backing-dir /dev)
  dry=$(rc_of "$QCOMMIT" merge top.qcow2 --budget off --dry-run "${extra[@]}")
  plan=$(rc_of "$QCOMMIT" plan top.qcow2 --budget off "${extra[@]}")
  sha256sum top.qcow2 >before.sum
  head -c 64M "$base" | sha256sum >base-before.sum
  real=$(rc_of "$QCOMMIT" merge top.qcow2 --budget off "${extra[@]}")
  err=$(head -c 300 "$work/last.err")
  [[ $real == "$want" ]] || soft_fail "$name: merge exit $real, expected $want ($err)"
  [[ $dry == "$real" ]] || soft_fail "$name: merge --dry-run exit $dry, the merge's $real"
  [[ $plan == "$real" ]] || soft_fail "$name: plan exit $plan, the merge's $real"
  if [[ $want != 0 ]]; then
    [[ $(wc -l <"$work/last.err") == 1 ]] || soft_fail "$name: the refusal is not one line: $err"
    sha256sum -c --quiet before.sum || soft_fail "$name: the refused merge changed TOP"
    head -c 64M "$base" | sha256sum | cmp -s - base-before.sum ||
      soft_fail "$name: the refused merge changed BASE"
    if [[ $name == small-blockdev ]]; then
      [[ -z $(ls -A "$QCOMMIT_STATE_DIR" 2>/dev/null) ]] || soft_fail "$name: the refused merge left a checkpoint"
    else
      [[ ! -e $cp ]] || soft_fail "$name: the refused merge left a checkpoint ($cp)"
    fi
  fi
  [[ $name != l1-limit ]] || qemu-img info --output=json base.qcow2 | grep -q '"backup-0"' ||
    soft_fail "$name: the refused merge removed BASE's bitmap"
}

export QCOMMIT_STATE_DIR=$work/state
for row in valid:0 l1-limit:1 marked-corrupt:3 base-refcount:3 top-cut-short:3 small-blockdev:1; do
  name=${row%%:*} want=${row##*:}
  skipped=0
  setup_case "$name"
  ((!skipped)) || { echo "skip $name: no loop device"; continue; }
  check_case "$name" "$want"
  if [[ -n $loop ]]; then losetup -d "$loop" 2>/dev/null || true; loop=; fi
done

finish "refusals before writing: every refused merge left its files as they were"
