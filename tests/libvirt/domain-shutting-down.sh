#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.domain_shutting_down: `qcommit merge --domain DOM --disk vda` on a domain that is
# shutting down, against a real libvirtd and QEMU. libvirt says "in shutdown" from QEMU's SHUTDOWN
# event until the QEMU process is gone; the merge waits for shut off (bounded by --wait) instead of
# refusing, and says once what it waits for. A domain that is simply running is refused at once.
# The guest's QEMU is made to take about SLOW seconds to go: strace delays each close(2) of QEMU
# by SLOW/8 seconds (QEMU closes about 8 files, its images among them, between reporting SHUTDOWN
# and closing its monitor). The test writes into the running guest's disk (HMP qemu-io), sends
# QEMU SIGTERM (as a host shutting down does) and sees libvirt say "in shutdown" before the merge.
# Scenarios:
#   wait        default --wait (10 s): one line on stderr naming the domain, the merge succeeds
#               after shut off; merged BASE equals the guest view (qemu-img compare), including
#               what the guest wrote last; the definition is on BASE.
#   wait-json   the same with --output=json: one {"event":"wait"} event naming the domain, with
#               "for": "domain-shutdown", "domain" and "timeout-s" (10).
#   timeout     --wait 1s while shutting down takes longer: exit 1 in about a second, one error
#               line naming the domain, nothing written (BASE unchanged, TOP still the disk).
#   running     a running domain (no shutdown): refused at once (well under --wait) as before.
# usage: domain-shutting-down.sh QCOMMIT [SCENARIO...]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
shift
(($#)) || set -- wait wait-json timeout running
command -v strace >/dev/null || { echo "strace is needed to slow down QEMU's exit" >&2; exit 1; }
SLOW=${SLOW:-2}
tracer=
on_exit '[[ -z $tracer ]] || kill "$tracer" 2>/dev/null'
scenario_init libvirt.domain_shutting_down qcd
now_ms() { date +%s%3N; }
in_state() { [[ $(virsh domstate "$dom" 2>/dev/null) == "$1" ]]; }
attached() { grep -q attached strace.txt 2>/dev/null; }

# prepare: $dir/base.qcow2 <- top.qcow2 with data in both, domain $dom on top.qcow2 (shut off);
# view.raw is the guest view, base0.raw BASE as it is.
prepare() {
  scenario_dir
  layers 64M base.qcow2='write -P 1 0 8M' top.qcow2='write -P 2 1M 2M;write -z 6M 1M;write -P 3 20M 4M'
  qemu-img convert -O raw top.qcow2 view.raw
  qemu-img convert -O raw base.qcow2 base0.raw
  define_disk_domain "$dom" "$dir/top.qcow2"
}

# start_slow_shutdown: starts the domain, writes into its disk through QEMU (also into view.raw),
# makes QEMU's exit take about SLOW seconds, sends QEMU SIGTERM and waits until libvirt says "in
# shutdown". Returns 1 (after fail) when libvirt never said so.
start_slow_shutdown() {
  virsh -q start "$dom" >/dev/null
  local q
  q=$(cat "/run/libvirt/qemu/$dom.pid" 2>/dev/null || true)
  [[ -n $q ]] || { fail "no QEMU pid for $dom"; return 1; }
  virsh -q qemu-monitor-command --hmp "$dom" \
    'qemu-io -d /machine/peripheral/virtio-disk0/virtio-backend "write -P 9 40M 64k"' >hmp.txt 2>&1 &&
    ! grep -qi error hmp.txt || { fail "HMP qemu-io write failed: $(cat hmp.txt)"; return 1; }
  qio -f raw view.raw 'write -P 9 40M 64k'
  strace -f -p "$q" -o /dev/null -e trace=close -e inject=close:delay_enter=$((SLOW * 1000000 / 8)) \
    2>strace.txt &
  tracer=$!
  wait_until 5 attached || { fail "strace did not attach to QEMU: $(cat strace.txt)"; return 1; }
  kill -TERM "$q"
  wait_until 5 in_state "in shutdown" && return 0
  fail "libvirt never said 'in shutdown' (state: $(virsh domstate "$dom" 2>&1))"
  return 1
}

# Waits for the domain to be shut off and the tracer to be gone.
settle() {
  wait_until 30 in_state "shut off" || true
  [[ -z $tracer ]] || wait "$tracer" 2>/dev/null || true
  tracer=
}

# The merge succeeded after the domain shut off: data, images and definition.
check_merged() {
  [[ $state == "shut off" ]] || fail "domain is '$state' after the merge"
  vda_is "$dir/base.qcow2" || fail "disk source after the merge is '$(vda_source "$dom")'"
  view_kept view.raw base.qcow2
  qemu-img check -q base.qcow2 || fail "base.qcow2 is not clean"
}

for scen; do
  prepare
  args=()
  case $scen in
    wait) start_slow_shutdown || { settle; continue; } ;;
    wait-json) args=(--output=json); start_slow_shutdown || { settle; continue; } ;;
    timeout) args=(--wait 1s); SLOW=$((SLOW + 2)) start_slow_shutdown || { settle; continue; } ;;
    running) virsh -q start "$dom" >/dev/null ;;
    *) fail "unknown scenario"; continue ;;
  esac
  t0=$(now_ms) rc=0
  "$QCOMMIT" merge --domain "$dom" --disk vda --budget off "${args[@]}" >out.txt 2>err.txt || rc=$?
  ms=$(($(now_ms) - t0))
  state=$(virsh domstate "$dom" 2>&1)
  [[ $scen != running ]] || virsh -q destroy "$dom" >/dev/null 2>&1 || true
  settle
  case $scen in
    wait)
      [[ $rc == 0 ]] || { fail "merge failed (rc=$rc after ${ms} ms): $(cat err.txt)"; continue; }
      n=$(grep -c "waiting up to 10 s for domain $dom to shut off" err.txt || true)
      [[ $n == 1 ]] || fail "expected one wait line naming the domain on stderr, got $n: $(cat err.txt)"
      ((ms >= 500)) || fail "the merge took ${ms} ms: it did not wait for the shutdown"
      check_merged
      echo "  wait: merged after waiting, ${ms} ms" >&2
      ;;
    wait-json)
      [[ $rc == 0 ]] || { fail "merge failed (rc=$rc): $(cat err.txt)"; continue; }
      n=$(jq -c 'select(.event == "wait")' out.txt | grep -c "for domain $dom to shut off" || true)
      [[ $n == 1 ]] || fail "expected one JSON wait event naming the domain, got $n: $(cat out.txt)"
      jq -se --arg dom "$dom" 'map(select(.event == "wait")) | length == 1 and (.[0] |
        .for == "domain-shutdown" and .domain == $dom and .["timeout-s"] == 10)' out.txt >/dev/null ||
        fail "the wait event does not say what it waits for (domain-shutdown, $dom, 10 s): $(jq -c 'select(.event == "wait")' out.txt)"
      [[ ! -s err.txt ]] || fail "stderr not empty with --output=json: $(cat err.txt)"
      [[ $(jq -r 'select(.event == "result") | .base' out.txt) == "$dir/base.qcow2" ]] ||
        fail "no result event for base.qcow2: $(cat out.txt)"
      check_merged
      ;;
    timeout)
      [[ $rc == 1 ]] || fail "expected exit 1 at the deadline, got $rc: $(cat err.txt)"
      [[ $state == "in shutdown" ]] || fail "the domain was '$state' when the merge gave up (test too slow?)"
      ((ms >= 900 && ms < 4000)) || fail "gave up after ${ms} ms, expected about 1 s"
      errors=$(grep -v '^qcommit: waiting up to' err.txt || true)
      [[ $(printf '%s\n' "$errors" | grep -c .) == 1 && $errors == *"domain $dom"*"shutting down"* ]] ||
        fail "expected one error line naming the domain, got: $(cat err.txt)"
      vda_is "$dir/top.qcow2" || fail "definition changed: disk on '$(vda_source "$dom")'"
      same_view base0.raw base.qcow2 || fail "BASE was written"
      [[ -e top.qcow2 ]] || fail "TOP is gone"
      echo "  timeout: gave up after ${ms} ms: $errors" >&2
      ;;
    running)
      [[ $rc == 1 ]] && grep -q "domain $dom: is running; merge its disks live with 'qcommit live" err.txt ||
        fail "running domain not refused clearly: rc=$rc $(cat err.txt)"
      ((ms < 3000)) || fail "refusing a running domain took ${ms} ms (it was waited for)"
      grep -q "waiting" err.txt && fail "a running domain was waited for: $(cat err.txt)"
      ;;
  esac
done
finish "libvirt.domain_shutting_down: OK"
