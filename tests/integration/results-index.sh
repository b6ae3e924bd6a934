#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.results_index: every archived lab result under tests/lab/results is named, by its full
# file name, in the first column of that directory's README.md table, and the table names no
# file that is not there. Prints each file missing from the index and each name the index lists
# in vain; exits 1 then.
# usage: results-index.sh SOURCE_DIR
set -euo pipefail
test_name=docs.results_index
. "$(dirname "$0")/../lib/test.sh"
src=${1:?usage: results-index.sh SOURCE_DIR}
dir=$src/tests/lab/results
index=$dir/README.md
[[ -f $index ]] || fail "$index: missing"
# The names in the table's first column (comma-separated where a row holds several files).
names=$(awk -F'|' '/^\| [^-]/ && $2 !~ /^ file / {
  n = split($2, a, ",")
  for (i = 1; i <= n; i++) { gsub(/^ +| +$/, "", a[i]); print a[i] }
}' "$index" | sort -u)
for f in "$dir"/*; do
  name=${f##*/}
  [[ $name == README.md ]] || grep -qxF -- "$name" <<<"$names" || soft_fail "$index: does not name $name"
done
while IFS= read -r name; do
  [[ -z $name || -e $dir/$name ]] || soft_fail "$index: names $name, which is not in $dir"
done <<<"$names"
finish
