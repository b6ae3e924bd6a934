#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.backing_dirs: a chain across directories (vms/snap -> vms/vm -> templates/base, a
# template in a directory of its own) is followed without a flag where the host's libvirt keeps
# images: the target directory of one of its storage pools, or the directory of a file one of its
# domains' disks (running or not, here shut off) names; `info`, `map` and `plan` alike. Any other
# directory stays refused, the error naming the exact --allow-backing-dir to add. ~5 s.
# usage: backing-dirs.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
lv_setup libvirt.backing_dirs qbd /var/tmp  # in no pool's tree
mkdir vms templates golden elsewhere
for d in templates golden elsewhere; do
  layers 16M "$d/base.qcow2=write -P 1 0 1M"
  qemu-img create -q -f qcow2 -b "../$d/base.qcow2" -F qcow2 "vms/vm-$d.qcow2"
  qemu-img create -q -f qcow2 -b "vm-$d.qcow2" -F qcow2 "vms/snap-$d.qcow2"
  qio -f qcow2 "vms/snap-$d.qcow2" 'write -P 2 0 64k'
done

refused() {  # refused DIR CMD...: refused naming the --allow-backing-dir that would follow DIR
  local d=$1
  shift
  try "$QCOMMIT" "$@"
  [[ $rc == 1 ]] || fail "qcommit $*: exit $rc, expected a refusal: $(cat out.txt err.txt)"
  grep -qF "to follow it, add --allow-backing-dir $dir/$d" err.txt ||
    fail "qcommit $*: the error does not name --allow-backing-dir $dir/$d: $(cat err.txt)"
}
followed() {  # followed DIR: info, map and plan follow vms/snap-DIR down to DIR/base.qcow2
  local d=$1
  [[ $("$QCOMMIT" info --output=json "vms/snap-$d.qcow2" | jq -r '.chain[2].resolved') == "$dir/$d/base.qcow2" ]] ||
    fail "info vms/snap-$d.qcow2 does not reach $d/base.qcow2: $("$QCOMMIT" info "vms/snap-$d.qcow2" 2>&1 | tail -n 2)"
  "$QCOMMIT" map "vms/snap-$d.qcow2" >/dev/null || fail "map vms/snap-$d.qcow2 refused"
  "$QCOMMIT" plan "vms/snap-$d.qcow2" --base "$dir/$d/base.qcow2" --budget off >/dev/null ||
    fail "plan vms/snap-$d.qcow2 refused"
}

# Before libvirt knows the directories: refused, naming the flag.
for d in templates golden elsewhere; do
  for cmd in info map; do refused "$d" "$cmd" "vms/snap-$d.qcow2"; done
done
# A dir pool on templates/; a shut-off domain whose disk is golden/base.qcow2.
dir_pool "$tag-templates" "$dir/templates"
define_disk_domain "$dom" "$dir/golden/base.qcow2"
for d in templates golden; do followed "$d"; done
for cmd in info map; do refused elsewhere "$cmd" vms/snap-elsewhere.qcow2; done
refused elsewhere plan vms/snap-elsewhere.qcow2 --budget off
# The flag the error names does what it says.
"$QCOMMIT" info vms/snap-elsewhere.qcow2 --allow-backing-dir "$dir/elsewhere" >/dev/null ||
  fail "info with --allow-backing-dir $dir/elsewhere refused"
echo "libvirt.backing_dirs: OK"
