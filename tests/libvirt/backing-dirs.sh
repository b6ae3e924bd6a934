#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.backing_dirs: a chain across directories (vms/snap -> vms/vm -> templates/base, a
# template in a directory of its own) is followed without a flag where the host's libvirt keeps
# images: the target directory of one of its storage pools, or the directory of a file one of its
# domains' disks (running or not, here shut off) names; `info`, `map` and `plan` alike. Any other
# directory stays refused, the error naming the exact --allow-backing-dir to add. ~5 s.
# usage: backing-dirs.sh QCOMMIT
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
tag=qbd-$$-$RANDOM
root=$(mktemp -d /var/tmp/qcommit-backing-dirs.XXXXXX)  # no pool's tree
pool=$tag-templates
dom=$tag-dom
cleanup() {
  virsh -q undefine "$dom" >/dev/null 2>&1 || true
  virsh -q pool-destroy "$pool" >/dev/null 2>&1 || true
  virsh -q pool-undefine "$pool" >/dev/null 2>&1 || true
  rm -rf "$root"
}
trap cleanup EXIT
fail() { echo "libvirt.backing_dirs: FAIL: $*" >&2; exit 1; }
cd "$root"
mkdir vms templates golden elsewhere
for d in templates golden elsewhere; do
  qemu-img create -q -f qcow2 "$d/base.qcow2" 16M
  qemu-io -c 'write -P 1 0 1M' "$d/base.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -b "../$d/base.qcow2" -F qcow2 "vms/vm-$d.qcow2"
  qemu-img create -q -f qcow2 -b "vm-$d.qcow2" -F qcow2 "vms/snap-$d.qcow2"
  qemu-io -c 'write -P 2 0 64k' "vms/snap-$d.qcow2" >/dev/null
done

refused() {  # refused DIR CMD...: refused naming the --allow-backing-dir that would follow DIR
  local d=$1 rc=0
  shift
  "$QCOMMIT" "$@" >out.txt 2>err.txt || rc=$?
  [[ $rc == 1 ]] || fail "qcommit $*: exit $rc, expected a refusal: $(cat out.txt err.txt)"
  grep -qF "to follow it, add --allow-backing-dir $root/$d" err.txt ||
    fail "qcommit $*: the error does not name --allow-backing-dir $root/$d: $(cat err.txt)"
}
followed() {  # followed DIR: info, map and plan follow vms/snap-DIR down to DIR/base.qcow2
  local d=$1
  [[ $("$QCOMMIT" info --output=json "vms/snap-$d.qcow2" | jq -r '.chain[2].resolved') == "$root/$d/base.qcow2" ]] ||
    fail "info vms/snap-$d.qcow2 does not reach $d/base.qcow2: $("$QCOMMIT" info "vms/snap-$d.qcow2" 2>&1 | tail -n 2)"
  "$QCOMMIT" map "vms/snap-$d.qcow2" >/dev/null || fail "map vms/snap-$d.qcow2 refused"
  "$QCOMMIT" plan "vms/snap-$d.qcow2" --base "$root/$d/base.qcow2" --budget off >/dev/null ||
    fail "plan vms/snap-$d.qcow2 refused"
}

# Before libvirt knows the directories: refused, naming the flag.
for d in templates golden elsewhere; do
  for cmd in info map; do refused "$d" "$cmd" "vms/snap-$d.qcow2"; done
done
# A dir pool on templates/; a shut-off domain whose disk is golden/base.qcow2.
virsh -q pool-define-as "$pool" dir --target "$root/templates" >/dev/null
virsh -q pool-start "$pool" >/dev/null
define_disk_domain "$dom" "$root/golden/base.qcow2" "$root"
followed templates
followed golden
for cmd in info map; do refused elsewhere "$cmd" vms/snap-elsewhere.qcow2; done
refused elsewhere plan vms/snap-elsewhere.qcow2 --budget off
# The flag the error names does what it says.
"$QCOMMIT" info vms/snap-elsewhere.qcow2 --allow-backing-dir "$root/elsewhere" >/dev/null ||
  fail "info with --allow-backing-dir $root/elsewhere refused"
echo "libvirt.backing_dirs: OK"
