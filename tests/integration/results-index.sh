#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.results_index: every archived lab result under tests/lab/results is named, by its full
# file name, in the first column of that directory's README.md table, and the table names no
# file that is not there. Prints each file missing from the index and each name the index lists
# in vain; exits 1 then.
# usage: results-index.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: results-index.sh SOURCE_DIR}
dir=$src/tests/lab/results
index=$dir/README.md
[ -f "$index" ] || { echo "$index: missing"; exit 1; }
# The names in the table's first column (comma-separated where a row holds several files).
names=$(awk -F'|' '/^\| [^-]/ && $2 !~ /^ file / {
  n = split($2, a, ",")
  for (i = 1; i <= n; i++) { gsub(/^ +| +$/, "", a[i]); print a[i] }
}' "$index" | sort -u)
bad=0
for f in "$dir"/*; do
  name=${f##*/}
  [ "$name" = README.md ] && continue
  grep -qxF -- "$name" <<<"$names" || { echo "$index: does not name $name"; bad=1; }
done
while IFS= read -r name; do
  [ -n "$name" ] || continue
  [ -e "$dir/$name" ] || { echo "$index: names $name, which is not in $dir"; bad=1; }
done <<<"$names"
exit "$bad"
