# SPDX-License-Identifier: GPL-2.0-or-later
# What every shell test shares; sourced after `set -euo pipefail`:
#   . "$(dirname "$(realpath "$0")")/../lib/test.sh"
# Make the binaries' paths absolute before `setup` changes the directory.
#
#   setup NAME                $work: a fresh directory (removed at exit), the current directory
#                             from here on; NAME prefixes every failure.
#   on_exit CMD...            CMD runs at exit, after the spawned processes are stopped and
#                             before $work is removed (the test's own clean-up: domains, mounts).
#   fail MESSAGE              ends the test: "NAME: FAIL: MESSAGE", then what the test's own
#                             fail_context prints, where it defines one (a daemon's log tail).
#   soft_fail MESSAGE         the same line, and the test goes on; `finish` ends it failed.
#   finish [PASS_LINE]        exit 1 listing every soft failure, else prints PASS_LINE.
#   spawn CMD...              runs CMD in the background ($! as usual); killed at exit.
#   stop PID                  ends a spawned process and reaps it.
#   wait_until SECONDS CMD... true as soon as CMD succeeds (tried every 0.1 s), false once
#                             SECONDS have passed without; CMD may be a function of the test.
#   gone PID                  true when PID no longer runs (for wait_until).
#   now_us                    microseconds since the epoch.
#   qio [-f FMT] IMG CMD...   qemu-io commands on IMG (format FMT, else detected); false on any
#                             error qemu-io reports.
#   new NAME SIZE ARGS...     qemu-img create -q ARGS NAME SIZE.
#   fmt_of IMG                IMG's format as qemu-img detects it.
#   same_view A B             true when qemu-img compare finds the guest views of A and B equal.
#   try CMD... / fails_with RC TEXT CMD...
#                             CMD's output in out.txt and err.txt, its status in $rc / the test
#                             fails unless CMD exits RC with one line on stderr containing TEXT.
#   timed CMD...              CMD's status in $rc and its wall-clock seconds in $took.
#   image NAME SIZE [CMD...], overlay NAME BACKING [SIZE] [CMD...]
#                             a qcow2 image (over BACKING), the qemu-io CMDs written by qio.
#   layers SIZE IMG[=CMDS]... a qcow2 chain, each IMG over the one before, CMDS written by qio.
#   small_chain, scatter IMG N SPAN
#                             a 64 MiB two-layer chain with TOP's view in view.raw; N scattered
#                             64 KiB clusters written into IMG.
#   drop_cache FILE, cached_bytes FILE
#                             FILE's pages dropped from / counted in the page cache.
# Each is described again above its definition.

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
  ! declare -F fail_context >/dev/null || fail_context >&2
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
  local i
  for i in "${!_t_spawned[@]}"; do [[ ${_t_spawned[i]} != "$1" ]] || unset '_t_spawned[i]'; done
}

# The spawned processes are stopped first (a daemon before the domains it governs are removed),
# then the on_exit commands run. Its locals are prefixed: an on_exit command reads the test's own
# variables (pid, cmd).
_t_cleanup() {
  local _t_cmd _t_pid
  for _t_pid in "${_t_spawned[@]}"; do kill "$_t_pid" 2>/dev/null || true; done
  for _t_cmd in "${_t_on_exit[@]}"; do eval "$_t_cmd" || true; done
  wait 2>/dev/null || true
  if [[ -n ${work:-} ]]; then
    cd /
    rm -rf "$work"
  fi
}

# Microseconds since the epoch ($EPOCHREALTIME without its decimal point, whatever the locale's).
now_us() { echo "${EPOCHREALTIME//[!0-9]/}"; }

