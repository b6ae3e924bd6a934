#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# packaging.systemd_unit: the qcommitd unit passes `systemd-analyze verify`, and keeps none of the
# sandboxing that hides what qcommitd must reach: images under /home and /tmp (ProtectHome,
# PrivateTmp), block devices of logical-volume pools (PrivateDevices, DevicePolicy), remote libvirt
# URIs (RestrictAddressFamilies without IP); and it does not pull in libvirtd.service, which hosts
# with the modular daemons (virtqemud) do not run.
# qcommitd writes beside the images it governs (the shared-queue probe, policy probe=, creates its
# file in the directory of a job's target), so those directories must stay writable: the unit's
# ProtectSystem=, ReadOnlyPaths= and ReadWritePaths= are read as systemd.exec(5) defines them (the
# most specific path decides) and every directory where images usually live is checked, with
# /run/qcommit (its socket). This is a reading of the unit file, not a run under systemd; the
# unit's command line is then run (without systemd) where its policy file does not exist.
# usage: systemd-unit.sh UNIT QCOMMITD
set -euo pipefail
. "$(dirname "$0")/lib.sh"
unit=$(realpath "$1") qcommitd=$(realpath "$2")
setup packaging.systemd_unit

for key in ProtectHome PrivateTmp PrivateDevices DevicePolicy InaccessiblePaths TemporaryFileSystem; do
  grep -Eq "^$key=" "$unit" && soft_fail "the unit sets $key"
done
grep -Eq '^Wants=.*libvirtd\.service' "$unit" && soft_fail "the unit wants libvirtd.service"
grep -Eq '^Requires=' "$unit" && soft_fail "the unit requires another unit"
# The unit's file-system view as rules "PATH ro|rw": ProtectSystem= first, then ReadOnlyPaths=
# and ReadWritePaths= (a leading - or + only changes what happens when the path is missing).
view_rules() {
  local ps key v p
  ps=$(sed -n 's/^ProtectSystem=//p' "$unit" | tail -n 1)
  case $ps in
    strict) printf '%s\n' "/ ro" "/dev rw" "/proc rw" "/sys rw" ;;
    full) printf '%s\n' "/usr ro" "/boot ro" "/efi ro" "/etc ro" ;;
    yes | true | on | 1) printf '%s\n' "/usr ro" "/boot ro" "/efi ro" ;;
  esac
  for key in ReadOnlyPaths:ro ReadWritePaths:rw; do
    while read -r v; do
      for p in $v; do printf '%s %s\n' "${p#[-+]}" "${key#*:}"; done
    done < <(sed -n "s/^${key%%:*}=//p" "$unit")
  done
}
# writable DIR: whether the unit leaves DIR writable (the longest rule that covers it decides).
writable() {
  local dir=$1 best=-1 mode=rw path m
  while read -r path m; do
    [[ $dir == "$path" || $dir == "${path%/}/"* ]] || continue
    ((${#path} > best)) && best=${#path} mode=$m
  done < <(view_rules)
  [[ $mode == rw ]]
}
# libvirt's default pool, the usual places of other directory pools and NFS mounts, a pool an
# administrator made at the top level, and qcommitd's runtime directory.
for dir in /var/lib/libvirt/images /srv/images /mnt/nfs /media/vm /opt/images /home/vm /data/images \
  /var/tmp /tmp /run/qcommit; do
  writable "$dir" || soft_fail "the unit makes $dir read-only: qcommitd cannot create its probe file beside an image there"
done
families=$(sed -n 's/^RestrictAddressFamilies=//p' "$unit")
if [[ -n $families ]]; then
  for f in AF_UNIX AF_INET AF_INET6; do [[ " $families " == *" $f "* ]] || soft_fail "RestrictAddressFamilies lacks $f"; done
fi
if command -v systemd-analyze >/dev/null; then
  sed "s|^ExecStart=/usr/sbin/qcommitd|ExecStart=$qcommitd|" "$unit" >qcommitd.service
  systemd-analyze verify --man=no "$work/qcommitd.service" >verify.txt 2>&1 || soft_fail "systemd-analyze verify: $(cat verify.txt)"
else
  echo "skip: no systemd-analyze"
fi
# The unit's command line starts the daemon without its policy file (a fresh install has none):
# qcommitd runs with the built-in policy and says so in one line; a missing file named anywhere
# else stays an error. (Against libvirt's test driver and a socket of its own; the default path
# must not exist here, else this part is skipped.)
exec_args=$(sed -n 's|^ExecStart=/usr/sbin/qcommitd||p' "$unit")
default_conf=$(sed -n 's|.*--config \([^ ]*\).*|\1|p' <<<"$exec_args")
[[ -n $default_conf ]] || soft_fail "the unit's ExecStart names no --config"
if [[ -n $default_conf && ! -e $default_conf ]]; then
  # shellcheck disable=SC2086
  try timeout 3 "$qcommitd" $exec_args --uri test:///default --socket "$work/qcd.sock"
  [[ $rc == 124 ]] || soft_fail "qcommitd $exec_args without $default_conf: exit $rc, expected to keep running: $(cat err.txt)"
  grep -qF "$default_conf does not exist: the built-in policy" err.txt ||
    soft_fail "qcommitd without $default_conf does not say it runs the built-in policy: $(cat err.txt)"
  try timeout 10 "$qcommitd" --config "$work/none.conf" --uri test:///default --socket "$work/qcd2.sock"
  [[ $rc != 0 && $rc != 124 ]] || soft_fail "qcommitd --config $work/none.conf (missing): exit $rc, expected an error"
  grep -qF "none.conf" err.txt || soft_fail "qcommitd's error does not name the missing file: $(cat err.txt)"
else
  echo "skip: $default_conf exists here"
fi
finish "packaging.systemd_unit: all checks passed"
