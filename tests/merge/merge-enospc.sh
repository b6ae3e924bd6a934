#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.enospc: BASE on a filesystem with 40 MiB free, TOP elsewhere providing 80 MiB. BASE
# (128 MiB) is smaller than TOP (256 MiB) and has a backing file of its own, BELOW (256 MiB,
# every byte 0xb7), so the merge also grows BASE over BELOW's bytes. Each merge into the full
# filesystem (O_DIRECT and --no-direct; the second one resumes the first) must fail with exit 1
# and one line naming a file on that filesystem and saying it is full; TOP's guest view must be
# unchanged, qemu-img check must find no corruption in BASE (leaks allowed), and the checkpoint
# must be there (the merge had started writing). How much room the merge needs is known before
# it starts: the clusters of TOP that BASE holds no cluster for (qemu-img map of both). `qcommit
# plan` must count exactly those as the data to write, see what df sees free, and warn that the
# room is short. The error line must say how much more the merge needs there (within 2 MiB of
# what it needs less what was free before it started), that the same command run again resumes
# from its checkpoint, and the JSON event must carry the same figure. Then the filler file is
# cut so that just that much (plus 2 MiB and 2 %) is free, and the same command completes, its
# result saying it resumed; then BASE's view equals TOP's saved view, qemu-img check BASE exits 0
# (leaks repaired), TOP is byte-identical and no checkpoint is left. Without the filler, plan
# warns of nothing.
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
avail() { df --output=avail -B1 "$1" | tail -1; }
# The 64 KiB clusters IMAGE itself holds data for (qemu-img map, depth 0), one index a line.
clusters() {
  qemu-img map --output=json "$1" | jq -r '.[] | select(.depth == 0 and .data) | "\(.start) \(.length)"' |
    awk '{for (c = $1 / 65536; c < ($1 + $2) / 65536; c++) print c}' | sort -u
}

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
  local free_before new_data
  free_before=$(avail "$mnt")
  new_data=$(($(comm -23 <(clusters top.qcow2) <(clusters "$mnt/base.qcow2") | wc -l) * 65536))
  echo "$fs: $((free_before / MiB)) MiB free for 80 MiB of TOP's data, $new_data bytes of it in clusters BASE lacks"

  # plan: the data it needs room for, what is free, and a warning.
  local prc=0 plan_err
  "$QCOMMIT" plan top.qcow2 --budget off --output=json >plan.json 2>plan.err || prc=$?
  plan_err=$(cat plan.err)
  echo "plan: exit $prc, $(jq -c '{"space-needed", "space-data", "space-metadata", "space-free", "space-short"}' plan.json 2>/dev/null); $plan_err"
  [[ $prc == 0 ]] || fail "plan exited $prc"
  [[ $(jq '.["space-data"]' plan.json 2>/dev/null) == "$new_data" ]] ||
    fail "plan: space-data is not the $new_data bytes of TOP's clusters that BASE lacks"
  (($(jq '.["space-metadata"] // 1e9' plan.json) <= MiB)) || fail "plan: more than 1 MiB of metadata for one L2 table's worth"
  local pfree
  pfree=$(jq '.["space-free"] // -1' plan.json)
  ((pfree >= free_before - MiB && pfree <= free_before + MiB)) || fail "plan: space-free $pfree, df says $free_before"
  [[ $(jq '.["space-short"] == .["space-needed"] - .["space-free"] and .["space-short"] > 0' plan.json) == true ]] ||
    fail "plan: space-short is not what is needed less what is free"
  [[ $plan_err == *warning*"$mnt/base.qcow2"*"make room for"* ]] || fail "plan does not warn that BASE's filesystem lacks room: $plan_err"

  local more=
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
    [[ $msg == "qcommit: $mnt/base.qcow2: "* ]] || fail "error does not name BASE's file first: $msg"
    [[ $msg == *"run the same command again: it resumes from its checkpoint"* ]] ||
      fail "error does not say that the same command resumes from the checkpoint: $msg"
    more=$(sed -n 's/.*needs about [^(]*(\([0-9]*\) bytes) more there.*/\1/p' err.txt)
    local want=$((new_data - free_before))
    if [[ -z $more ]]; then
      fail "error does not say how much more room the merge needs: $msg"
    else
      echo "  needs $more bytes more; TOP's new clusters less the room free before: $want"
      ((more >= want - 2 * MiB && more <= want + 2 * MiB)) || fail "needs $more more, not within 2 MiB of $want"
      [[ $(jq -r 'select(.event == "no-space") | .["more-bytes"]' out.json 2>/dev/null) == "$more" ]] ||
        fail "no JSON no-space event with more-bytes $more"
    fi
    [[ -e $cp ]] || fail "no checkpoint beside BASE after merge $direct started writing"
    [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified by the failed merge"
    qemu-img compare -q -f raw -F qcow2 view.raw top.qcow2 || fail "TOP's view changed by the failed merge $direct"
    crc=0
    qemu-img check --output=json "$mnt/base.qcow2" >chk.json 2>chk.err || crc=$?
    echo "qemu-img check BASE after ENOSPC: exit $crc, leaks $(jq '.leaks // 0' chk.json 2>/dev/null)"
    [[ $crc == 0 || $crc == 3 ]] || fail "qemu-img check BASE after ENOSPC: exit $crc $(cat chk.err)"
    [[ $(jq '.corruptions // 0' chk.json 2>/dev/null) == 0 ]] || fail "corruptions in BASE after ENOSPC"
  done

  # Room for what the error said, and a little: the same command completes.
  if [[ -n $more ]]; then
    local room=$((more + 2 * MiB + more / 50)) now
    now=$(avail "$mnt")
    truncate -s $(($(stat -c %s "$mnt/filler") - (room - now))) "$mnt/filler"
    echo "filler cut: $(($(avail "$mnt") / 1024)) KiB free for the $((more / 1024)) KiB the error asked"
  else
    rm "$mnt/filler"
  fi
  local rc=0 result
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >out.json 2>err.txt || rc=$?
  [[ $rc == 0 ]] || fail "merge with the room the error asked for: exit $rc: $(cat err.txt)"
  rm -f "$mnt/filler"
  result=$(jq -c 'select(.event == "result")' out.json 2>/dev/null || true)
  echo "merge after freeing space: $(jq -c '{resumed, "resumed-from", "leaks-repaired", copied, zeroed}' <<<"${result:-null}")"
  [[ $(jq -r '.resumed' <<<"${result:-null}") == true ]] || fail "the re-run does not say it resumed the failed one: ${result:-no result}"
  qemu-img compare -f raw -F qcow2 view.raw "$mnt/base.qcow2" >cmp.out 2>&1 || fail "BASE differs from TOP's view: $(cat cmp.out)"
  qemu-img check -q "$mnt/base.qcow2" || fail "BASE not clean after the completed merge"
  [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || fail "TOP modified"
  if [[ -e $cp || -e $cp.tmp ]]; then fail "checkpoint left behind"; fi
  # Nothing to warn of with room to spare.
  qemu-img create -q -f qcow2 -b "$mnt/base.qcow2" -F qcow2 top2.qcow2 256M
  qemu-io -f qcow2 -c "write -P 9 0 8M" top2.qcow2 >/dev/null
  "$QCOMMIT" plan top2.qcow2 --budget off >plan.txt 2>plan.err || fail "plan with room: exit $?"
  [[ ! -s plan.err ]] || fail "plan warns although there is room: $(cat plan.err)"
  grep -q '^space needed: ' plan.txt || fail "plan does not say the space needed: $(cat plan.txt)"
  rm -f top2.qcow2
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