wait_until() {
  local limit_us end
  limit_us=$(awk -v s="$1" 'BEGIN {printf "%d", s * 1000000}')
  shift
  end=$(($(now_us) + limit_us))
  until "$@"; do
    (($(now_us) < end)) || return 1
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

# try CMD...: runs CMD, stdin from /dev/null, its stdout in out.txt and its stderr in err.txt (in
# the current directory); its exit status in $rc, and the test goes on whatever it is.
try() {
  rc=0
  "$@" >out.txt 2>err.txt </dev/null || rc=$?
}
# fails_with RC TEXT CMD...: CMD (run by try) exits RC with one line on stderr that contains
# TEXT, or the test fails naming CMD (its program by base name).
fails_with() {
  local want=$1 text=$2 cmd
  shift 2
  try "$@"
  cmd="${1##*/} ${*:2}"
  [[ $rc == "$want" ]] || fail "$cmd: exit $rc, expected $want: $(cat out.txt err.txt)"
  [[ $(wc -l <err.txt) == 1 ]] || fail "$cmd: the error is not one line: $(cat err.txt)"
  grep -qF -- "$text" err.txt || fail "$cmd: error '$(cat err.txt)' lacks '$text'"
}

# drop_cache FILE: FILE written back (sync) and its pages dropped from the page cache, so that
# what is cached afterwards is what came after.
drop_cache() {
  sync
  python3 -c 'import os, sys; os.posix_fadvise(os.open(sys.argv[1], os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)' "$1"
}

# cached_bytes FILE: how many bytes of FILE the page cache holds (fincore).
cached_bytes() { fincore --bytes --noheadings --output RES "$1"; }

# small_chain: base.qcow2 (64 MiB, its first 8 MiB written) under top.qcow2 (writes at 4-20 MiB
# and 40-41 MiB) in the current directory, replacing earlier ones; TOP's view in view.raw.
small_chain() {
  rm -f base.qcow2 top.qcow2
  image base.qcow2 64M "write -P 1 0 8M"
  overlay top.qcow2 base.qcow2 64M "write -P 7 4M 16M" "write -P 9 40M 1M"
  qemu-img convert -O raw top.qcow2 view.raw
}

# timed CMD...: runs CMD (redirected as the caller says); its exit status in rc (a failure does not
# end the test), its wall-clock seconds in took.
timed() {
  local t0
  t0=$(now_us)
  rc=0
  "$@" || rc=$?
  took=$(awk -v a="$t0" -v b="$(now_us)" 'BEGIN { printf "%.2f", (b - a) / 1e6 }')
}

# scatter IMG N SPAN: qemu-io writes N distinct 64 KiB clusters into qcow2 image IMG, cluster
# i * 2654435761 mod SPAN (a permutation: SPAN a power of 2), pattern i mod 251 + 1.
scatter() {
  local args=() i
  for ((i = 0; i < $2; i++)); do args+=(-c "write -P $((i % 251 + 1)) $(((i * 2654435761 % $3) * 65536)) 64k"); done
  qemu-io -f qcow2 "${args[@]}" "$1" >/dev/null
}

# image NAME SIZE [QEMU_IO_CMD...]: a new qcow2 image, the commands run on it (qio).
image() {
  new "$1" "$2" -f qcow2
  (($# < 3)) || qio -f qcow2 "$1" "${@:3}"
}
# overlay NAME BACKING [SIZE] [QEMU_IO_CMD...]: the same over the qcow2 image BACKING (SIZE, digits
# and a unit, else BACKING's size).
overlay() {
  local name=$1 backing=$2 size=
  shift 2
  [[ ${1:-} =~ ^[0-9]+[KMGT]?$ ]] && size=$1 && shift
  qemu-img create -q -f qcow2 -b "$backing" -F qcow2 "$name" ${size:+"$size"}
  (($# == 0)) || qio -f qcow2 "$name" "$@"
}

# layers SIZE IMG[=CMDS]...: a qcow2 chain, the first IMG of SIZE (image), each next one over the
# one before it (overlay; its backing file named as that one is written here: relative or
# absolute); each IMG given CMDS gets them written (qemu-io commands separated by ';').
layers() {
  local size=$1 prev='' spec cmds
  shift
  for spec; do
    cmds=()
    [[ $spec != *=* ]] || IFS=';' read -ra cmds <<<"${spec#*=}"
    if [[ -z $prev ]]; then image "${spec%%=*}" "$size" "${cmds[@]}"; else overlay "${spec%%=*}" "$prev" "${cmds[@]}"; fi
    prev=${spec%%=*}
  done
}
