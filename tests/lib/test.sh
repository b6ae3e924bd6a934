# SPDX-License-Identifier: GPL-2.0-or-later
# What every shell test shares; sourced after `set -euo pipefail`:
#   . "$(dirname "$(realpath "$0")")/../lib/test.sh"
# Make the binaries' paths absolute before `setup` changes the directory.
#
#   setup NAME                $work: a fresh directory (removed at exit), the current directory
#                             from here on; NAME prefixes every failure.
#   on_exit CMD...            CMD runs at exit, before the spawned processes are stopped and
#                             $work is removed (the test's own clean-up: domains, mounts).
#   fail MESSAGE              ends the test: "NAME: FAIL: MESSAGE".
#   soft_fail MESSAGE         the same line, and the test goes on; `finish` ends it failed.
#   finish [PASS_LINE]        exit 1 listing every soft failure, else prints PASS_LINE.
#   spawn CMD...              runs CMD in the background ($! as usual); killed at exit.
#   stop PID                  ends a spawned process and reaps it.
#   wait_until SECONDS CMD... true as soon as CMD succeeds (tried every 0.1 s), false once
#                             SECONDS have passed without; CMD may be a function of the test.
#   gone PID                  true when PID no longer runs (for wait_until).
#   qio [-f FMT] IMG CMD...   qemu-io commands on IMG (format FMT, else detected); false on any
#                             error qemu-io reports.
#   new NAME SIZE ARGS...     qemu-img create -q ARGS NAME SIZE.
#   fmt_of IMG                IMG's format as qemu-img detects it.
#   same_view A B             true when qemu-img compare finds the guest views of A and B equal.

test_name=${test_name:-$(basename "$0" .sh)}
_t_failures=()
_t_spawned=()
_t_on_exit=()

setup() {
  test_name=$1
  work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-$test_name.XXXXXX")
  trap _t_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
  cd "$work"
}

on_exit() { _t_on_exit+=("$*"); }

fail() {
  echo "$test_name: FAIL: $*" >&2
  exit 1
}

soft_fail() {
  echo "$test_name: FAIL: $*" >&2
  _t_failures+=("$*")
}

finish() {
  if ((${#_t_failures[@]})); then
    echo "$test_name: ${#_t_failures[@]} failure(s):" >&2
    printf '  %s\n' "${_t_failures[@]}" >&2
    exit 1
  fi
  [[ -z ${1:-} ]] || echo "$1"
}

spawn() {
  "$@" &
  _t_spawned+=($!)
}

stop() {
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

_t_cleanup() {
  local cmd pid
  for cmd in "${_t_on_exit[@]}"; do eval "$cmd" || true; done
  for pid in "${_t_spawned[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ -n ${work:-} ]]; then
    cd /
    rm -rf "$work"
  fi
}

wait_until() {
  local limit_us end
  limit_us=$(awk -v s="$1" 'BEGIN {printf "%d", s * 1000000}')
  shift
  end=$((${EPOCHREALTIME/./} + limit_us))
  until "$@"; do
    ((${EPOCHREALTIME/./} < end)) || return 1
    sleep 0.1
  done
}

gone() { ! kill -0 "$1" 2>/dev/null; }

qio() {
  local fmt=
  if [[ $1 == -f ]]; then
    fmt=$2
    shift 2
  fi
  local img=$1 c
  shift
  local args=() out
  [[ -n $fmt ]] || fmt=$(fmt_of "$img")
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

same_view() { qemu-img compare -q "$1" "$2" >/dev/null 2>&1; }
