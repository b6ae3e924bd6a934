#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.results_index: every archived lab result under tests/lab/results is named, by its full
# file name, in that directory's README.md index, and the index names no file that is not there.
# Prints each file missing from the index and each name the index lists in vain; exits 1 then.
# usage: results-index.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: results-index.sh SOURCE_DIR}
dir=$src/tests/lab/results
index=$dir/README.md
[ -f "$index" ] || { echo "$index: missing"; exit 1; }
bad=0
for f in "$dir"/*; do
  name=${f##*/}
  [ "$name" = README.md ] && continue
  grep -qF -- "$name" "$index" || { echo "$index: does not name $name"; bad=1; }
done
# Names in the index's table (its first column) that are no file of the directory.
while IFS= read -r name; do
  [ -e "$dir/$name" ] || { echo "$index: names $name, which is not in $dir"; bad=1; }
done < <(awk -F'|' '/^\| [a-z]/ && $2 !~ /^ file / {n = split($2, a, ","); for (i = 1; i <= n; i++) {gsub(/^ +| +$/, "", a[i]); print a[i]}}' "$index")
exit "$bad"
