#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# arch.doctest_registered: every doctest case of the test programs is a ctest entry of its own.
# The programs' cases are registered by name in their CMakeLists.txt (each with its labels); a
# case left out of that list compiles and passes by hand but never runs under ctest, so in CI it
# cannot fail. And the other way round: a ctest entry that runs a program with --test-case=NAME
# where the program has no case NAME (renamed or deleted) runs nothing and passes for ever. Lists
# each such case and entry; exits 1 when there is one. Programs after --stale-only get the
# second check alone (those that register some of their cases only where the host has a tool).
# usage: doctest-registered.sh BUILD_DIR PROGRAM... [--stale-only PROGRAM...]
set -euo pipefail
test_name=arch.doctest_registered
. "$(dirname "$0")/../lib/test.sh"
build=${1:?usage: doctest-registered.sh BUILD_DIR PROGRAM...}
shift
registered=$(ctest --test-dir "$build" -N | sed -n 's/^ *Test *#[0-9]*: //p' | sort -u)
# Each entry's program and the case it selects: "PROGRAM<TAB>CASE<TAB>ENTRY".
selected=$(ctest --test-dir "$build" --show-only=json-v1 |
  jq -r '.tests[] | .name as $n | (.command // []) as $c | $c[1:][] | select(startswith("--test-case="))
         | [$c[0], ltrimstr("--test-case="), $n] | @tsv')
[[ -n $registered ]] || fail "ctest lists no test in $build"
both=1
for prog in "$@"; do
  [[ $prog != --stale-only ]] || { both=0; continue; }
  cases=$("$prog" --list-test-cases --no-version | { grep -v -e '^\[doctest\]' -e '^=*$' || true; } | sort -u)
  [[ -n $cases ]] || { soft_fail "${prog##*/}: lists no test case"; continue; }
  while IFS= read -r c; do
    soft_fail "${prog##*/}: test case $c is not registered with ctest (add it to its CMakeLists.txt list)"
  done < <([[ $both == 1 ]] && comm -23 <(printf '%s\n' "$cases") <(printf '%s\n' "$registered"))
  while IFS=$'\t' read -r path c entry; do
    [[ $path -ef $prog ]] && ! grep -qxF -- "$c" <<<"$cases" &&
      soft_fail "${prog##*/}: ctest entry $entry selects test case $c, which the program does not have"
  done <<<"$selected"
done
finish
