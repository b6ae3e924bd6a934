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
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
lv_setup libvirt.merge_policy qcp  # $dir: the pool's target
pool=$tag-pool
other=$(mktemp -d /dev/shm/qcommit-policy.XXXXXX)  # tmpfs: another filesystem than the pool's
on_exit 'rm -rf "$other"'
cd "$other"
kCeiling=$((16 << 20))
conf=$dir/qcommitd.conf
printf '[default]\nbudget=15ms\n[pool:%s]\nbudget=7ms\nceiling=16M\n' "$pool" >"$conf"
dir_pool "$pool" "$dir"

# chain DIR NAME: NAME.base.qcow2 <- NAME.qcow2 with 24 MiB written into the top.
chain() {
  (cd "$1" && layers 64M "$2.base.qcow2=write -P 1 0 8M" "$2.qcow2=write -P 2 4M 24M")
  qemu-img convert -O raw "$1/$2.qcow2" "$1/$2.view.raw"
}
# check_merged DIR NAME: BASE shows what TOP showed and is clean.
check_merged() {
  same_view "$1/$2.view.raw" "$1/$2.base.qcow2" || soft_fail "$2: BASE differs from TOP's view"
  qemu-img check -q "$1/$2.base.qcow2" || soft_fail "$2: BASE not clean"
}
# field FILE EVENT KEY: the value of KEY in the last JSON line of that event.
field() { jq -r "select(.event == \"$2\") | .\"$3\"" "$1" | tail -n1; }
# budget_is FILE EVENT MS SOURCE: that event says budget-ms MS, budget-source SOURCE.
budget_is() { [[ $(field "$1" "$2" budget-ms) == "$3" && $(field "$1" "$2" budget-source) == "$4" ]]; }
# max_rate TRACE: the largest paced rate in a --trace CSV.
max_rate() { awk -F, '/^#/ {next} !h {h = 1; for (i = 1; i <= NF; i++) if ($i == "rate_bytes_per_s") c = i; next} $c > m {m = $c} END {printf "%.0f", m}' "$1"; }
# within_ceiling NAME: merge NAME's trace paced above 0 and at most the pool's ceiling.
within_ceiling() {
  local r
  r=$(max_rate "$1.csv")
  ((r > 0 && r <= kCeiling)) || soft_fail "merge $1 paced up to $r B/s, the pool's ceiling is $kCeiling"
}

# 1. Plan and merge of a chain in the pool: the pool's policy.
chain "$dir" a
virsh -q pool-refresh "$pool" >/dev/null
"$QCOMMIT" plan "$dir/a.qcow2" --config "$conf" --output=json >plan.json 2>plan.err || soft_fail "plan failed: $(cat plan.err)"
for kv in budget-ms=7 budget-source=pool-policy pool="$pool" ceiling="$kCeiling"; do
  v=$(jq -r ".\"${kv%%=*}\"" plan.json)
  [[ $v == "${kv#*=}" ]] || soft_fail "plan ${kv%%=*} $v, expected ${kv#*=}"
done
"$QCOMMIT" plan "$dir/a.qcow2" --config "$conf" >plan.txt 2>&1 || soft_fail "plan (human) failed"
grep -q "budget: *7 ms from pool policy \[pool:$pool\] in $conf" plan.txt || soft_fail "plan does not say where 7 ms came from: $(grep budget plan.txt)"

"$QCOMMIT" merge "$dir/a.qcow2" --config "$conf" --output=json --trace a.csv >a.json 2>a.err || soft_fail "merge a failed: $(cat a.err)"
budget_is a.json policy 7 pool-policy || soft_fail "merge a policy: $(grep '"policy"' a.json)"
budget_is a.json result 7 pool-policy || soft_fail "merge a result: $(grep '"result"' a.json)"
[[ $(field a.json policy cotenants) == on ]] || soft_fail "co-tenants not on with libvirt reachable: $(grep '"policy"' a.json)"
within_ceiling a
check_merged "$dir" a

# 2. --budget wins; the rate stays within the pool's ceiling.  Human output names the source.
chain "$dir" b
"$QCOMMIT" merge "$dir/b.qcow2" --config "$conf" --budget 11ms --trace b.csv >b.txt 2>&1 || soft_fail "merge b failed: $(cat b.txt)"
grep -q '^budget 11 ms from --budget; rate 1.0 MiB/s .. 16.0 MiB/s' b.txt || soft_fail "merge b: $(head -n1 b.txt)"
within_ceiling b
check_merged "$dir" b

# 3. Through the pool: --pool/--vol.
chain "$dir" c
virsh -q pool-refresh "$pool" >/dev/null
"$QCOMMIT" merge --pool "$pool" --vol c.qcow2 --config "$conf" --allow-backing-dir "$dir" --output=json >c.json 2>c.err ||
  soft_fail "merge --pool failed: $(cat c.err)"
