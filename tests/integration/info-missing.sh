#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.info_missing: `qcommit info` of an overlay whose backing file is missing shows the chain
# down to the missing file, says it is missing (human and JSON) and exits as
# `qemu-img info --backing-chain` does (1), with one line naming the image that names it. A
# missing file at depth 1 and at depth 2. <1 s.
# usage: info-missing.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.info_missing

image base.qcow2 16M
overlay mid.qcow2 base.qcow2
overlay top.qcow2 mid.qcow2
qemu-img create -q -f qcow2 -b gone.qcow2 -F qcow2 -u lone.qcow2 16M
rm base.qcow2

# check IMAGE DEPTH NAMED_BY MISSING
check() {
  local img=$1 depth=$2 named_by=$3 missing=$4 want=0
  qemu-img info --backing-chain "$img" >/dev/null 2>&1 || want=$?
  try "$QCOMMIT" info "$img"
  [[ $rc == "$want" && $rc != 0 ]] || fail "info $img: exit $rc, qemu-img info --backing-chain $want: $(cat err.txt)"
  [[ $(wc -l <err.txt) == 1 ]] && grep -qF "$named_by: backing file '$missing'" err.txt && grep -qF "does not exist" err.txt ||
    fail "info $img: the error does not name $named_by and $missing: $(cat err.txt)"
  grep -qF "image: $img" out.txt || fail "info $img: the image is not shown: $(cat out.txt)"
  grep -qF "backing image (depth $depth): $missing" out.txt && grep -qF "missing: the file does not exist" out.txt ||
    fail "info $img: the missing file at depth $depth is not shown: $(cat out.txt)"
  try "$QCOMMIT" info --output=json "$img"
  [[ $rc == "$want" ]] || fail "info --output=json $img: exit $rc"
  [[ $(jq -c --argjson d "$depth" '[.chain[] | select(.missing == true) | [.depth, .filename, ."named-as"]]' out.txt) == "[[$depth,\"$missing\",\"$missing\"]]" ]] ||
    fail "info --output=json $img: $(cat out.txt)"
  [[ $(jq '.chain | length' out.txt) == $((depth + 1)) ]] || fail "info --output=json $img: not every layer: $(cat out.txt)"
}
check top.qcow2 2 mid.qcow2 base.qcow2
check lone.qcow2 1 lone.qcow2 gone.qcow2
grep -qF "backing image (depth 1): mid.qcow2" <("$QCOMMIT" info top.qcow2 2>/dev/null) || fail "info top.qcow2: mid.qcow2 not shown"
echo "cli.info_missing: OK"
