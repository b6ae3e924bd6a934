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
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
SHIM=$(realpath "$2")
readonly kRefusals=2
daemon_test_init libvirt.live_pivot_not_ready qpn

start_two_layer_domain 64M '0 16M' '8M 16M'

rc=0
QCOMMIT_TEST_PIVOT_REFUSALS=$kRefusals QCOMMIT_TEST_PIVOT_LOG="$dir/refusals" LD_PRELOAD="$SHIM" \
  timeout 120 "$QCOMMIT" live "$dom" vda --pivot --socket "$dir/none.sock" --output=json >events 2>err || rc=$?
[[ $rc == 0 ]] || fail "qcommit live exited $rc: $(cat err)"
refusals=$(grep -c '^refused vda$' refusals 2>/dev/null || true)
echo "  pivots refused as not ready: ${refusals:-0}; result: $(jq -c 'select(.event == "result")' events)"
[[ $refusals == "$kRefusals" ]] || fail "the shim refused ${refusals:-0} pivots, expected $kRefusals (was it loaded?)"
[[ $(jq -se 'map(select(.event == "result"))[0].outcome' events) == '"done"' ]] || fail "no result 'done': $(cat events)"
[[ $(vda_source "$dom") == "$dir/base.qcow2" ]] ||
  fail "vda is not on base.qcow2 after the pivot"
virsh -q destroy "$dom" >/dev/null
qemu-img compare -q view-before.raw base.qcow2 || fail "base.qcow2 differs from the guest's view"
qemu-img check -q base.qcow2 || fail "base.qcow2 is not clean"
echo "libvirt.live_pivot_not_ready: passed"
