#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.daemon_probe_off: a shared-queue probe that qcommitd cannot have is said, not silently
# off. qcommitd (policy probe=50ms) governs three active commits of one running TCG domain, each
# into a BASE in a directory of its own:
#   vda  imm/  immutable (chattr +i): root cannot create files there (EPERM);
#   vdb  ro/   a read-only bind mount of itself with BASE bind-mounted read-write on top, as a
#              unit's ProtectSystem=strict with ReadWritePaths= naming only the image would leave
#              it (EROFS);
#   vdc  open/ an ordinary directory.
# Expected: `qcommit status --output=json` shows probe "off" with the reason naming the probe file
# and strerror's text for vda and vdb, "on" with a last latency for vdc; qcommitd logs one line
# per job without a probe (not one per status), none for vdc; the human table has a PROBE column
# and a "probe off:" line per job without one.
# usage: daemon-probe-off.sh QCOMMIT QCOMMITD
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
daemon_test_init libvirt.daemon_probe_off qpo
mounts=()
undo_setup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null || true
  done
  [[ -d $dir/imm ]] && chattr -i "$dir/imm" 2>/dev/null
  # Nothing of the bind mounts may be left when the directory is removed.
  if grep -qF " $dir/" /proc/self/mounts; then
    echo "libvirt.daemon_probe_off: mounts left under $dir, not removing it" >&2
    dir=/nonexistent-qpo
  fi
  daemon_test_cleanup
}
trap undo_setup EXIT

mkdir imm ro open
for d in imm ro open; do
  qemu-img create -q -f qcow2 "$d/base.qcow2" 128M
  qemu-io -c 'write -P 1 0 16M' "$d/base.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -b "$dir/$d/base.qcow2" -F qcow2 "top-$d.qcow2"
  qemu-io -c 'write -P 2 8M 32M' "top-$d.qcow2" >/dev/null
done
chattr +i imm || { echo "chattr +i is not available here: skipped" >&2; exit 77; }
mount --bind ro ro && mounts+=("$dir/ro")
mount -o remount,bind,ro "$dir/ro"
mount --bind "$dir/ro/base.qcow2" "$dir/ro/base.qcow2" && mounts+=("$dir/ro/base.qcow2")
mount -o remount,bind,rw "$dir/ro/base.qcow2"
# The set-up holds: no new file in imm/ or ro/, their BASE writable.
for d in imm ro; do
  touch "$d/x" 2>/dev/null && fail "$d/ accepts new files: the set-up did not work"
  qemu-io -c 'write -P 1 0 4k' "$d/base.qcow2" >/dev/null || fail "$d/base.qcow2 is not writable"
done

start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=8M\nprobe=50ms\n'
cat >dom.xml <<XML
<domain type='qemu'>
  <name>$dom</name>
  <memory unit='MiB'>64</memory>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <devices>
$(for d in imm:vda ro:vdb open:vdc; do
  echo "    <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>"
  echo "      <source file='$dir/top-${d%%:*}.qcow2'/><target dev='${d##*:}' bus='virtio'/></disk>"
done)
  </devices>
</domain>
XML
virsh -q define dom.xml >/dev/null
virsh -q start "$dom" >/dev/null
for disk in vda vdb vdc; do virsh -q blockcommit "$dom" "$disk" --active --bandwidth 1 >/dev/null; done

# All three governed, vdc's probe with a latency (at most 30 s).
status_of() { "$QCOMMIT" status --socket "$dir/d.sock" --output=json; }
for ((i = 0; i < 300; i++)); do
  status_of >st.json
  [[ $(jq '[.jobs[] | select(.probe == "off" or .probe_last_ms != null)] | length' st.json) == 3 ]] && break
  sleep 0.1
done
jq -c '.jobs[] | {disk, probe, probe_off_reason, probe_last_ms, probe_period_ms}' st.json
job() { jq -c --arg d "$1" '.jobs[] | select(.disk == $d)' st.json; }
[[ $(job vda | jq -r .probe) == off ]] || fail "vda: probe is not off: $(job vda)"
[[ $(job vda | jq -r .probe_off_reason) == "cannot create the probe file in $dir/imm: Operation not permitted" ]] ||
  fail "vda: the reason does not name the file and the error: $(job vda)"
[[ $(job vdb | jq -r .probe) == off ]] || fail "vdb: probe is not off: $(job vdb)"
[[ $(job vdb | jq -r .probe_off_reason) == "cannot create the probe file in $dir/ro: Read-only file system" ]] ||
  fail "vdb: the reason does not name the file and the error: $(job vdb)"
[[ $(job vdc | jq -r .probe) == on ]] || fail "vdc: probe is not on: $(job vdc)"
job vdc | jq -e '.probe_last_ms > 0 and .probe_period_ms == 50 and .probe_off_reason == ""' >/dev/null ||
  fail "vdc: no probe latency: $(job vdc)"
# Its file was unlinked at once: no probe file left in open/.
[[ -z $(ls -A open | grep -v '^base.qcow2$') ]] || fail "open/ holds more than BASE: $(ls -A open)"

# The human table: a PROBE column, vdc "on" with a latency, a line per job without a probe.
"$QCOMMIT" status --socket "$dir/d.sock" >st.txt
cat st.txt
head -n 2 st.txt | grep -q ' PROBE ' || fail "no PROBE column"
grep -E "^$dom +vdc .* on [0-9.]+ms " st.txt >/dev/null || fail "vdc: no 'on LATENCY' in the table"
grep -E "^$dom +vda .* off " st.txt >/dev/null || fail "vda: no 'off' in the table"
grep -qxF "probe off: $dom vda: $(job vda | jq -r .probe_off_reason)" st.txt || fail "no 'probe off:' line for vda"
grep -qxF "probe off: $dom vdb: $(job vdb | jq -r .probe_off_reason)" st.txt || fail "no 'probe off:' line for vdb"

# The log: one line per job without a probe, after several status snapshots (2 s), none for vdc.
sleep 2
grep 'probe' d.log || true
for disk in vda vdb; do
  n=$(grep -cF "qcommitd: domain $dom disk $disk: shared-queue probe off: $(job $disk | jq -r .probe_off_reason)" d.log || true)
  [[ $n == 1 ]] || fail "$disk: $n log lines for the probe, expected 1"
done
grep -q "disk vdc: shared-queue probe" d.log && fail "vdc: a probe line although its probe is on"
for disk in vda vdb vdc; do virsh -q blockjob "$dom" "$disk" --abort >/dev/null 2>&1 || true; done
echo "libvirt.daemon_probe_off: OK"
