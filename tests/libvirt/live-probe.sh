#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.live_probe: `qcommit live --probe` sets the in-process governor's shared-queue probe, as
# the policy's probe= does for qcommitd. A running TCG domain on base <- top in a directory on a
# local filesystem (ext4, XFS or Btrfs), no qcommitd (its socket is a path where none answers):
#   --probe bogus, --probe 5ms (below the 10ms the probe takes)
#                      exit 2 at once, one line naming --probe, the value and what is wrong;
#                      the domain's chain untouched;
#   (no --probe)       auto: the progress events say "local" with the reason naming the filesystem;
#   --probe 50ms       on, although the filesystem is local;
#   --probe off        "disabled".
# Each merge (two-phase, --pivot) ends "done", on base.qcow2, which holds the guest's view.
# usage: live-probe.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
lv_setup libvirt.live_probe qlp
fs=$(stat -f -c %T "$dir")
[[ $fs == ext2/ext3 || $fs == xfs || $fs == btrfs ]] || { echo "$dir is on $fs, not a local disk filesystem: skipped" >&2; exit 77; }

# A fresh chain (top over base, 24 MiB of TOP's own data), the domain started on it.
fresh_chain() {
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
  virsh -q undefine "$dom" >/dev/null 2>&1 || true
  rm -f base.qcow2 top.qcow2 ./*.qcommit-*.qcow2
  start_domain 128M "$dir/base.qcow2=write -P 1 0 32M" "$dir/top.qcow2=write -P 2 16M 24M"
}

# merge_with WANT_PROBE [ARGS...]: qcommit live --pivot (2 MiB/s at most: progress for a few
# seconds), every progress event's probe field WANT_PROBE, then the data checked.
merge_with() {
  local want=$1 t0=$SECONDS
  shift
  fresh_chain
  timeout 120 "$QCOMMIT" live "$dom" vda --pivot --max-rate 2M --socket "$dir/none.sock" \
    --output=json "$@" >events 2>err || fail "qcommit live $*: exit $?: $(cat err)"
  echo "  qcommit live $*: progress probe states:$(jq -r 'select(.event == "progress") | .probe' events |
    sort | uniq -c | tr -s ' \n' ' ')($((SECONDS - t0)) s)"
  [[ $(jq -se 'map(select(.event == "progress")) | length' events) -ge 2 ]] ||
    fail "$*: fewer than 2 progress events: $(cat events)"
  [[ $(jq -se --arg w "$want" 'map(select(.event == "progress" and .probe != $w)) | length' events) == 0 ]] ||
    fail "$*: a progress event with a probe other than $want: $(grep progress events | head -n 3)"
  live_done "$*"
}

echo "case 1: bad values"
fresh_chain
# refused VALUE LINE: exit 2, LINE alone on stderr, the chain as it was.
refused() {
  fails_with 2 "$2" "$QCOMMIT" live "$dom" vda --pivot --socket "$dir/none.sock" --probe "$1"
  echo "  --probe $1: exit $rc: $(cat err.txt)"
  grep -qxF -- "$2" err.txt || fail "--probe $1: expected the line '$2'"
  vda_is "$dir/top.qcow2" || fail "--probe $1 changed the disk's chain"
}
refused bogus "qcommit live: --probe bogus: not auto, off or a period such as 50ms"
refused 5ms "qcommit live: --probe 5ms: probe period must be within [10ms, 10s]"

echo "case 2: auto (the default) on a local filesystem"
merge_with local
jq -se 'map(select(.event == "progress"))[0]["probe_off_reason"] |
  test("^probe=auto: .*/base.qcow2 is on (ext4|xfs|btrfs), which other hosts do not share$")' events >/dev/null ||
  fail "auto: the reason does not name the filesystem: $(grep progress events | head -n 1)"
echo "case 3: --probe 50ms"
merge_with on --probe 50ms
echo "case 4: --probe off"
merge_with disabled --probe off
echo "libvirt.live_probe: passed"
