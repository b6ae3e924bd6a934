#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.enospc: BASE (128 MiB, over BELOW: 256 MiB of 0xb7) on a filesystem with 40 MiB free,
# TOP (256 MiB, elsewhere) providing 80 MiB: the merge also grows BASE over BELOW's bytes.
#  - `qcommit plan` counts as data to write exactly TOP's clusters that BASE holds no cluster for
#    (qemu-img map of both), sees what df sees free, and warns that the room is short;
#  - each merge into the full filesystem (O_DIRECT, then --no-direct resuming it) fails with exit 1
#    and one line naming a file there (BASE's first) and saying it is full, how much more the
#    merge needs there (within 2 MiB of what it needs less what was free before; the JSON event
#    carries the same figure) and that the same command resumes from its checkpoint; TOP's view
#    is unchanged, qemu-img check finds no corruption in BASE (leaks allowed), the checkpoint is
#    there (the merge had started writing);
#  - with the filler file cut to free that much (plus 2 MiB and 2 %), the same command completes,
#    its result saying it resumed: BASE shows TOP's saved view, qemu-img check BASE exits 0 (leaks
#    repaired), TOP is byte-identical, no checkpoint is left; with room to spare plan warns of
#    nothing.
# On a tmpfs, and on ext4 over a loop device where the kernel offers one (else said). Needs root.
#
# usage: merge-enospc.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.enospc
efail() { soft_fail "[$fs] $*"; }  # a failure on filesystem $fs
MiB=$((1024 * 1024))
avail() { df --output=avail -B1 "$1" | tail -1; }
# The 64 KiB clusters IMAGE itself holds data for (qemu-img map, depth 0), one index a line.
clusters() {
  qemu-img map --output=json "$1" | jq -r '.[] | select(.depth == 0 and .data) | "\(.start) \(.length)"' |
    awk '{for (c = $1 / 65536; c < ($1 + $2) / 65536; c++) print c}' | sort -u
}

new below.raw 256M -f raw
qio -f raw below.raw "write -P 0xb7 0 256M"

