#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# Runs a command holding the lab lock (/tmp/qcommit-lab.lock): lab runs share libvirtd, the
# FUSE storage and the host's latency, so one at a time across ctest, bench-stall and other
# users of the host. Re-entrant through QCOMMIT_LAB_LOCKED: a command started under this wrapper (say
# `tests/lab/with-lab-lock.sh ctest -L lab`) does not wait for itself in the tests it runs.
#   tests/lab/with-lab-lock.sh COMMAND [ARGS...]
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: with-lab-lock.sh COMMAND [ARGS...]" >&2; exit 2; }
if [ -n "${QCOMMIT_LAB_LOCKED:-}" ]; then exec "$@"; fi
export QCOMMIT_LAB_LOCKED=1
# -o: the lock stays with flock itself, not with what the command starts and leaves running
# (lab.qcommitd_governs restarts libvirtd: with the fd inherited, libvirtd held the lock).
exec flock -o "${QCOMMIT_LAB_LOCK:-/tmp/qcommit-lab.lock}" "$@"
