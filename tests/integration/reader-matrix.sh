#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# reader.matrix: for every image and chain of a matrix built with qemu-img/qemu-io,
#   (a) `qcommit map --output=json` equals `qemu-img map --output=json` (both normalised: adjacent
#       entries with equal depth/present/zero/data and contiguous offsets merged),
#   (b) the guest view read through qcow2::Chain (qcow2-cat) equals `qemu-img convert -O raw`
#       (sha256; for the huge sparse images: windows around every write, via `qemu-img dd`),
#   (c) `qcommit info --output=json` succeeds and agrees with `qemu-img info --output=json` on
#       virtual-size, cluster-size and backing-filename.
# Then broken images through the CLI: exit 1 or 3, one line naming the file, no crash.
# usage: reader-matrix.sh QCOMMIT QCOW2_CAT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
QCAT=$(realpath "$2")
setup reader.matrix
ulimit -c 0  # the lazy-refcount images are left dirty by aborting qemu-io
checked=0
KiB=1024 MiB=$((1024 ** 2)) GiB=$((1024 ** 3)) TiB=$((1024 ** 4))

# Normalised map: only qemu-img's keys, adjacent compatible entries merged, one JSON line each.
NORM='[.[] | {start, length, depth, present, zero, data, offset}]
  | reduce .[] as $e ([]; .[-1] as $p
      | if $p != null and ($p | del(.start, .length, .offset)) == ($e | del(.start, .length, .offset))
           and $p.start + $p.length == $e.start
           and (if $p.offset == null then $e.offset == null else $e.offset == $p.offset + $p.length end)
        then .[-1].length += $e.length else . + [$e] end)
  | .[] | tojson'

check_map() {
  local img=$1
  qemu-img map --output=json "$img" >q.json 2>q.err || { soft_fail "$img: qemu-img map failed: $(cat q.err)"; return; }
  "$QCOMMIT" map --output=json "$img" >c.json 2>c.err ||
    { soft_fail "$img: qcommit map failed (exit $?): $(cat c.err)"; return; }
  jq -r "$NORM" q.json >q.norm
  jq -r "$NORM" c.json >c.norm || { soft_fail "$img: qcommit map output is not valid JSON"; return; }
  cmp -s q.norm c.norm ||
    { soft_fail "$img: map differs from qemu-img map"; diff -u q.norm c.norm | head -20 >&2 || true; }
}

check_info() {
  local img=$1 sel='[."virtual-size", ."cluster-size", ."backing-filename"] | tojson' want got
  "$QCOMMIT" info --output=json "$img" >ci.json 2>ci.err || { soft_fail "$img: qcommit info failed: $(cat ci.err)"; return; }
  want=$(qemu-img info --output=json "$img" | jq -r "$sel")
  got=$(jq -r ".chain[0] | $sel" ci.json) || { soft_fail "$img: qcommit info output is not JSON"; return; }
  [[ $want == "$got" ]] || soft_fail "$img: info differs: qemu-img $want, qcommit $got"
}

# The full guest view, by sha256.
check_read() {
  local img=$1 want got
  qemu-img convert -O raw "$img" ref.raw
  want=$(sha256sum <ref.raw | cut -d' ' -f1)
  rm -f ref.raw
  if ! got=$("$QCAT" "$img" 2>cat.err | sha256sum | cut -d' ' -f1) || [[ -s cat.err ]]; then
    soft_fail "$img: qcow2-cat failed: $(cat cat.err)"
  elif [[ $want != "$got" ]]; then
    soft_fail "$img: guest data read through the chain differs from qemu-img convert"
  fi
}

