#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# The dependency direction (docs/architecture.md): a source file includes only project headers
# from its own directory or from a layer below it, and qcow2/, throttle/ and common/ include no
# libvirt or GLib header. Lists every include that breaks it; exit 1 when there is one.
#   common < {qcow2, throttle} < engine < plugin/host < plugin/policy < plugin/hypervisor
#          < plugin/govern < plugin/live < plugin/domain < plugin/daemon < cli
set -euo pipefail
test_name=arch.includes
. "$(dirname "$0")/../lib/test.sh"
root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$root"
declare -A rank=(
  [common]=0 [qcow2]=1 [throttle]=1 [engine]=2
  [plugin/host]=3 [plugin/policy]=4 [plugin/hypervisor]=5 [plugin/govern]=6 [plugin/live]=7
  [plugin/domain]=8 [plugin/daemon]=9 [cli]=10
)
# The layer a path belongs to: plugin/<room>/… or the top directory.
layer() {
  case $1 in
    plugin/*/*) local r=${1#plugin/}; echo "plugin/${r%%/*}" ;;
    */*) echo "${1%%/*}" ;;
  esac
}
while IFS= read -r f; do
  own=$(layer "$f")
  [[ -n ${rank[$own]+x} ]] || { soft_fail "$f: in no layer of tests/integration/includes.sh"; continue; }
  while IFS=: read -r line inc; do
    inc=${inc#*\"}; inc=${inc%\"*}
    dep=$(layer "$inc")
    if [[ -z ${rank[$dep]+x} ]]; then
      soft_fail "$f:$line: includes $inc, in no layer"
    elif [[ $dep != "$own" ]] && (( rank[$dep] >= rank[$own] )); then
      soft_fail "$f:$line: $own includes $inc ($dep is not below it)"
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" || true)
  [[ $own =~ ^(common|qcow2|throttle)$ ]] || continue
  while IFS= read -r hit; do
    soft_fail "$f:$hit: $own must not depend on libvirt or GLib"
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*<(libvirt/|glib|gio/)' "$f" | cut -d: -f1 || true)
done < <(git ls-files -- 'common/*.[ch]*' 'qcow2/*.[ch]*' 'throttle/*.[ch]*' 'engine/*.[ch]*' \
           'plugin/*.[ch]*' 'cli/*.[ch]*' | grep -E '\.(h|hpp|c|cpp)$')
finish
