#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.matrix: chains of depth 1-6 built with qemu-img/qemu-io (4K/64K/2M/512B clusters, compat
# 0.10 and 1.1, extended L2, zlib and zstd compressed layers, zero writes with and without unmap,
# unaligned writes and discards, TOP larger than BASE, raw BASE, BASE with its own backing file,
# BASE with an internal snapshot and a persistent bitmap, refcount_bits 1 and 64, a BASE smaller
# than its own backing file and than TOP).
# For every (TOP, BASE) pair of every chain, on a fresh copy of the chain:
#   qcommit merge TOP --base BASE --budget off --rebase CHILD   (CHILD: a new overlay on TOP)
# then: BASE's view == TOP's view saved before (qemu-img compare); CHILD's view unchanged and
# backed by BASE; qemu-img check BASE and qcommit check BASE both exit 0; TOP and the
# intermediates byte-identical (sha256); no checkpoint left behind.
# Also: --delete removes TOP and the intermediates; on an image left leaky by a killed merge,
# qemu-img check and qcommit check report the same leak count and no corruption.
#
# usage: merge-matrix.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.matrix
pairs=0

# Writes of every kind, spread over the first $2 MiB, varied by seed $3.
scribble() {
  local img=$1 mib=$2 s=$3
  local span=$((mib * 1024 * 1024))
  local a=$(((s * 7919 * 65536) % (span - 4 * 1048576)))
  local b=$(((s * 104729 * 4096 + 12345) % (span - 4 * 1048576)))
  local c=$(((s * 15485863 * 512 + 777) % (span - 4 * 1048576)))
  qio "$img" \
    "write -P $((s + 1)) $a 1M" \
    "write -P $((s + 17)) $((a + 3 * 1048576)) 64k" \
    "write -P $((s + 33)) $b 70001" \
    "write -P $((s + 49)) $((c + 1)) 511" \
    "write -z $((b + 200000)) 300000" \
    "write -z -u $((c + 65536)) 131072" \
    "discard $((a + 12345)) 200000" \
    "write -P $((s + 65)) $((span - 70000)) 70000"
}