# The guest view in windows OFFSET:LENGTH (512-byte aligned), for images too big to convert whole.
check_read_windows() {
  local img=$1 w off len
  shift
  for w in "$@"; do
    off=${w%%:*} len=${w##*:}
    rm -f win.raw
    # qemu-img 7.2 dd applies count before skip (count is measured from offset 0)
    qemu-img dd -O raw bs=512 skip=$((off / 512)) count=$(((off + len) / 512)) if="$img" of=win.raw 2>/dev/null
    [[ $(stat -c %s win.raw) == "$len" ]] || { soft_fail "$img: qemu-img dd window at $off is not $len bytes"; continue; }
    "$QCAT" "$img" "$off" "$len" 2>cat.err | cmp -s - win.raw ||
      soft_fail "$img: guest data at $off+$len differs from qemu-img dd $(cat cat.err)"
  done
}

# check IMG [OFFSET:LENGTH...]: (a), (c), and (b) on the whole view or on those windows.
check() {
  checked=$((checked + 1))
  check_map "$1"
  check_info "$1"
  if (($# > 1)); then check_read_windows "$@"; else check_read "$1"; fi
}

# qemu-io with the given commands, then abort(): leaves a lazy-refcounts image dirty. The inner
# shell swallows bash's "Aborted" job message.
qio_abort() {
  local img=$1 args=() c
  shift
  for c in "$@"; do args+=(-c "$c"); done
  bash -c '"$@" >/dev/null 2>&1; true' qio_abort qemu-io "${args[@]}" -c abort "$img" 2>/dev/null
  [[ $(qemu-img info --output=json "$img" | jq '."dirty-flag"') == true ]] || soft_fail "$img: could not leave the image dirty"
}

# A mix of writes, zero writes (with and without -u) and discards at unaligned offsets, scaled
# so each touches several clusters of size $2. $3 is a pattern seed; $4 = nocompress to skip the
# compressed write (not possible with a data file).
populate() {
  local img=$1 cs=$2 seed=$3 mode=${4:-} size u
  size=$(qemu-img info --output=json "$img" | jq '."virtual-size"')
  u=$((cs > 64 * KiB ? cs : 64 * KiB))  # unit
  local cmds=(
    "write -P $((seed + 1)) 0 $((3 * u))"
    "write -P $((seed + 2)) 1000 5000"
    "write -P $((seed + 3)) $((5 * u + 512)) $((2 * u + 7))"
    "write -z $((u + 1000)) $((u / 2 + 300))"
    "write -z -u $((5 * u + 3 * cs / 2)) $((2 * cs + 777))"
    "write -z $((9 * u)) $((2 * u))"
    "discard $((2 * u + 4096 + 17)) $((u / 3 + 2 * cs))"
    "discard $((12 * u)) $((cs * 3))"
    "write -P $((seed + 4)) $((size - 5000)) 5000"
    "write -P $((seed + 5)) $((14 * u)) $((cs / 2))"
  )
  [[ $mode == nocompress ]] || cmds+=("write -c -P $((seed + 6)) $((16 * u)) $cs")
  qio "$img" "${cmds[@]}"
}

# layer NAME BACKING OPTIONS SIZE [QEMU_IO_CMD...]: a qcow2 image over BACKING (of the format its
# name ends with), written by qio.
layer() {
  qemu-img create -q -f qcow2 -b "$2" -F "${2##*.}" ${3:+-o "$3"} "$1" "$4"
  (($# < 5)) || qio "$1" "${@:5}"
}

vsize=$((48 * MiB + 3 * 512))  # not a multiple of any cluster size above 512

# ---------------------------------------------------------------------------------------------
echo "== single images: cluster size x compat x extended_l2 x refcount_bits x preallocation"
# cluster_size:compat:extended_l2:refcount_bits:preallocation
for combo in \
  512:1.1:off:16:off 4096:0.10:off:16:off 65536:1.1:on:1:metadata 2097152:1.1:on:64:falloc \
  65536:1.1:off:64:full 4096:1.1:off:1:falloc 2097152:0.10:off:16:metadata 512:1.1:off:64:metadata \
  65536:0.10:off:16:full 65536:1.1:on:16:off 4096:1.1:off:16:full 2097152:1.1:off:1:off; do
  IFS=: read -r cs compat l2 rb pa <<<"$combo"
  name=$cs-$compat-l2$l2-rb$rb-$pa.qcow2
  opts=cluster_size=$cs,compat=$compat,preallocation=$pa
  [ "$compat" = 1.1 ] && opts+=,extended_l2=$l2,refcount_bits=$rb
  for img in single-$name fresh-$name; do qemu-img create -q -f qcow2 -o "$opts" "$img" $vsize; done
  # (a compressed write needs an unallocated cluster: not on preallocated images)
  populate "single-$name" "$cs" 16 "$([ "$pa" = off ] || echo nocompress)"
  check "single-$name"
  check "fresh-$name"  # untouched (preallocation as created)
  rm -f "fresh-$name"
done

echo "== compressed images: qemu-img convert -c, zlib and zstd"
src=single-65536-1.1-l2off-rb64-full.qcow2
# cluster_size:compat:extended_l2:compression_type
for combo in 512:1.1:off:zlib 4096:1.1:off:zstd 65536:1.1:off:zlib 65536:1.1:on:zstd \
  2097152:1.1:off:zstd 2097152:1.1:on:zlib 65536:0.10:off:zlib 16384:1.1:off:zstd; do
  IFS=: read -r cs compat l2 ct <<<"$combo"
  img=compressed-$cs-$compat-l2$l2-$ct.qcow2
  opts=cluster_size=$cs,compat=$compat
  [ "$compat" = 1.1 ] && opts+=,extended_l2=$l2,compression_type=$ct
  qemu-img convert -c -O qcow2 -o "$opts" "$src" "$img"
  check "$img"
  # and writes over the compressed clusters (partial overwrite, zeroing)
  qio "$img" "write -P 0x77 $((cs / 2 + 3 * 512)) $((cs + 1024))" "write -z $((4 * cs)) $((cs / 2))"
  check "$img"
done

echo "== lazy refcounts, left dirty"
img=lazy-dirty.qcow2
qemu-img create -q -f qcow2 -o lazy_refcounts=on,cluster_size=4096 "$img" $vsize
populate "$img" 4096 32
qio_abort "$img" "write -P 0x99 $((20 * MiB + 100)) 300000"
"$QCOMMIT" info --output=json "$img" | jq -e '.chain[0].features | index("dirty")' >/dev/null ||
  soft_fail "$img: qcommit info does not report the dirty bit"
check "$img"

echo "== external data files"
# name:cluster_size:pattern seed:more options
for combo in datafile:65536:48: datafile-raw:4096:64:,data_file_raw=on \
  datafile-l2:131072:80:,extended_l2=on,preallocation=metadata; do
  IFS=: read -r name cs seed more <<<"$combo"
  qemu-img create -q -f qcow2 -o "data_file=$name.data,cluster_size=$cs$more" "$name.qcow2" $vsize
  populate "$name.qcow2" "$cs" "$seed" nocompress
  check "$name.qcow2"
done

echo "== internal snapshot and bitmap"
img=snapshot.qcow2
qemu-img create -q -f qcow2 -o cluster_size=65536 "$img" $vsize
populate "$img" 65536 96
qemu-img snapshot -c snap1 "$img"
qio "$img" "write -P 0xa1 $((MiB + 512)) $((MiB))" "write -z 0 4096" "discard $((5 * MiB)) $MiB"
check "$img"
img=bitmap.qcow2
qemu-img create -q -f qcow2 -o cluster_size=4096 "$img" $vsize
qemu-img bitmap --add "$img" bm0
populate "$img" 4096 112
qemu-img bitmap --add -g 65536 "$img" bm1
qio "$img" "write -P 0xb1 $((30 * MiB)) 12345"
"$QCOMMIT" info --output=json "$img" | jq -e '.chain[0].bitmaps == 2' >/dev/null ||
  soft_fail "$img: qcommit info does not count 2 bitmaps"
check "$img"

echo "== chains"
# Chain 1: raw base of an odd size (not a multiple of 512) under four qcow2 layers with
# different sizes, cluster sizes and features; every prefix of the chain is checked.
head -c $((20 * MiB + 700)) /dev/urandom >c1-base.raw
layer c1-l1.qcow2 c1-base.raw cluster_size=4096 $((32 * MiB)) "write -P 0x21 $((MiB + 100)) $((3 * MiB))" \
  "write -z -u $((19 * MiB)) $((2 * MiB))" "discard $((8 * MiB + 4096)) $((MiB))" "write -P 0x22 $((30 * MiB)) 70000"
layer c1-l2.qcow2 c1-l1.qcow2 cluster_size=65536,extended_l2=on $((24 * MiB)) \
  "write -P 0x23 $((2 * MiB + 2048)) 5000" "write -z $((3 * MiB + 6144)) 20000" \
  "write -z -u $((9 * MiB)) $((MiB + 2048))" "discard $((MiB + 512)) 4096"
layer c1-l3.qcow2 c1-l2.qcow2 cluster_size=512,refcount_bits=1 $((64 * MiB)) \
  "write -P 0x24 $((23 * MiB + 1024)) $((2 * MiB))" "write -z $((2 * MiB + 1024)) 1536" \
  "write -P 0x25 $((40 * MiB)) 4096" "discard $((MiB + 600)) 100000"
layer c1-l4.qcow2 c1-l3.qcow2 cluster_size=2097152,compat=0.10 $((48 * MiB + 512)) \
  "write -P 0x26 $((22 * MiB)) 1234567" "write -z $((4 * MiB)) $((2 * MiB))" "write -P 0x27 $((48 * MiB)) 512"
for l in c1-l1 c1-l2 c1-l3 c1-l4; do check $l.qcow2; done

# Chain 2: compressed zstd base, data-file middle, lazy-refcount dirty top, extended-L2 top-top.
qemu-img convert -c -O qcow2 -o compression_type=zstd,cluster_size=65536 single-65536-1.1-l2on-rb16-off.qcow2 \
  c2-base.qcow2
layer c2-mid.qcow2 c2-base.qcow2 data_file=c2-mid.data $vsize
populate c2-mid.qcow2 65536 128 nocompress
layer c2-top.qcow2 c2-mid.qcow2 lazy_refcounts=on,refcount_bits=64 $((40 * MiB))
qio_abort c2-top.qcow2 "write -P 0xc1 $((3 * MiB + 333)) 200000" "write -z -u $((10 * MiB)) $MiB"
layer c2-top2.qcow2 c2-top.qcow2 extended_l2=on,cluster_size=2097152 $((56 * MiB)) \
  "write -P 0xc2 $((MiB + 65536 * 3)) 65536" "write -z -u $((12 * MiB)) $((3 * MiB))" \
  "discard $((16 * MiB)) $((2 * MiB))" "write -z 0 4096"
for l in c2-base c2-mid c2-top c2-top2; do check $l.qcow2; done

# Chain 3: base with an internal snapshot and a bitmap; data_file_raw base; backing longer.
qemu-img create -q -f qcow2 -o data_file=c3-base.data,data_file_raw=on c3-base.qcow2 $((64 * MiB))
qio c3-base.qcow2 "write -P 0xd1 0 $((8 * MiB))" "write -z $((MiB + 512)) 4096"
layer c3-a.qcow2 snapshot.qcow2 cluster_size=16384 $((16 * MiB)) "write -P 0xd2 $((MiB - 512)) 1024" \
  "write -z -u $((2 * MiB)) $((MiB))"
layer c3-b.qcow2 c3-base.qcow2 extended_l2=on $((32 * MiB)) "write -z -u $((MiB)) $((3 * MiB))" \
  "write -P 0xd3 $((4 * MiB + 4096)) 8192" "discard $((6 * MiB + 2048)) 65536"
layer c3-c.qcow2 c3-b.qcow2 "" $((80 * MiB))
for l in c3-base c3-a c3-b c3-c; do check $l.qcow2; done

# Chain 4: probed backing format (no backing_fmt), relative name in a subdirectory.
mkdir -p sub
image sub/c4-base.qcow2 $((8 * MiB)) "write -P 0xe1 0 $MiB"
layer sub/c4-top.qcow2 c4-base.qcow2 "" $((8 * MiB)) "write -z $((512 * KiB)) $((KiB))"
check sub/c4-top.qcow2

echo "== huge sparse images (L1 table larger than one cluster)"
img=sparse-2t.qcow2
qemu-img create -q -f qcow2 -o cluster_size=4096 "$img" $((2 * TiB))
qio "$img" "write -P 0xf1 0 12345" "write -P 0xf2 $((TiB + 4096 * 7 + 100)) 70000" \
  "write -P 0xf3 $((2 * TiB - 8192)) 8192" "write -z $((700 * GiB)) $MiB" \
  "write -P 0xf4 $((1536 * GiB - 512)) 1024"
l1=$(od -An -j36 -N4 -tu4 --endian=big "$img" | tr -d ' ')
((l1 * 8 > 4096)) || soft_fail "$img: L1 table fits one cluster ($l1 entries)"
check "$img" 0:65536 $((TiB)):$((2 * MiB)) $((2 * TiB - MiB)):$MiB \
  $((700 * GiB)):$((2 * MiB)) $((1536 * GiB - MiB)):$((2 * MiB)) $((300 * GiB)):65536
img=sparse-512.qcow2
qemu-img create -q -f qcow2 -o cluster_size=512,refcount_bits=64 "$img" $((4 * GiB + 512))
qio "$img" "write -P 0xf5 $((3 * GiB + 1000)) 3000" "write -P 0xf6 $((4 * GiB - 512)) 1024" \
  "write -z -u $((GiB)) 65536" "write -P 0xf7 100 100"
check "$img" 0:65536 $((3 * GiB)):65536 $((4 * GiB - 65536)):$((65536 + 512)) $((GiB)):65536

# ---------------------------------------------------------------------------------------------
echo "== broken images through the CLI"
# expect_error FILE WHAT-TO-GREP [NAMED]: qcommit map and info must exit 1 or 3 with one line on
# stderr that names the file with the problem (NAMED, default FILE) and mentions WHAT; no signal.
expect_error() {
  local img=$1 what=$2 named=${3:-$1} cmd
  for cmd in map info; do
    try timeout 20 "$QCOMMIT" "$cmd" --output=json "$img"
    if [[ $rc != [13] ]]; then
      soft_fail "$img: qcommit $cmd exited $rc (want 1 or 3): $(cat err.txt)"
    elif [[ $(wc -l <err.txt) != 1 ]]; then
      soft_fail "$img: qcommit $cmd printed $(wc -l <err.txt) lines: $(cat err.txt)"
    elif ! grep -qF "qcommit: $named" err.txt || ! grep -qi -- "$what" err.txt; then
      soft_fail "$img: qcommit $cmd message lacks the file name or '$what': $(cat err.txt)"
    fi
  done
  checked=$((checked + 1))
}
# patch FILE OFFSET HEXBYTES
patch() { printf "$(sed 's/\(..\)/\\x\1/g' <<<"$3")" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }

image good.qcow2 $((4 * MiB)) "write -P 1 0 $MiB" "write -c -P 2 $((2 * MiB)) 65536"

head -c 50 good.qcow2 >bad-truncated.qcow2
expect_error bad-truncated.qcow2 "small"
cp good.qcow2 bad-magic.qcow2 && patch bad-magic.qcow2 0 514649fc
head -c 1000 /dev/zero >>bad-magic.qcow2
# A file without the magic is probed as raw; named with backing_fmt=qcow2 it must be refused.
qemu-img create -q -f qcow2 -b bad-magic.qcow2 -F qcow2 -u over-bad-magic.qcow2 $((4 * MiB))
expect_error over-bad-magic.qcow2 "magic" bad-magic.qcow2
# One header field patched: bad-NAME.qcow2, OFFSET, the bytes, what the error mentions (hugesize:
# a virtual size of ~2^64, no wrap, no hang).
while read -r -u 3 name off hex what; do
  cp good.qcow2 "bad-$name.qcow2" && patch "bad-$name.qcow2" "$off" "$hex"
  expect_error "bad-$name.qcow2" "$what"
done 3<<'EOF'
version 4 00000004 version
clusterbits 20 0000001f cluster
l1 40 0000000000030200 L1
l1size 36 7fffffff L1
hugesize 24 fffffffffffffe00 L1
reftable 48 0000000100000000 refcount table
incompat 72 0000000000000100 bit 8
crypt 32 00000002 encrypt
EOF
# An L1 entry pointing into the header (L2 table at offset 0x200): corruption, exit 3.
l1off=$(od -An -j40 -N8 -tu8 --endian=big good.qcow2 | tr -d ' ')
cp good.qcow2 bad-l2hdr.qcow2 && patch bad-l2hdr.qcow2 "$l1off" 8000000000000200
expect_error bad-l2hdr.qcow2 "L2"
# Compressed cluster whose stream is garbage.
coff=$(qemu-img map --output=json good.qcow2 | jq '[.[] | select(.data and .offset == null)][0].start')
[[ $coff == $((2 * MiB)) ]] || soft_fail "good.qcow2: compressed cluster not where expected ($coff)"
cp good.qcow2 bad-compressed.qcow2
l2off=$(od -An -j"$l1off" -N8 -tu8 --endian=big good.qcow2 | tr -d ' ')
l2off=$((l2off & 0x00fffffffffffe00))
centry=$(od -An -j$((l2off + 8 * 32)) -N8 -tu8 --endian=big good.qcow2 | tr -d ' ')
cdata=$((centry & ((1 << 54) - 1)))
head -c 600 /dev/urandom | dd of=bad-compressed.qcow2 bs=1 seek="$cdata" conv=notrunc status=none
try "$QCAT" bad-compressed.qcow2
[[ $rc == 3 ]] && grep -q "bad-compressed.qcow2.*decompress" err.txt ||
  soft_fail "bad-compressed.qcow2: qcow2-cat exited $rc: $(cat err.txt)"
checked=$((checked + 1))
# Backing problems.
qemu-img create -q -f qcow2 -b loop-b.qcow2 -F qcow2 -u loop-a.qcow2 $MiB
qemu-img create -q -f qcow2 -b loop-a.qcow2 -F qcow2 -u loop-b.qcow2 $MiB
expect_error loop-a.qcow2 "loop" loop-b.qcow2
qemu-img create -q -f qcow2 -b missing.qcow2 -F qcow2 -u bad-missing.qcow2 $MiB
expect_error bad-missing.qcow2 "missing.qcow2"
qemu-img create -q -f qcow2 -b 'json:{"file.filename":"good.qcow2"}' -F qcow2 -u bad-json.qcow2 $MiB
expect_error bad-json.qcow2 "json"
qemu-img create -q -f qcow2 -b 'nbd://localhost/x' -F raw -u bad-nbd.qcow2 $MiB
expect_error bad-nbd.qcow2 "protocol"
qemu-img create -q -f qcow2 -b "$(printf 'a%.0s' $(seq 1 1000))" -F qcow2 -u bad-longname.qcow2 $MiB
patch bad-longname.qcow2 16 00000401  # backing_file_size 1025
expect_error bad-longname.qcow2 "backing file name"
expect_error does-not-exist.qcow2 "No such file"

# ---------------------------------------------------------------------------------------------
echo "checked $checked images/cases"
finish "all matched qemu-img"
