#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.race_soak: a monitoring agent's `qemu-img info` (which takes a shared lock) is waited out,
# never fatal. MERGES (default 200) merges of small chains BASE <- MID <- TOP (varied writes,
# sometimes TOP larger than BASE; into MID or, with --base, into BASE; some with --rebase CHILD,
# half with --delete) while a background loop runs `qemu-img info` on every image every 50 ms.
# Asserts: every merge exits 0, the image merged into shows TOP's view saved before the merge
# (qemu-img compare against `qemu-img convert -O raw`), qemu-img check is clean, MERGES compares
# done; reports (and asserts at least one of) the waits seen in the JSON events and on stderr.
#
# usage: merge-race-soak.sh QCOMMIT [MERGES]
set -euo pipefail
QCOMMIT=$(realpath "$1")
merges=${2:-200}
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.race_soak

# The agent: `qemu-img info` (shared lock, no -U) on each image every 50 ms. Its own
# failures (an image locked by the merge, a file deleted under it) are none of the test's business.
# One loop per image, so that each is looked at every 50 ms.
watch_image() {
  while :; do
    if [[ -e $1 ]]; then qemu-img info "$1" >/dev/null 2>&1 || true; fi
    sleep 0.05
  done
}

# A chain of 4 MiB images (TOP 6 MiB one time in four), each layer with a few writes of its own
# (data, zeroes, discards) at offsets from iteration `i`; the child, when asked, writes too. Made
# in prep/, where the agent does not look (its locks would stop qemu-io), then moved into place.
make_chain() {
  local i=$1 with_child=$2 top_mib=4
  ((i % 4 == 3)) && top_mib=6
  rm -rf prep base.qcow2 mid.qcow2 top.qcow2 child.qcow2 view.raw child.raw
  mkdir prep
  cd prep
  local a=$(((i * 37) % 48)) b=$(((i * 11) % 40)) c=$(((i * 5) % 56))
  layers 4M base.qcow2="write -P $((i % 250 + 1)) 0 3M;write -z $((a * 64))k 256k" \
    mid.qcow2="write -P $((i % 200 + 3)) $((b * 64))k 1M;write -z $((c * 64))k 192k"
  new top.qcow2 "${top_mib}M" -f qcow2 -b mid.qcow2 -F qcow2
  qio -f qcow2 top.qcow2 "write -P $((i % 100 + 7)) $((c * 64))k 512k" "discard $((a * 64))k 128k" \
    "write -P 9 $(((top_mib - 1) * 1024))k 64k"
  if ((with_child)); then
    new child.qcow2 "${top_mib}M" -f qcow2 -b top.qcow2 -F qcow2
    qio -f qcow2 child.qcow2 "write -P 5 $((b * 64))k 64k"
    qemu-img convert -O raw child.qcow2 child.raw
  fi
  qemu-img convert -O raw top.qcow2 view.raw
  mv ./* ..
  cd ..
}

agents=()
for f in base.qcow2 mid.qcow2 top.qcow2 child.qcow2; do
  spawn watch_image "$f"
  agents+=($!)
done

compares=0 json_waits=0 stderr_waits=0 t0=$(date +%s.%N)
for ((i = 0; i < merges; i++)); do
  into=mid.qcow2 args=() child=0 json=$((i % 2))
  ((i % 3 == 1)) && into=base.qcow2 args+=(--base base.qcow2)
  ((i % 5 == 2)) && child=1 args+=(--rebase child.qcow2)
  ((i % 4 < 2)) && args+=(--delete)
  ((json)) && args+=(--output=json)
  make_chain "$i" "$child"
  rc=0; "$QCOMMIT" merge top.qcow2 --budget off "${args[@]}" >out.txt 2>err.txt || rc=$?
  if ((rc)); then
    soft_fail "merge $i (${args[*]}) exited $rc: $(tail -n 3 err.txt)"
    continue
  fi
  json_waits=$((json_waits + $(grep -c '"event": *"wait"' out.txt || true)))
  stderr_waits=$((stderr_waits + $(grep -c '^qcommit: waiting up to' err.txt || true)))
  if qemu-img compare -q view.raw "$into"; then
    compares=$((compares + 1))
  else
    soft_fail "merge $i (${args[*]}): $into does not show TOP's view"
  fi
  qemu-img check -q "$into" >/dev/null 2>&1 || soft_fail "merge $i (${args[*]}): $into is not clean"
  ((!child)) || qemu-img compare -q child.raw child.qcow2 || soft_fail "merge $i: the rebased child's view changed"
done
t1=$(date +%s.%N)
kill "${agents[@]}" 2>/dev/null || soft_fail "a qemu-img info loop died during the soak"
wait "${agents[@]}" 2>/dev/null || true

echo "merge.race_soak: $merges merges in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s," \
  "$compares compares equal, waits seen: $json_waits JSON events, $stderr_waits stderr lines"
((compares == merges)) || soft_fail "$compares compares of $merges merges"
((json_waits + stderr_waits > 0)) || soft_fail "no merge waited for the agent (the soak did not race)"
finish "merge.race_soak: all checks passed"