# One filesystem: mounted at $1 with room for BASE's metadata, then filled up to 40 MiB free.
enospc_on() {
  local mnt=$1 top_sum cp=$1/.base.qcow2.qcommit-merge free_before new_data prc=0 plan_err pfree
  local more='' direct rc msg crc want room now result
  rm -f top.qcow2 view.raw
  new "$mnt/base.qcow2" 128M -f qcow2 -b "$work/below.raw" -F raw
  qio "$mnt/base.qcow2" "write -P 1 0 4M"
  new top.qcow2 256M -f qcow2 -b "$mnt/base.qcow2" -F qcow2
  scatter top.qcow2 1280 4096  # 80 MiB, twice what is free
  qemu-img convert -O raw top.qcow2 view.raw
  top_sum=$(sha256sum <top.qcow2)
  fallocate -l $(($(avail "$mnt") - 40 * MiB)) "$mnt/filler"
  free_before=$(avail "$mnt")
  new_data=$(($(comm -23 <(clusters top.qcow2) <(clusters "$mnt/base.qcow2") | wc -l) * 65536))
  echo "$fs: $((free_before / MiB)) MiB free for 80 MiB of TOP's data, $new_data bytes of it in clusters BASE lacks"

  # plan: the data it needs room for, what is free, and a warning.
  "$QCOMMIT" plan top.qcow2 --budget off --output=json >plan.json 2>plan.err || prc=$?
  plan_err=$(cat plan.err)
  echo "plan: exit $prc, $(jq -c '{"space-needed", "space-data", "space-metadata", "space-free", "space-short"}' plan.json 2>/dev/null); $plan_err"
  [[ $prc == 0 ]] || efail "plan exited $prc"
  [[ $(jq '.["space-data"]' plan.json 2>/dev/null) == "$new_data" ]] ||
    efail "plan: space-data is not the $new_data bytes of TOP's clusters that BASE lacks"
  (($(jq '.["space-metadata"] // 1e9' plan.json) <= MiB)) || efail "plan: more than 1 MiB of metadata for one L2 table's worth"
  pfree=$(jq '.["space-free"] // -1' plan.json)
  ((pfree >= free_before - MiB && pfree <= free_before + MiB)) || efail "plan: space-free $pfree, df says $free_before"
  [[ $(jq '.["space-short"] == .["space-needed"] - .["space-free"] and .["space-short"] > 0' plan.json) == true ]] ||
    efail "plan: space-short is not what is needed less what is free"
  [[ $plan_err == *warning*"$mnt/base.qcow2"*"make room for"* ]] || efail "plan does not warn that BASE's filesystem lacks room: $plan_err"

  for direct in "" --no-direct; do
    rc=0; "$QCOMMIT" merge top.qcow2 --budget off $direct --output=json >out.json 2>err.txt || rc=$?
    msg=$(cat err.txt)
    echo "merge $direct into the full $fs: exit $rc: $msg"
    [[ $rc == 1 ]] || efail "merge $direct on a full filesystem: exit $rc, not 1"
    ! grep -q '"event": "result"' out.json || efail "merge $direct on a full filesystem printed a result"
    [[ $(wc -l <err.txt) -eq 1 ]] || efail "error is not one line: $msg"
    [[ $msg == *"$mnt/"* ]] || efail "error does not name a file on the full filesystem: $msg"
    [[ $msg == *"No space left on device"* ]] || efail "error does not say the disk is full: $msg"
    [[ $msg == "qcommit: $mnt/base.qcow2: "* ]] || efail "error does not name BASE's file first: $msg"
    [[ $msg == *"run the same command again: it resumes from its checkpoint"* ]] ||
      efail "error does not say that the same command resumes from the checkpoint: $msg"
    more=$(sed -n 's/.*needs about [^(]*(\([0-9]*\) bytes) more there.*/\1/p' err.txt)
    want=$((new_data - free_before))
    if [[ -z $more ]]; then
      efail "error does not say how much more room the merge needs: $msg"
    else
      echo "  needs $more bytes more; TOP's new clusters less the room free before: $want"
      ((more >= want - 2 * MiB && more <= want + 2 * MiB)) || efail "needs $more more, not within 2 MiB of $want"
      [[ $(jq -r 'select(.event == "no-space") | .["more-bytes"]' out.json 2>/dev/null) == "$more" ]] ||
        efail "no JSON no-space event with more-bytes $more"
    fi
    [[ -e $cp ]] || efail "no checkpoint beside BASE after merge $direct started writing"
    [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || efail "TOP modified by the failed merge"
    qemu-img compare -q -f raw -F qcow2 view.raw top.qcow2 || efail "TOP's view changed by the failed merge $direct"
    crc=0; qemu-img check --output=json "$mnt/base.qcow2" >chk.json 2>chk.err || crc=$?
    echo "qemu-img check BASE after ENOSPC: exit $crc, leaks $(jq '.leaks // 0' chk.json 2>/dev/null)"
    [[ $crc == 0 || $crc == 3 ]] || efail "qemu-img check BASE after ENOSPC: exit $crc $(cat chk.err)"
    [[ $(jq '.corruptions // 0' chk.json 2>/dev/null) == 0 ]] || efail "corruptions in BASE after ENOSPC"
  done

  # Room for what the error said, and a little: the same command completes.
  if [[ -n $more ]]; then
    room=$((more + 2 * MiB + more / 50))
    now=$(avail "$mnt")
    truncate -s $(($(stat -c %s "$mnt/filler") - (room - now))) "$mnt/filler"
    echo "filler cut: $(($(avail "$mnt") / 1024)) KiB free for the $((more / 1024)) KiB the error asked"
  else
    rm "$mnt/filler"
  fi
  "$QCOMMIT" merge top.qcow2 --budget off --output=json >out.json 2>err.txt ||
    efail "merge with the room the error asked for: exit $?: $(cat err.txt)"
  rm -f "$mnt/filler"
  result=$(jq -c 'select(.event == "result")' out.json 2>/dev/null || true)
  echo "merge after freeing space: $(jq -c '{resumed, "resumed-from", "leaks-repaired", copied, zeroed}' <<<"${result:-null}")"
  [[ $(jq -r '.resumed' <<<"${result:-null}") == true ]] || efail "the re-run does not say it resumed the failed one: ${result:-no result}"
  qemu-img compare -f raw -F qcow2 view.raw "$mnt/base.qcow2" >cmp.out 2>&1 || efail "BASE differs from TOP's view: $(cat cmp.out)"
  qemu-img check -q "$mnt/base.qcow2" || efail "BASE not clean after the completed merge"
  [[ "$(sha256sum <top.qcow2)" == "$top_sum" ]] || efail "TOP modified"
  [[ ! -e $cp && ! -e $cp.tmp ]] || efail "checkpoint left behind"
  # Nothing to warn of with room to spare.
  new top2.qcow2 256M -f qcow2 -b "$mnt/base.qcow2" -F qcow2
  qio top2.qcow2 "write -P 9 0 8M"
  "$QCOMMIT" plan top2.qcow2 --budget off >plan.txt 2>plan.err || efail "plan with room: exit $?"
  [[ ! -s plan.err ]] || efail "plan warns although there is room: $(cat plan.err)"
  grep -q '^space needed: ' plan.txt || efail "plan does not say the space needed: $(cat plan.txt)"
  rm -f top2.qcow2
}

fs=tmpfs
mkdir tmpfs
on_exit 'mountpoint -q "$work/tmpfs" && umount "$work/tmpfs"'
mount -t tmpfs -o size=200M qcommit-enospc tmpfs
enospc_on "$work/tmpfs"

fs=ext4
if command -v mkfs.ext4 >/dev/null && [[ -e /dev/loop-control ]]; then
  truncate -s 200M ext4.img
  mkfs.ext4 -q -m 0 ext4.img
  mkdir ext4
  on_exit 'mountpoint -q "$work/ext4" && umount "$work/ext4"'
  if mount -o loop ext4.img ext4; then
    enospc_on "$work/ext4"
  else
    echo "ext4: no loop device here, not run"
  fi
else
  echo "ext4: no mkfs.ext4 or loop devices here, not run"
fi

finish "merge.enospc: OK"
