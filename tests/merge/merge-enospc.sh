#!/usr/bin/env bash
# merge.enospc: BASE on a 40 MiB tmpfs, TOP elsewhere providing more data than fits. The merge
# fails with one line naming the file, TOP is untouched and qemu-img check BASE finds no
# corruption; after growing the tmpfs to 200 MiB the same command completes: BASE identical to
# TOP's view, clean. Needs root (mount); the tmpfs is unmounted by a trap.
#
# usage: merge-enospc.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-enospc.XXXXXX")
mnt="$work/small"
mkdir "$mnt"
cleanup() {
  mountpoint -q "$mnt" && umount "$mnt"
  rm -rf "$work"
}
trap cleanup EXIT
mount -t tmpfs -o size=40M qcommit-enospc "$mnt"
cd "$work"
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }

qemu-img create -q -f qcow2 "$mnt/base.qcow2" 256M
qemu-io -f qcow2 -c "write -P 1 0 4M" "$mnt/base.qcow2" >/dev/null
qemu-img create -q -f qcow2 -b "$mnt/base.qcow2" -F qcow2 top.qcow2 256M
args=()
for ((i = 0; i < 1280; i++)); do args+=(-c "write -P $((i % 251 + 1)) $(((i * 2654435761 % 4096) * 65536)) 64k"); done
qemu-io -f qcow2 "${args[@]}" top.qcow2 >/dev/null  # 80 MiB: more than the tmpfs holds
qemu-img convert -O raw top.qcow2 view.raw
top_sum=$(sha256sum <top.qcow2)

for direct in "" --no-direct; do
  rc=0
  "$QCOMMIT" merge top.qcow2 --budget off $direct >out.txt 2>err.txt || rc=$?
  msg=$(cat err.txt)
  echo "merge $direct into a full tmpfs: exit $rc: $msg"
  [[ $rc != 0 ]] || fail "merge $direct succeeded on a full filesystem"
  [[ $(wc -l <err.txt) -eq 1 ]] || fail "error is not one line: $msg"
  [[ $msg == *base.qcow2* ]] || fail "error does not name BASE: $msg"
  grep -qi "space" err.txt || fail "error does not say the disk is full: $msg"
  [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified by the failed merge"
  crc=0
  qemu-img check --output=json "$mnt/base.qcow2" >chk.json 2>chk.err || crc=$?
  echo "qemu-img check BASE after ENOSPC: exit $crc, leaks $(jq '.leaks // 0' chk.json 2>/dev/null)"
  [[ $crc == 0 || $crc == 3 ]] || fail "qemu-img check BASE after ENOSPC: exit $crc $(cat chk.err)"
  [[ $(jq '.corruptions // 0' chk.json 2>/dev/null) == 0 ]] || fail "corruptions in BASE after ENOSPC"
done

mount -o remount,size=200M "$mnt"
out=$("$QCOMMIT" merge top.qcow2 --budget off 2>&1) || fail "merge after enlarging the tmpfs failed: $out"
echo "$out"
qemu-img compare -f raw -F qcow2 view.raw "$mnt/base.qcow2" >/dev/null || fail "BASE differs from TOP's view"
qemu-img check -q "$mnt/base.qcow2" || fail "BASE not clean after the completed merge"
[[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified"
if ((${#failures[@]})); then printf '  %s\n' "${failures[@]}" >&2; exit 1; fi
echo "merge.enospc: OK"
