#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.spdx: every source file of the tree names qcommit's licence at its top, the line
# "SPDX-License-Identifier: GPL-2.0-or-later" in the file's own comment syntax, on line 1 or,
# where line 1 must be something else (a #! line; the preamble "name(section)" that scdoc
# wants first in docs/*.scd), on line 2. The files are the tracked ones plus new ones not yet
# committed (git ls-files --cached --others --exclude-standard); outside a git checkout, every
# file under SOURCE_DIR except build*/. Data and text that is no source are left out (see
# `exempt`). COPYING must be there. Prints each offending file; exits 1 when there is one.
# usage: spdx.sh SOURCE_DIR
set -euo pipefail
test_name=docs.spdx
. "$(dirname "$0")/../lib/test.sh"
src=${1:?usage: spdx.sh SOURCE_DIR}
tag='SPDX-License-Identifier: GPL-2.0-or-later'

# Files that carry no SPDX line, each kind with its reason.
exempt() {
  case $1 in
    *.md) ;;                                  # prose; README.md's "Licence" section says it
    COPYING) ;;                               # the licence text itself
    tests/bench-results/* | tests/lab/results/* | tests/lab/live-bench-*.txt) ;; # archived results
    tests/fuzz/regressions/* | tests/plugin/data/*) ;; # inputs read byte for byte
    *.png | *.csv | *.json | *.qcow2 | *.raw | *.img) ;; # data
    packaging/conffiles) ;;                   # dpkg reads it as a bare list of paths
    packaging/debian/changelog) ;;            # dpkg-parsechangelog's format has no comments
    packaging/debian/copyright) ;;            # DEP-5: says the licence in its own fields
    *) return 1 ;;
  esac
}

files() {
  if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$src" ls-files --cached --others --exclude-standard
  else
    (cd "$src" && find . -path './build*' -prune -o -path ./.git -prune -o -type f -print | sed 's|^\./||')
  fi
}

# Whether file $1 names the licence where it should (bash builtins only: ~300 files).
has_tag() {
  local first= second=
  { IFS= read -r first || true; IFS= read -r second || true; } <"$1"
  [[ $first == *"$tag"* ]] && return 0
  [[ ($first == '#!'* || $1 == *.scd) && $second == *"$tag"* ]]
}

[[ -f $src/COPYING ]] || fail "$src/COPYING is missing"
checked=0
while IFS= read -r f; do
  exempt "$f" && continue
  [[ -f $src/$f ]] || continue # deleted in the work tree, not yet committed
  checked=$((checked + 1))
  has_tag "$src/$f" || soft_fail "$f: no \"$tag\" at its top"
done < <(files | sort -u)
((checked > 0)) || fail "no source files found under $src"
finish "docs.spdx: all $checked source files carry \"$tag\""
