# SPDX-License-Identifier: GPL-2.0-or-later
# What the merge scripts share for building chains; sourced after `set -euo pipefail`.
#   qio [-f FMT] IMG CMD... qemu-io commands on IMG (format FMT, else detected); fails on any
#                           error.
#   new NAME SIZE ARGS...   qemu-img create -q ARGS NAME SIZE.
#   fmt_of IMG              IMG's format as qemu-img detects it.

qio() {
  local fmt=
  if [[ $1 == -f ]]; then
    fmt=$2
    shift 2
  fi
  local img=$1
  shift
  local args=() out
  [[ -n $fmt ]] || fmt=$(qemu-img info --output=json "$img" | jq -r .format)
  for c in "$@"; do args+=(-c "$c"); done
  out=$(qemu-io -f "$fmt" "${args[@]}" "$img" 2>&1) || { echo "qemu-io failed on $img: $out" >&2; return 1; }
  if grep -qiE 'failed|error|not supported' <<<"$out"; then
    echo "qemu-io on $img: $out" >&2
    return 1
  fi
}

new() {
  local name=$1 size=$2
  shift 2
  qemu-img create -q "$@" "$name" "$size"
}

fmt_of() { qemu-img info -U --output=json "$1" | jq -r .format; }
