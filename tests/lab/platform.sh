# SPDX-License-Identifier: GPL-2.0-or-later
# shellcheck shell=bash
# Which stack a lab run uses: this host's libvirtd and QEMU, or Debian 13's from
# scripts/trixie-platform (started). Source before lab.sh; the variables are exported so that the
# commands a run starts (bench-stall's rows, tests/lab/live_row.sh) see the same stack.
#
#   lab_platform host                 nothing to change (the default)
#   lab_platform trixie [BINARIES]    runs in the platform's shared directory, against its
#                                     libvirtd; BINARIES = inside (qcommit/qcommitd built in the
#                                     chroot by `scripts/trixie-platform build`, run there through
#                                     wrappers, talking to the platform's libvirtd as
#                                     qemu:///system), host (this host's build, talking to it by
#                                     socket URI) or auto (inside when that build has both
#                                     binaries; the default). `inside` fails without that build.
#   lab_platform_describe             one line: distribution, QEMU and libvirt of the stack in use
# Sets (trixie): LAB_URI, LAB_RUN_ROOT, LAB_ID_PREFIX, LAB_LOCAL_DAEMONS=0, LAB_TMP_ROOT,
# LAB_QCOMMIT_URI and, with inside binaries, LAB_QCOMMIT and LAB_QCOMMITD; LAB_PLATFORM.

LAB_PLATFORM_SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/trixie-platform

lab_platform() {
  local which=${1:-host}
  case $which in
    host) export LAB_PLATFORM=host ;;
    trixie) lab_platform_trixie "${2:-auto}" ;;
    *) echo "lab_platform: unknown platform $which (host or trixie)" >&2; return 2 ;;
  esac
}

lab_platform_trixie() {
  local binaries=$1 p=$LAB_PLATFORM_SCRIPT share build
  "$p" status >/dev/null 2>&1 || {
    echo "lab_platform: the Debian 13 platform is not running (scripts/trixie-platform setup && start)" >&2
    return 1
  }
  share=$("$p" share)
  build=$("$p" build-dir)
  export LAB_PLATFORM=trixie
  export LAB_URI LAB_RUN_ROOT=$share/lab-run LAB_ID_PREFIX=qcl-trixie LAB_LOCAL_DAEMONS=0
  export LAB_TMP_ROOT=$share LAB_QCOMMIT_URI
  LAB_URI=$("$p" uri)
  LAB_QCOMMIT_URI=$LAB_URI
  if [ "$binaries" = auto ]; then
    binaries=host
    [ -x "$build/qcommit" ] && [ -x "$build/qcommitd" ] && binaries=inside
  fi
  case $binaries in
    host) ;;
    inside) lab_platform_inside_binaries "$share" || return 1 ;;
    *) echo "lab_platform: binaries must be inside, host or auto, not $binaries" >&2; return 2 ;;
  esac
  LAB_PLATFORM_BINARIES=$binaries
}

# Wrappers in <share>/bin that run the platform's build in the chroot. Every path a run hands
# them lies in the shared directory (same path inside and out); the chroot's /proc, /sys and
# /dev are the host's, so process and page-cache readings see the same machine.
lab_platform_inside_binaries() {
  local share=$1 p=$LAB_PLATFORM_SCRIPT root build b
  root=$("$p" root)
  build=$("$p" build-dir)
  [ -x "$build/qcommit" ] && [ -x "$build/qcommitd" ] || {
    echo "lab_platform: $build has no qcommit/qcommitd (scripts/trixie-platform build qcommit qcommitd)" >&2
    return 1
  }
  "$p" mount-build || return 1
  mkdir -p "$share/bin"
  for b in qcommit qcommitd; do
    printf '#!/bin/sh\nexec chroot %s /build/%s "$@"\n' "$root" "$b" >"$share/bin/$b"
    chmod 755 "$share/bin/$b"
  done
  export LAB_QCOMMIT=$share/bin/qcommit LAB_QCOMMITD=$share/bin/qcommitd
  LAB_QCOMMIT_URI=qemu:///system
}

lab_platform_describe() {
  local uri=${LAB_URI:-qemu:///system} dist qemu lv
  if [ "${LAB_PLATFORM:-host}" = trixie ]; then
    dist="Debian $(cat "$("$LAB_PLATFORM_SCRIPT" root)/etc/debian_version" 2>/dev/null) (trixie chroot), binaries ${LAB_PLATFORM_BINARIES:-host}"
  else
    dist="$(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}")"
  fi
  qemu=$(virsh -c "$uri" version --daemon 2>/dev/null | awk '/Running hypervisor/ {print $NF}')
  lv=$(virsh -c "$uri" version --daemon 2>/dev/null | awk '/Running against daemon/ {print $NF}')
  echo "$dist, QEMU ${qemu:-?}, libvirt ${lv:-?}, kernel $(uname -r)"
}