# ---------------------------------------------------------------------------------------------
# Chains: each builds into the current directory and sets LAYERS (bottom first).
LAYERS=()
# layer NAME MIB SEED CREATE_ARGS...: an image of MIB MiB (raw if NAME ends in .raw, else qcow2)
# over the last of LAYERS (if any), scribbled with SEED (none if -); appended to LAYERS.
layer() {
  local name=$1 mib=$2 seed=$3 fmt=qcow2 below=()
  shift 3
  [[ $name == *.raw ]] && fmt=raw
  ((${#LAYERS[@]})) && below=(-b "${LAYERS[-1]}" -F "$(fmt_of "${LAYERS[-1]}")")
  new "$name" "${mib}M" -f $fmt "$@" "${below[@]}"
  [[ $seed == - ]] || scribble "$name" "$mib" "$seed"
  LAYERS+=("$name")
}
chain_d1() {  # depth 1: 64K over 64K, TOP larger than BASE
  layer base.qcow2 64 1 -o compat=1.1
  layer top.qcow2 80 2
}
chain_d2() {  # depth 2: compat 0.10 4K base, 2M mid, extended-L2 top
  layer base.qcow2 64 3 -o compat=0.10,cluster_size=4k
  layer mid.qcow2 64 4 -o cluster_size=2M
  layer top.qcow2 72 5 -o extended_l2=on,cluster_size=64k
  qio top.qcow2 "write -P 9 $((5 * 1048576 + 2048)) 2048" "write -z $((6 * 1048576 + 4096)) 6144"
}
chain_d3() {  # depth 3: raw base, 4K, 512B, 64K (larger)
  layer base.raw 64 6
  layer l1.qcow2 64 7 -o cluster_size=4k
  layer l2.qcow2 64 8 -o cluster_size=512
  layer l3.qcow2 96 9
}
chain_d4() {  # depth 4: base with its own backing file, zlib and zstd compressed layers
  layer bb.qcow2 64 10
  layer base.qcow2 64 11
  layer w1.qcow2 64 12
  qemu-img convert -c -O qcow2 -o compression_type=zlib -B base.qcow2 -F qcow2 w1.qcow2 zlib.qcow2
  LAYERS[-1]=zlib.qcow2
  layer w2.qcow2 64 13
  qemu-img convert -c -O qcow2 -o compression_type=zstd -B zlib.qcow2 -F qcow2 w2.qcow2 zstd.qcow2
  LAYERS[-1]=zstd.qcow2
  rm -f w1.qcow2 w2.qcow2
  layer top.qcow2 64 14 -o cluster_size=4k
}
chain_d5() {  # depth 5: 64-bit refcounts, internal snapshot (shared clusters) and a bitmap in BASE
  layer base.qcow2 64 15 -o refcount_bits=64
  qemu-img snapshot -c snap1 base.qcow2
  qio base.qcow2 "write -P 99 0 2M"  # some clusters private, the rest shared with snap1
  qemu-img bitmap --add base.qcow2 dirty0
  local i=0 opts
  for opts in cluster_size=64k cluster_size=4k cluster_size=2M extended_l2=on,cluster_size=128k cluster_size=64k; do
    layer "l$((++i)).qcow2" 64 $((15 + i)) -o "$opts"
  done
}
chain_d6() {  # depth 6: 1-bit refcounts in BASE, mixed cluster sizes, growing sizes
  layer base.qcow2 48 21 -o refcount_bits=1
  local i=0 cs
  for cs in 4k 64k 2M 512 64k 4k; do layer "l$((++i)).qcow2" $((48 + 4 * i)) $((21 + i)) -o cluster_size=$cs; done
}
chain_d7() {  # depth 3: a BASE smaller than both its own backing file and the layers above it
  # What TOP shows past BASE's end reads as zeros, never as BASE's backing file's data.
  layer bb.qcow2 48 -
  qio bb.qcow2 "write -P 5 0 48M"
  layer base.qcow2 16 31
  layer l1.qcow2 32 -
  qio l1.qcow2 "write -P 32 1M 64k" "write -P 33 $((20 * 1048576)) 1M"
  layer top.qcow2 48 - -o cluster_size=4k
  qio top.qcow2 "write -P 34 $((15 * 1048576)) 2M" "write -P 35 $((40 * 1048576)) 64k"
}

# One merge of a fresh copy of chain $1: TOP index $2, BASE index $3, extra merge args after.
run_pair() {
  local chain=$1 t=$2 b=$3
  shift 3
  local extra=("$@") layers=() i sums=() out tsize bsize backing
  cd "$work" && rm -rf run && cp -a --sparse=always "proto-$chain" run && cd run
  read -r -a layers <layers.txt
  local top=${layers[$t]} base=${layers[$b]} bfmt
  local what="$chain: TOP=$top BASE=$base ${extra[*]}" cp=".${base##*/}.qcommit-merge"
  bfmt=$(fmt_of "$base")
  qemu-img create -q -f qcow2 -b "$top" -F qcow2 child.qcow2
  qio child.qcow2 "write -P 201 1M 64k" "write -z 8M 1M"
  qemu-img convert -O raw "$top" before-top.raw
  qemu-img convert -O raw child.qcow2 before-child.raw
  for ((i = b + 1; i <= t; i++)); do sums+=("$(sha256sum <"${layers[$i]}")"); done
  pairs=$((pairs + 1))
  if ! out=$("$QCOMMIT" merge "$top" --base "$base" --budget off --rebase child.qcow2 "${extra[@]}" 2>&1); then
    soft_fail "$what: qcommit merge failed: $out"
    return
  fi
  tsize=$(stat -c %s before-top.raw)
  bsize=$(qemu-img info -U --output=json "$base" | jq '."virtual-size"')
  if ((bsize > tsize)); then
    # A BASE larger than TOP keeps its size, and beyond TOP's end its own data (as with qemu-img
    # commit): TOP's view is compared with BASE's first TOP-size bytes.
    qemu-img convert -O raw "$base" after-base.raw && truncate -s "$tsize" after-base.raw
    cmp -s before-top.raw after-base.raw ||
      soft_fail "$what: BASE's first $tsize bytes differ from TOP's view before the merge"
  elif ! qemu-img compare -f raw -F "$bfmt" before-top.raw "$base" >/dev/null 2>cmp.err; then
    soft_fail "$what: BASE's view differs from TOP's view before the merge: $(head -c 300 cmp.err)"
  fi
  for ((i = b + 1; i <= t; i++)); do
    if [[ " ${extra[*]} " == *" --delete "* ]]; then
      [[ ! -e ${layers[$i]} ]] || soft_fail "$what: --delete left ${layers[$i]} in place"
    elif [[ "$(sha256sum <"${layers[$i]}")" != "${sums[$((i - b - 1))]}" ]]; then
      soft_fail "$what: ${layers[$i]} was modified"
    fi
  done
  qemu-img convert -O raw child.qcow2 after-child.raw
  cmp -s before-child.raw after-child.raw || soft_fail "$what: CHILD's view changed"
  backing=$(qemu-img info --output=json child.qcow2 | jq -r '."full-backing-filename" // empty')
  [[ -n $backing && "$(realpath "$backing")" == "$(realpath "$base")" ]] ||
    soft_fail "$what: CHILD is backed by '$backing', not BASE"
  if [[ $bfmt == qcow2 ]]; then
    qemu-img check -q "$base" >chk.out 2>&1 || soft_fail "$what: qemu-img check BASE exit $?: $(head -c 300 chk.out)"
    "$QCOMMIT" check "$base" >chk.out 2>&1 || soft_fail "$what: qcommit check BASE exit $?: $(head -c 300 chk.out)"
  fi
  [[ ! -e $cp ]] || soft_fail "$what: checkpoint $cp left behind"
}

start=$SECONDS
for chain in ${MATRIX_CHAINS:-d1 d2 d3 d4 d5 d6 d7}; do
  mkdir "proto-$chain"
  (cd "proto-$chain" && "chain_$chain" && echo "${LAYERS[*]}" >layers.txt)
  read -r -a layers <"proto-$chain/layers.txt"
  n=${#layers[@]}
  for ((t = 1; t < n; t++)); do
    for ((b = 0; b < t; b++)); do run_pair "$chain" "$t" "$b"; done
  done
  run_pair "$chain" $((n - 1)) 0 --delete
  cd "$work"
  echo "chain $chain (${n} images): done, $pairs merges so far, $((SECONDS - start)) s"
  rm -rf "proto-$chain" run
done

# ---------------------------------------------------------------------------------------------
# A leaky image (a merge killed mid-copy): qemu-img check and qcommit check must agree.
mkdir leak && cd leak
layers 512M base.qcow2 top.qcow2
scatter top.qcow2 1500 8192
qemu-img convert -O raw top.qcow2 top.raw
agreed=0 resumed_runs=0
for attempt in 1 2 3; do
  cp -a --sparse=always base.qcow2 b.qcow2
  cp top.qcow2 t.qcow2 && qemu-img rebase -u -b b.qcow2 -F qcow2 t.qcow2
  # Kill the merge early in its copy: after its first progress event with done > 0 (bytes planned
  # or submitted; durable only at their window's commit, so the kill may land before the first
  # commit, and the re-run then resumes from 0). Polled every 5 ms (wait_until's 0.1 s would
  # often come after the copy).
  "$QCOMMIT" merge t.qcow2 --budget off --output=json >events.json 2>/dev/null &
  pid=$!
  for ((w = 0; w < 400; w++)); do
    jq -e 'select(.event == "progress" and .phase == "copy" and .done > 0)' events.json >/dev/null 2>&1 && break
    sleep 0.005
  done
  sleep "0.0$attempt"
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  qrc=0 crc=0
  qemu-img check --output=json b.qcow2 >q.json 2>/dev/null || qrc=$?
  "$QCOMMIT" check --output=json b.qcow2 >c.json 2>/dev/null || crc=$?
  ql=$(jq '.leaks // 0' q.json) qc=$(jq '.corruptions // 0' q.json)
  cl=$(jq '.leaks' c.json) cc=$(jq '.corruptions' c.json)
  echo "killed merge, attempt $attempt: qemu-img check exit $qrc leaks $ql corruptions $qc; qcommit check exit $crc leaks $cl corruptions $cc"
  [[ $qc == 0 && $cc == 0 ]] || soft_fail "killed merge left corruptions (qemu-img $qc, qcommit $cc)"
  [[ $ql == "$cl" ]] || soft_fail "leak counts differ: qemu-img $ql, qcommit $cl"
  # Same verdict in the same code (0 clean, 2 corruptions, 3 leaks only).
  [[ $crc == "$qrc" ]] || soft_fail "verdicts differ: qemu-img check exit $qrc, qcommit check exit $crc"
  # The resumed merge finishes and repairs the leaks.
  "$QCOMMIT" merge t.qcow2 --budget off --output=json >resume.json 2>resume.err || soft_fail "resume after kill failed: $(cat resume.err)"
  # A run that resumes says so, and from where, before it copies: one resume event whose offset
  # is the result's resumed-from (the kill may also have come after the first run had finished:
  # then there is nothing to resume and no such event).
  jq -se '(map(select(.event == "result"))[0]) as $r
          | map(select(.event == "progress" and .phase == "resume")) as $e
          | if $r.resumed then ($e | length == 1 and .[0]."resume-offset" == $r."resumed-from")
            else ($e | length == 0) end' \
    resume.json >/dev/null || soft_fail "re-run after kill: resume event and result disagree: $(grep -E 'resume|result' resume.json | head -c 400)"
  [[ $(jq -s 'map(select(.event == "result"))[0].resumed' resume.json) == true ]] && resumed_runs=$((resumed_runs + 1))
  qemu-img compare -f raw -F qcow2 top.raw b.qcow2 >/dev/null || soft_fail "resumed merge: BASE differs"
  qemu-img check -q b.qcow2 >/dev/null 2>&1 || soft_fail "resumed merge: qemu-img check not clean"
  [[ $ql == 0 ]] || agreed=$((agreed + 1))
  ((agreed < 2)) || break
done
echo "killed merges that left leaks: $agreed; re-runs that resumed: $resumed_runs"

# A deterministic leaky image as well (refcounts raised by hand on clusters nothing references):
# both checks must report exactly these leaks, and qcommit check --repair must fix them.
u64() { od -An -tu8 --endian=big -j "$2" -N 8 "$1" | tr -d ' '; }
new hand.qcow2 64M -f qcow2
qio hand.qcow2 "write -P 7 0 256k" "write -P 8 10M 64k"
clusters=$(($(stat -c %s hand.qcow2) / 65536))
truncate -s $(((clusters + 5) * 65536)) hand.qcow2
rt=$(u64 hand.qcow2 48)
rb=$(u64 hand.qcow2 "$rt")
for c in $((clusters + 1)) $((clusters + 2)) $((clusters + 4)); do
  printf '\x00\x01' | dd of=hand.qcow2 bs=1 seek=$((rb + 2 * c)) conv=notrunc status=none
done
qrc=0 crc=0
qemu-img check --output=json hand.qcow2 >q.json 2>/dev/null || qrc=$?
"$QCOMMIT" check --output=json hand.qcow2 >c.json 2>/dev/null || crc=$?
echo "hand-made leaks: qemu-img check exit $qrc leaks $(jq '.leaks // 0' q.json); qcommit check exit $crc leaks $(jq .leaks c.json)"
[[ $(jq '.leaks // 0' q.json) == 3 && $(jq .leaks c.json) == 3 ]] || soft_fail "hand-made leaks: expected 3 from both checks"
[[ $qrc == 3 && $crc == 3 ]] || soft_fail "hand-made leaks: exit codes qemu-img $qrc, qcommit $crc (want 3 from both)"
[[ $(jq '.corruptions // 0' q.json) == 0 && $(jq .corruptions c.json) == 0 ]] || soft_fail "hand-made leaks: corruptions reported"
"$QCOMMIT" check --repair hand.qcow2 >/dev/null 2>&1 || soft_fail "qcommit check --repair did not end clean"
qemu-img check -q hand.qcow2 >/dev/null 2>&1 || soft_fail "qemu-img check after qcommit check --repair is not clean"

echo "merge.matrix: $pairs merges in $((SECONDS - start)) s"
finish
