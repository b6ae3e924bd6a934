#!/usr/bin/env bash
# packaging.systemd_unit: the qcommitd unit passes `systemd-analyze verify`, and keeps none of the
# sandboxing that hides what qcommitd must reach: images under /home and /tmp (ProtectHome,
# PrivateTmp), block devices of logical-volume pools (PrivateDevices, DevicePolicy), remote libvirt
# URIs (RestrictAddressFamilies without IP); and it does not pull in libvirtd.service, which hosts
# with the modular daemons (virtqemud) do not run.
#
# usage: systemd-unit.sh UNIT QCOMMITD
set -euo pipefail
unit=$1 qcommitd=$(realpath "$2")
failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for key in ProtectHome PrivateTmp PrivateDevices DevicePolicy InaccessiblePaths TemporaryFileSystem; do
  grep -Eq "^$key=" "$unit" && fail "the unit sets $key"
done
grep -Eq '^Wants=.*libvirtd\.service' "$unit" && fail "the unit wants libvirtd.service"
grep -Eq '^Requires=' "$unit" && fail "the unit requires another unit"
families=$(sed -n 's/^RestrictAddressFamilies=//p' "$unit")
if [[ -n $families ]]; then
  for f in AF_UNIX AF_INET AF_INET6; do [[ " $families " == *" $f "* ]] || fail "RestrictAddressFamilies lacks $f"; done
fi
if command -v systemd-analyze >/dev/null; then
  sed "s|^ExecStart=/usr/sbin/qcommitd|ExecStart=$qcommitd|" "$unit" >"$work/qcommitd.service"
  systemd-analyze verify --man=no "$work/qcommitd.service" >"$work/verify.txt" 2>&1 ||
    fail "systemd-analyze verify: $(cat "$work/verify.txt")"
else
  echo "skip: no systemd-analyze"
fi
if ((${#failures[@]})); then
  printf 'packaging.systemd_unit: %d failure(s)\n' "${#failures[@]}"
  exit 1
fi
echo "packaging.systemd_unit: all checks passed"
