#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.live_pivot_not_ready: libvirt refuses a pivot with VIR_ERR_BLOCK_COPY_ACTIVE while it has
# not yet taken in QEMU's ready event, although the job's figures already say ready (seen on CI).
# `qcommit live --pivot` must take that as "not ready yet" and pivot again, not fail. A running
# TCG domain on base <- top, no qcommitd; the shim (LD_PRELOAD) refuses the first two pivots as
# libvirt does. The merge ends "done" with two refusals logged, vda on base.qcow2, which holds
# the guest's view.
# usage: live-pivot-not-ready.sh QCOMMIT SHIM.so
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
SHIM=$(realpath "$2")
readonly kRefusals=2
lv_setup libvirt.live_pivot_not_ready qpn
start_domain 64M "$dir/base.qcow2=write -P 1 0 16M" "$dir/top.qcow2=write -P 2 8M 16M"
QCOMMIT_TEST_PIVOT_REFUSALS=$kRefusals QCOMMIT_TEST_PIVOT_LOG="$dir/refusals" LD_PRELOAD="$SHIM" \
  timeout 120 "$QCOMMIT" live "$dom" vda --pivot --socket "$dir/none.sock" --output=json >events 2>err ||
  fail "qcommit live exited $?: $(cat err)"
refusals=$(grep -c '^refused vda$' refusals 2>/dev/null || true)
echo "  pivots refused as not ready: ${refusals:-0}; result: $(jq -c 'select(.event == "result")' events)"
[[ $refusals == "$kRefusals" ]] || fail "the shim refused ${refusals:-0} pivots, expected $kRefusals (was it loaded?)"
live_done
echo "libvirt.live_pivot_not_ready: passed"
