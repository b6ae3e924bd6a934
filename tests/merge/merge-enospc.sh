#!/usr/bin/env bash
# merge.enospc: BASE on a filesystem with 40 MiB free, TOP elsewhere providing 80 MiB. BASE
# (128 MiB) is smaller than TOP (256 MiB) and has a backing file of its own, BELOW (256 MiB,
# every byte 0xb7), so the merge also grows BASE over BELOW's bytes. Each merge into the full
# filesystem (O_DIRECT and --no-direct; the second one resumes the first) must fail with exit 1
# and one line naming a file on that filesystem and saying it is full; TOP's guest view must be
# unchanged, qemu-img check must find no corruption in BASE (leaks allowed), and the checkpoint
# must be there (the merge had started writing). After a filler file is removed the same command
# completes, and its result says it resumed; then BASE's view equals TOP's saved view, qemu-img
# check BASE exits 0 (leaks repaired), TOP is byte-identical and no checkpoint is left.
# Run on a tmpfs, and on ext4 over a loop device where the kernel offers one (else said).
# Needs root (mount); the filesystems are unmounted by a trap.
#
# usage: merge-enospc.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-enospc.XXXXXX")
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do if mountpoint -q "$m"; then umount "$m"; fi; done
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
failures=()
fail() { echo "FAIL [$fs]: $*" >&2; failures+=("[$fs] $*"); }
MiB=$((1024 * 1024))

qemu-img create -q -f raw below.raw 256M
qemu-io -f raw -c "write -P 0xb7 0 256M" below.raw >/dev/null

# One filesystem: mounted at $1 with room for BASE's metadata, then filled up to 40 MiB free.
enospc_on() {
  local mnt=$1
  rm -f top.qcow2 view.raw
  qemu-img create -q -f qcow2 -b "$work/below.raw" -F raw "$mnt/base.qcow2" 128M
  qemu-io -f qcow2 -c "write -P 1 0 4M" "$mnt/base.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -b "$mnt/base.qcow2" -F qcow2 top.qcow2 256M
  local args=()
  # 1280 distinct clusters (i * odd mod 4096 is a permutation): 80 MiB, twice what is free.
  for ((i = 0; i < 1280; i++)); do args+=(-c "write -P $((i % 251 + 1)) $(((i * 2654435761 % 4096) * 65536)) 64k"); done
  qemu-io -f qcow2 "${args[@]}" top.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view.raw
  local top_sum cp=$mnt/.base.qcow2.qcommit-merge avail
  top_sum=$(sha256sum <top.qcow2)
  avail=$(df --output=avail -B1 "$mnt" | tail -1)
  fallocate -l $((avail - 40 * MiB)) "$mnt/filler"
  echo "$fs: $(($(df --output=avail -B1 "$mnt" | tail -1) / MiB)) MiB free for 80 MiB of TOP's data"

  for direct in "" --no-direct; do
    local rc=0 msg crc
    "$QCOMMIT" merge top.qcow2 --budget off $direct --output=json >out.json 2>err.txt || rc=$?
    msg=$(cat err.txt)
    echo "merge $direct into the full $fs: exit $rc: $msg"
    [[ $rc == 1 ]] || fail "merge $direct on a full filesystem: exit $rc, not 1"
    grep -q '"event": "result"' out.json && fail "merge $direct on a full filesystem printed a result"
    [[ $(wc -l <err.txt) -eq 1 ]] || fail "error is not one line: $msg"
    [[ $msg == *"$mnt/"* ]] || fail "error does not name a file on the full filesystem: $msg"
    [[ $msg == *"No space left on device"* ]] || fail "error does not say the disk is full: $msg"
    [[ -e $cp ]] || fail "no checkpoint beside BASE after merge $direct started writing"
    [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified by the failed merge"
    qemu-img compare -q -f raw -F qcow2 view.raw top.qcow2 || fail "TOP's view changed by the failed merge $direct"
    crc=0
    qemu-img check --output=json "$mnt/base.qcow2" >chk.json 2>chk.err || crc=$?
    echo "qemu-img check BASE after ENOSPC: exit $crc, leaks $(jq '.leaks // 0' chk.json 2>/dev/null)"
    [[ $crc == 0 || $crc == 3 ]] || fail "qemu-img check BASE after ENOSPC: exit $crc $(cat chk.err)"
    [[ $(jq '.corruptions // 0' chk.json 2>/dev/null) == 0 ]] || fail "corruptions in BASE after ENOSPC"
  done

  rm "$mnt/filler"
  local rc=0 result
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >out.json 2>err.txt || rc=$?
  [[ $rc == 0 ]] || fail "merge after freeing space: exit $rc: $(cat err.txt)"
  result=$(jq -c 'select(.event == "result")' out.json 2>/dev/null || true)
  echo "merge after freeing space: $(jq -c '{resumed, "resumed-from", "leaks-repaired", copied, zeroed}' <<<"${result:-null}")"
  [[ $(jq -r '.resumed' <<<"${result:-null}") == true ]] || fail "the re-run does not say it resumed the failed one: ${result:-no result}"
  qemu-img compare -f raw -F qcow2 view.raw "$mnt/base.qcow2" >cmp.out 2>&1 || fail "BASE differs from TOP's view: $(cat cmp.out)"
  qemu-img check -q "$mnt/base.qcow2" || fail "BASE not clean after the completed merge"
  [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified"
  if [[ -e $cp || -e $cp.tmp ]]; then fail "checkpoint left behind"; fi
}

fs=tmpfs
mkdir tmpfs
mounts+=("$work/tmpfs")
mount -t tmpfs -o size=200M qcommit-enospc tmpfs
enospc_on "$work/tmpfs"

fs=ext4
if command -v mkfs.ext4 >/dev/null && [[ -e /dev/loop-control ]]; then
  truncate -s 200M ext4.img
  mkfs.ext4 -q -m 0 ext4.img
  mkdir ext4
  mounts+=("$work/ext4")
  if mount -o loop ext4.img ext4; then
    enospc_on "$work/ext4"
  else
    echo "ext4: no loop device here, not run"
  fi
else
  echo "ext4: no mkfs.ext4 or loop devices here, not run"
fi

if ((${#failures[@]})); then
  printf '  %s\n' "${failures[@]}" >&2
  exit 1
fi
echo "merge.enospc: OK"
