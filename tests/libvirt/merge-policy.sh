#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.merge_policy: the budget of `qcommit merge`/`qcommit plan` comes from qcommitd's
# configuration and libvirt, against a real libvirtd:
#  - a chain in a dir pool that qcommitd.conf names ([pool:NAME] budget=7ms, ceiling=16M) gets
#    7 ms "pool-policy" (plan and merge JSON, and the human line); the rate never exceeds the
#    pool's ceiling (trace); the same through --pool/--vol;
#  - --budget overrides (source "option"), the pool's ceiling still bounds the rate;
#  - a file outside every pool, on another filesystem than the pool, gets [default] (15 ms);
#  - a shut-off domain's <qcommit:policy budget="4ms"/> metadata wins for --domain, --budget
#    still beats it;
#  - libvirt unreachable through a URI named with --connect: an error naming it before anything
#    is written (merge and plan); with --cotenants off: [default], co-tenants "off".
# Every merge must keep the guest view (qemu-img compare) and leave clean images.
# usage: merge-policy.sh QCOMMIT
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
tag=qcp-$$-$RANDOM
dir=/var/lib/libvirt/images/$tag
other=$(mktemp -d /dev/shm/qcommit-policy.XXXXXX)  # tmpfs: another filesystem than the pool's
pool=$tag-pool
dom=$tag-dom
cleanup() {
  virsh -q undefine "$dom" >/dev/null 2>&1 || true
  virsh -q pool-destroy "$pool" >/dev/null 2>&1 || true
  virsh -q pool-undefine "$pool" >/dev/null 2>&1 || true
  rm -rf "$dir" "$other"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
mkdir -p "$dir"
cd "$other"
fails=()
fail() { echo "FAIL: $*" >&2; fails+=("$*"); }
kCeiling=$((16 << 20))

cat >"$dir/qcommitd.conf" <<EOF
[default]
budget=15ms
[pool:$pool]
budget=7ms
ceiling=16M
EOF
conf=$dir/qcommitd.conf
virsh -q pool-define-as "$pool" dir --target "$dir" >/dev/null
virsh -q pool-start "$pool" >/dev/null

# chain DIR NAME: NAME.base.qcow2 <- NAME.qcow2 with 24 MiB written into the top.
chain() {
  qemu-img create -q -f qcow2 "$1/$2.base.qcow2" 64M
  qemu-io -c 'write -P 1 0 8M' "$1/$2.base.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -b "$2.base.qcow2" -F qcow2 "$1/$2.qcow2"
  qemu-io -c 'write -P 2 4M 24M' "$1/$2.qcow2" >/dev/null
  qemu-img convert -O raw "$1/$2.qcow2" "$1/$2.view.raw"
}
# check_merged DIR NAME: BASE shows what TOP showed and is clean.
check_merged() {
  qemu-img compare -q "$1/$2.view.raw" "$1/$2.base.qcow2" || fail "$2: BASE differs from TOP's view"
  qemu-img check -q "$1/$2.base.qcow2" || fail "$2: BASE not clean"
}
# field FILE EVENT KEY: the value of KEY in the last JSON line of that event.
field() { jq -r "select(.event == \"$2\") | .\"$3\"" "$1" | tail -n1; }
# max_rate TRACE: the largest paced rate in a --trace CSV.
max_rate() { awk -F, '/^#/ {next} !h {h = 1; for (i = 1; i <= NF; i++) if ($i == "rate_bytes_per_s") c = i; next} $c > m {m = $c} END {printf "%.0f", m}' "$1"; }

# 1. Plan and merge of a chain in the pool: the pool's policy.
chain "$dir" a
virsh -q pool-refresh "$pool" >/dev/null
"$QCOMMIT" plan "$dir/a.qcow2" --config "$conf" --output=json >plan.json 2>plan.err || fail "plan failed: $(cat plan.err)"
[[ $(jq -r '."budget-ms"' plan.json) == 7 ]] || fail "plan budget-ms $(jq -r '."budget-ms"' plan.json), expected 7"
[[ $(jq -r '."budget-source"' plan.json) == pool-policy ]] || fail "plan budget-source $(jq -r '."budget-source"' plan.json)"
[[ $(jq -r '.pool' plan.json) == "$pool" ]] || fail "plan pool $(jq -r '.pool' plan.json)"
[[ $(jq -r '.ceiling' plan.json) == "$kCeiling" ]] || fail "plan ceiling $(jq -r '.ceiling' plan.json)"
"$QCOMMIT" plan "$dir/a.qcow2" --config "$conf" >plan.txt 2>&1 || fail "plan (human) failed"
grep -q "budget: *7 ms from pool policy \[pool:$pool\] in $conf" plan.txt || fail "plan does not say where 7 ms came from: $(grep budget plan.txt)"

"$QCOMMIT" merge "$dir/a.qcow2" --config "$conf" --output=json --trace a.csv >a.json 2>a.err || fail "merge a failed: $(cat a.err)"
[[ $(field a.json policy budget-ms) == 7 && $(field a.json policy budget-source) == pool-policy ]] ||
  fail "merge a policy: $(grep '"policy"' a.json)"
[[ $(field a.json result budget-ms) == 7 && $(field a.json result budget-source) == pool-policy ]] ||
  fail "merge a result: $(grep '"result"' a.json)"
[[ $(field a.json policy cotenants) == on ]] || fail "co-tenants not on with libvirt reachable: $(grep '"policy"' a.json)"
r=$(max_rate a.csv)
((r > 0 && r <= kCeiling)) || fail "merge a paced up to $r B/s, the pool's ceiling is $kCeiling"
check_merged "$dir" a

# 2. --budget wins; the rate stays within the pool's ceiling.  Human output names the source.
chain "$dir" b
"$QCOMMIT" merge "$dir/b.qcow2" --config "$conf" --budget 11ms --trace b.csv >b.txt 2>&1 || fail "merge b failed: $(cat b.txt)"
grep -q '^budget 11 ms from --budget; rate 1.0 MiB/s .. 16.0 MiB/s' b.txt || fail "merge b: $(head -n1 b.txt)"
r=$(max_rate b.csv)
((r > 0 && r <= kCeiling)) || fail "merge b paced up to $r B/s, the pool's ceiling is $kCeiling"
check_merged "$dir" b

# 3. Through the pool: --pool/--vol.
chain "$dir" c
virsh -q pool-refresh "$pool" >/dev/null
"$QCOMMIT" merge --pool "$pool" --vol c.qcow2 --config "$conf" --allow-backing-dir "$dir" --output=json >c.json 2>c.err ||
  fail "merge --pool failed: $(cat c.err)"
[[ $(field c.json result budget-ms) == 7 && $(field c.json result budget-source) == pool-policy ]] ||
  fail "merge --pool result: $(grep '"result"' c.json)"
check_merged "$dir" c

# 4. Outside every pool, on another filesystem: [default].
chain "$other" d
"$QCOMMIT" merge "$other/d.qcow2" --config "$conf" --output=json >d.json 2>d.err || fail "merge d failed: $(cat d.err)"
[[ $(field d.json result budget-ms) == 15 && $(field d.json result budget-source) == default-policy ]] ||
  fail "merge outside the pool: $(grep '"result"' d.json)"
[[ $(field d.json policy pool) == null ]] || fail "merge outside the pool names pool $(field d.json policy pool)"
check_merged "$other" d

# 5. A shut-off domain's metadata beats the pool; --budget beats the metadata.
chain "$dir" e
define_disk_domain "$dom" "$dir/e.qcow2"
virsh -q metadata "$dom" https://qcommit.dev/xmlns/1 --key qcommit --set '<policy budget="4ms"/>' --config >/dev/null
"$QCOMMIT" merge --domain "$dom" --disk vda --config "$conf" --output=json --trace e.csv >e.json 2>e.err ||
  fail "merge --domain failed: $(cat e.err)"
# The trace names TOP and BASE (qcommit report's header).
grep -qxF "# top=$dir/e.qcow2" e.csv || fail "merge --domain: the trace does not name TOP: $(grep '^#' e.csv)"
grep -qxF "# base=$dir/e.base.qcow2" e.csv || fail "merge --domain: the trace does not name BASE: $(grep '^#' e.csv)"
[[ $(field e.json result budget-ms) == 4 && $(field e.json result budget-source) == domain-metadata ]] ||
  fail "merge --domain result: $(grep '"result"' e.json)"
[[ $(field e.json policy ceiling) == "$kCeiling" ]] || fail "merge --domain: the pool's ceiling is lost: $(grep '"policy"' e.json)"
check_merged "$dir" e
src=$(vda_source "$dom")
[[ $src == "$dir/e.base.qcow2" ]] || fail "domain disk after merge is '$src'"
chain "$dir" f
virsh -q dumpxml --inactive "$dom" | sed "s|$dir/e.base.qcow2|$dir/f.qcow2|" >dom2.xml
virsh -q define dom2.xml >/dev/null
"$QCOMMIT" merge --domain "$dom" --disk vda --config "$conf" --budget 9ms --output=json >f.json 2>f.err || fail "merge --domain --budget failed: $(cat f.err)"
[[ $(field f.json result budget-ms) == 9 && $(field f.json result budget-source) == option ]] ||
  fail "merge --domain --budget result: $(grep '"result"' f.json)"
check_merged "$dir" f

# 6. libvirt unreachable through the URI the user named: an error naming it before anything is
#    written, merge and plan alike (co-tenant pacing is not turned off behind the user's back);
#    with --cotenants off the merge goes on: no pool known ([default]).
chain "$dir" g
unreachable='qemu+unix:///system?socket=/nonexistent.sock'
g_before=$(sha256sum "$dir/g.base.qcow2" "$dir/g.qcow2")
rc=0
"$QCOMMIT" merge "$dir/g.qcow2" --config "$conf" --connect "$unreachable" --output=json >g.json 2>g.err || rc=$?
[[ $rc == 1 && $(wc -l <g.err) == 1 ]] && grep -qF "nonexistent.sock" g.err ||
  fail "merge through an unreachable --connect: exit $rc, expected 1 naming the URI: $(cat g.err)"
[[ $(sha256sum "$dir/g.base.qcow2" "$dir/g.qcow2") == "$g_before" ]] || fail "refused merge through an unreachable --connect wrote"
rc=0
"$QCOMMIT" plan "$dir/g.qcow2" --config "$conf" --output=json --connect "$unreachable" >g2.json 2>g2.err || rc=$?
[[ $rc == 1 ]] && grep -qF "nonexistent.sock" g2.err || fail "plan through an unreachable --connect: exit $rc: $(cat g2.err)"
"$QCOMMIT" merge "$dir/g.qcow2" --config "$conf" --connect "$unreachable" --cotenants off \
  --output=json >g.json 2>g.err || fail "merge --cotenants off without libvirt failed: $(cat g.err)"
[[ $(field g.json result budget-source) == default-policy && $(field g.json policy cotenants) == off ]] ||
  fail "merge --cotenants off without libvirt: $(grep -E '"(policy|result)"' g.json)"
check_merged "$dir" g
chain "$dir" h
"$QCOMMIT" merge "$dir/h.qcow2" --config "$conf" --cotenants off --output=json >h.json 2>h.err || fail "merge --cotenants off failed"
[[ $(field h.json policy cotenants) == off && $(field h.json result budget-ms) == 7 ]] || fail "--cotenants off: $(grep '"policy"' h.json)"
check_merged "$dir" h

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.merge_policy: OK"
