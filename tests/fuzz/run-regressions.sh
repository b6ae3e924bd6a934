#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Replays every saved input in regressions/<target>/ through its fuzz target once: each must
# run clean (libFuzzer exits non-zero on a crash, sanitizer report or leak).
set -euo pipefail
bin=$1 dir=$2
n=0
for t in fuzz_image fuzz_chain fuzz_merge_plan fuzz_merge_chain; do
  [ -d "$dir/$t" ] || continue
  files=("$dir/$t"/*)
  [ -e "${files[0]}" ] || continue
  "$bin/$t" -rss_limit_mb=512 -malloc_limit_mb=256 -timeout=5 "${files[@]}" >/dev/null 2>"$bin/$t.regressions.log" ||
    { echo "FAIL: $t on one of ${files[*]}"; tail -40 "$bin/$t.regressions.log"; exit 1; }
  n=$((n + ${#files[@]}))
done
echo "fuzz.regressions: $n inputs ran clean"