budget_is c.json result 7 pool-policy || soft_fail "merge --pool result: $(grep '"result"' c.json)"
check_merged "$dir" c

# 4. Outside every pool, on another filesystem: [default].
chain "$other" d
"$QCOMMIT" merge "$other/d.qcow2" --config "$conf" --output=json >d.json 2>d.err || soft_fail "merge d failed: $(cat d.err)"
budget_is d.json result 15 default-policy || soft_fail "merge outside the pool: $(grep '"result"' d.json)"
[[ $(field d.json policy pool) == null ]] || soft_fail "merge outside the pool names pool $(field d.json policy pool)"
check_merged "$other" d

# 5. A shut-off domain's metadata beats the pool; --budget beats the metadata.
chain "$dir" e
define_disk_domain "$dom" "$dir/e.qcow2"
virsh -q metadata "$dom" https://qcommit.dev/xmlns/1 --key qcommit --set '<policy budget="4ms"/>' --config >/dev/null
"$QCOMMIT" merge --domain "$dom" --disk vda --config "$conf" --output=json --trace e.csv >e.json 2>e.err ||
  soft_fail "merge --domain failed: $(cat e.err)"
# The trace names TOP and BASE (qcommit report's header).
grep -qxF "# top=$dir/e.qcow2" e.csv || soft_fail "merge --domain: the trace does not name TOP: $(grep '^#' e.csv)"
grep -qxF "# base=$dir/e.base.qcow2" e.csv || soft_fail "merge --domain: the trace does not name BASE: $(grep '^#' e.csv)"
budget_is e.json result 4 domain-metadata || soft_fail "merge --domain result: $(grep '"result"' e.json)"
[[ $(field e.json policy ceiling) == "$kCeiling" ]] || soft_fail "merge --domain: the pool's ceiling is lost: $(grep '"policy"' e.json)"
check_merged "$dir" e
vda_is "$dir/e.base.qcow2" || soft_fail "domain disk after merge is '$(vda_source "$dom")'"
chain "$dir" f
virsh -q dumpxml --inactive "$dom" | sed "s|$dir/e.base.qcow2|$dir/f.qcow2|" >dom2.xml
virsh -q define dom2.xml >/dev/null
"$QCOMMIT" merge --domain "$dom" --disk vda --config "$conf" --budget 9ms --output=json >f.json 2>f.err || soft_fail "merge --domain --budget failed: $(cat f.err)"
budget_is f.json result 9 option || soft_fail "merge --domain --budget result: $(grep '"result"' f.json)"
check_merged "$dir" f

# 6. libvirt unreachable through the URI the user named: an error naming it before anything is
#    written, merge and plan alike (co-tenant pacing is not turned off behind the user's back);
#    with --cotenants off the merge goes on: no pool known ([default]).
chain "$dir" g
unreachable='qemu+unix:///system?socket=/nonexistent.sock'
g_before=$(sha256sum "$dir/g.base.qcow2" "$dir/g.qcow2")
try "$QCOMMIT" merge "$dir/g.qcow2" --config "$conf" --connect "$unreachable" --output=json
[[ $rc == 1 && $(wc -l <err.txt) == 1 ]] && grep -qF "nonexistent.sock" err.txt ||
  soft_fail "merge through an unreachable --connect: exit $rc, expected 1 naming the URI: $(cat err.txt)"
[[ $(sha256sum "$dir/g.base.qcow2" "$dir/g.qcow2") == "$g_before" ]] || soft_fail "refused merge through an unreachable --connect wrote"
try "$QCOMMIT" plan "$dir/g.qcow2" --config "$conf" --output=json --connect "$unreachable"
[[ $rc == 1 ]] && grep -qF "nonexistent.sock" err.txt || soft_fail "plan through an unreachable --connect: exit $rc: $(cat err.txt)"
"$QCOMMIT" merge "$dir/g.qcow2" --config "$conf" --connect "$unreachable" --cotenants off \
  --output=json >g.json 2>g.err || soft_fail "merge --cotenants off without libvirt failed: $(cat g.err)"
[[ $(field g.json result budget-source) == default-policy && $(field g.json policy cotenants) == off ]] ||
  soft_fail "merge --cotenants off without libvirt: $(grep -E '"(policy|result)"' g.json)"
check_merged "$dir" g
chain "$dir" h
"$QCOMMIT" merge "$dir/h.qcow2" --config "$conf" --cotenants off --output=json >h.json 2>h.err || soft_fail "merge --cotenants off failed"
[[ $(field h.json policy cotenants) == off && $(field h.json result budget-ms) == 7 ]] || soft_fail "--cotenants off: $(grep '"policy"' h.json)"
check_merged "$dir" h
finish "libvirt.merge_policy: OK"
