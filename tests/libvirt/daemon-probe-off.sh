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
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1") QCOMMITD=$(realpath "$2")
lv_setup libvirt.daemon_probe_off qpo
undo_mounts() {
  local m
  for m in "$dir/ro/base.qcow2" "$dir/ro"; do umount "$m" || umount -l "$m"; done 2>/dev/null
  chattr -i "$dir/imm" 2>/dev/null
  # Nothing of the bind mounts may be left when the directory is removed.
  grep -qF " $dir/" /proc/self/mounts && echo "libvirt.daemon_probe_off: mounts left under $dir, not removing it" >&2 && work=
}
on_exit undo_mounts

mkdir imm ro open
for d in imm ro open; do
  layers 128M "$dir/$d/base.qcow2=write -P 1 0 16M" "top-$d.qcow2=write -P 2 8M 32M"
done
chattr +i imm || { echo "chattr +i is not available here: skipped" >&2; exit 77; }
mount --bind ro ro
mount -o remount,bind,ro "$dir/ro"
mount --bind "$dir/ro/base.qcow2" "$dir/ro/base.qcow2"
mount -o remount,bind,rw "$dir/ro/base.qcow2"
# The set-up holds: no new file in imm/ or ro/, their BASE writable.
for d in imm ro; do
  touch "$d/x" 2>/dev/null && fail "$d/ accepts new files: the set-up did not work"
  qio -f qcow2 "$d/base.qcow2" 'write -P 1 0 4k' || fail "$d/base.qcow2 is not writable"
done

start_test_qcommitd '[default]\nbudget=20ms\nfloor=1M\nceiling=8M\nprobe=50ms\n'
define_disk_domain "$dom" "$dir/top-imm.qcow2" "$dir/top-ro.qcow2" "$dir/top-open.qcow2"
virsh -q start "$dom" >/dev/null
for disk in vda vdb vdc; do virsh -q blockcommit "$dom" "$disk" --active --bandwidth 1 >/dev/null; done

# All three governed, vdc's probe with a latency (at most 30 s).
all_probed() {
  qstatus --output=json >st.json
  [[ $(jq '[.jobs[] | select(.probe == "off" or .probe_last_ms != null)] | length' st.json) == 3 ]]
}
wait_until 60 all_probed || true
jq -c '.jobs[] | {disk, probe, probe_off_reason, probe_last_ms, probe_period_ms}' st.json
# The human table too: a PROBE column, vdc "on" with a latency, a line per job without a probe.
qstatus >st.txt
cat st.txt
job() { jq -c --arg d "$1" '.jobs[] | select(.disk == $d)' st.json; }
reason() { job "$1" | jq -r .probe_off_reason; }
for d in vda:imm:"Operation not permitted" vdb:ro:"Read-only file system"; do
  IFS=: read -r disk sub err <<<"$d"
  [[ $(job "$disk" | jq -r .probe) == off ]] || fail "$disk: probe is not off: $(job "$disk")"
  [[ $(reason "$disk") == "cannot create the probe file in $dir/$sub: $err" ]] ||
    fail "$disk: the reason does not name the file and the error: $(job "$disk")"
  grep -qxF "probe off: $dom $disk: $(reason "$disk")" st.txt || fail "no 'probe off:' line for $disk"
done
[[ $(job vdc | jq -r .probe) == on ]] || fail "vdc: probe is not on: $(job vdc)"
job vdc | jq -e '.probe_last_ms > 0 and .probe_period_ms == 50 and .probe_off_reason == ""' >/dev/null ||
  fail "vdc: no probe latency: $(job vdc)"
# Its file was unlinked at once: no probe file left in open/.
[[ -z $(ls -A open | grep -v '^base.qcow2$') ]] || fail "open/ holds more than BASE: $(ls -A open)"
head -n 2 st.txt | grep -q ' PROBE ' || fail "no PROBE column"
grep -E "^$dom +vdc .* on [0-9.]+ms " st.txt >/dev/null || fail "vdc: no 'on LATENCY' in the table"
grep -E "^$dom +vda .* off " st.txt >/dev/null || fail "vda: no 'off' in the table"

# The log: one line per job without a probe, after several status snapshots (2 s), none for vdc.
sleep 2
grep 'probe' d.log || true
for disk in vda vdb; do
  n=$(grep -cF "qcommitd: domain $dom disk $disk: shared-queue probe off: $(reason $disk)" d.log || true)
  [[ $n == 1 ]] || fail "$disk: $n log lines for the probe, expected 1"
done
grep -q "disk vdc: shared-queue probe" d.log && fail "vdc: a probe line although its probe is on"
for disk in vda vdb vdc; do virsh -q blockjob "$dom" "$disk" --abort >/dev/null 2>&1 || true; done
echo "libvirt.daemon_probe_off: OK"
