# SPDX-License-Identifier: GPL-2.0-or-later
# What the tests against a real libvirtd share beyond tests/lib/test.sh, which it sources; sourced
# (`. "$(dirname "$0")/lib.sh"`) after `set -euo pipefail`, the binaries' paths made absolute.
. "$(dirname "${BASH_SOURCE[0]}")/../lib/test.sh"

# A failure also shows the tail of qcommitd's log, when the test started one (start_test_qcommitd).
fail_context() { [[ ! -f ${dir:-}/d.log ]] || tail -n 20 "$dir/d.log"; }
skip() { echo "SKIP: $*"; exit 77; }  # skip REASON: ctest's SKIP, saying why
virsh_up() { virsh -q list >/dev/null 2>&1; }

# lv_setup NAME PREFIX [PARENT]: libvirtd reachable (else exit 1), then `setup NAME` with $work
# (also $dir) in PARENT, by default /var/lib/libvirt/images where libvirt's QEMU may open files;
# $tag (PREFIX and $work's random part) names the test's domains and pools, $dom = $tag-dom. At
# exit the domains in lv_doms (define_disk_domain adds them) are removed, then the pools in
# lv_pools (dir_pool adds them).
lv_doms=() lv_pools=()
lv_setup() {
  virsh_up || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
  TMPDIR=${3:-/var/lib/libvirt/images} setup "$1"
  chmod 755 "$work"  # libvirt's QEMU may run as another user
  dir=$work tag=$2-${work##*.}
  dom=$tag-dom
  on_exit lv_cleanup
}
lv_cleanup() {
  local d
  for d in "${lv_doms[@]}"; do virsh -q destroy "$d"; virsh -q undefine "$d" --snapshots-metadata; done >/dev/null 2>&1
  for d in "${lv_pools[@]}"; do virsh -q pool-destroy "$d"; virsh -q pool-undefine "$d"; done >/dev/null 2>&1
}
# scenario_init NAME PREFIX: lv_setup for a test whose scenarios ($scen) each have a directory
# and a domain of their own (scenario_dir: $dir = $root/$scen, the current directory from then
# on, $dom = $tag-$scen); from here on `fail` names the scenario and the test goes on (soft_fail).
scenario_init() {
  lv_setup "$1" "$2"
  root=$work
  fail() { soft_fail "[$scen] $*"; }
}
scenario_dir() {
  dir=$root/$scen dom=$tag-$scen
  mkdir -p "$dir"
  cd "$dir"
}

# dir_pool NAME TARGET: a started `dir` pool, removed at exit.
dir_pool() {
  virsh -q pool-define-as "$1" dir --target "$2" >/dev/null
  lv_pools+=("$1")
  virsh -q pool-start "$1" >/dev/null
}
# define_disk_domain NAME SOURCE_FILE...: defines (does not start) a minimal TCG domain whose
# disks vda, vdb, ... are the qcow2 files SOURCE_FILE..., removed at exit.
define_disk_domain() {
  local name=$1 disks='' f n=0 letter=({a..z})
  shift
  for f; do
    disks+="<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='$f'/>"
    disks+="<target dev='vd${letter[n++]}' bus='virtio'/></disk>"
  done
  [[ " ${lv_doms[*]} " == *" $name "* ]] || lv_doms+=("$name")
  virsh -q define /dev/stdin >/dev/null <<XML
<domain type='qemu'>
  <name>$name</name>
  <memory unit='MiB'>64</memory>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <devices>$disks</devices>
</domain>
XML
}
# start_domain SIZE LAYER...: the chain `layers SIZE LAYER...` in $dir, the guest's view of its
# top in view-before.raw, $dom defined on that top and started.
start_domain() {
  layers "$@"
  local top=${!#}
  top=${top%%=*}
  qemu-img convert -O raw "$top" view-before.raw
  define_disk_domain "$dom" "$dir/${top##*/}"
  virsh -q start "$dom" >/dev/null
}
# snapshot_chain SIZE: $dir/base.qcow2 of SIZE (8 MiB of pattern 1), $dom defined on it and
# started, three disk-only snapshots s1, s2, s3 taken: $dom runs on base.s3 <- s2 <- s1 <- qcow2.
snapshot_chain() {
  layers "$1" "$dir/base.qcow2=write -P 1 0 8M"
  define_disk_domain "$dom" "$dir/base.qcow2"
  virsh -q start "$dom" >/dev/null
  local s
  for s in s1 s2 s3; do virsh -q snapshot-create-as "$dom" "$s" --disk-only --atomic >/dev/null; done
}

# vda_source DOMAIN: the file DOMAIN's vda reads now (virsh domblklist); vda_is FILE: $dom's
# vda reads FILE.
vda_source() { virsh -q domblklist "$1" | awk '$1 == "vda" {print $2}'; }
vda_is() { [[ $(vda_source "$dom") == "$1" ]]; }
# vda_xml [DUMPXML-ARGS...]: $dom's vda as `virsh dumpxml ARGS` shows it, in one line: the disk's
# type, then from the disk down its <backingStore> chain each image as FORMAT:file=PATH (or
# dev=PATH), and "end" when the chain ends in an empty <backingStore/>.
vda_xml() {
  virsh dumpxml "$@" "$dom" | python3 -c '
import sys, xml.etree.ElementTree as ET
disk = next(d for d in ET.parse(sys.stdin).getroot().iter("disk")
            if d.find("target") is not None and d.find("target").get("dev") == "vda")
out, n = [disk.get("type")], disk
while n is not None and n.find("source") is not None:
    fmt, src = n.find("format" if n.tag == "backingStore" else "driver"), n.find("source")
    key = "file" if src.get("file") else "dev"
    out.append("%s:%s=%s" % (fmt.get("type") if fmt is not None else "?", key, src.get(key)))
    n = n.find("backingStore")
print(" ".join(out + (["end"] if n is not None and len(n) == 0 else [])))'
}
# no_journal: $dom's definition holds no merge journal.
no_journal() { ! virsh -q metadata "$dom" urn:qcommit:domain-merge --config >/dev/null 2>&1; }
# no_blockjob: no block job runs on $dom's vda; job_bandwidth: its job's speed in bytes/s, or "".
no_blockjob() { ! virsh -q blockjob "$dom" vda --info 2>/dev/null | grep -q .; }
job_bandwidth() { virsh -q blockjob "$dom" vda --info --bytes 2>/dev/null | sed -n 's/.*Bandwidth limit: \([0-9]*\).*/\1/p'; }
# alloc_refreshed POOL VOL: soft_fail unless libvirt's allocation of VOL is that of the file VOL
# (in the current directory).
alloc_refreshed() {
  local a f
  a=$(virsh vol-info --pool "$1" "$2" --bytes | awk '/Allocation/{print $2}')
  f=$(($(stat -c '%b * %B' "$2")))
  [[ $a == "$f" ]] || soft_fail "vol-info allocation of $2 $a != the file's $f: pool not refreshed"
}

# view_kept VIEW IMG [LABEL]: fails unless IMG shows what the raw VIEW does.
view_kept() { same_view "$1" "$2" || fail "${3:+$3: }${2##*/} differs from the guest's view"; }
# live_done [LABEL]: what `qcommit live --pivot --output=json >events` must leave: a result "done",
# vda on $dir/base.qcow2 and, the domain destroyed, base.qcow2 clean with the guest's view
# (view-before.raw). LABEL prefixes the failures.
live_done() {
  local l=${1:+$1: }
  [[ $(jq -se 'map(select(.event == "result"))[0].outcome' events) == '"done"' ]] || fail "${l}no result 'done': $(cat events)"
  vda_is "$dir/base.qcow2" || fail "${l}vda is on '$(vda_source "$dom")', not base.qcow2, after the pivot"
  virsh -q destroy "$dom" >/dev/null
  view_kept view-before.raw base.qcow2 "${1:-}"
  qemu-img check -q base.qcow2 || fail "${l}base.qcow2 is not clean"
}

# This host's libvirtd (for tests that stop and start it): the one its pid file names, whose
# root is / (another libvirtd may run in a chroot, scripts/trixie-platform's: never touched).
host_libvirtd() {
  local pid
  pid=$(cat /run/libvirtd.pid 2>/dev/null) || return 1
  [[ -n $pid && $(readlink "/proc/$pid/root" 2>/dev/null) == / ]] &&
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == libvirtd ]] && echo "$pid"
}
# Starts this host's libvirtd unless it runs, and waits until it answers (false after 10 s).
ensure_libvirtd() {
  host_libvirtd >/dev/null || libvirtd -d
  wait_until 10 virsh_up
}
# stop_libvirtd: SIGTERM to this host's libvirtd (QEMU and its jobs run on); false unless it is
# gone within 10 s.
stop_libvirtd() {
  local lv
  lv=$(host_libvirtd) && [[ -n $lv ]] || return 1
  kill -TERM "$lv" && wait_until 10 gone "$lv"
}
# restart_test_init NAME PREFIX: lv_setup for a test that stops this host's libvirtd: skipped (77)
# unless it runs as a daemon of its own; libvirtd left running at exit whatever happens.
restart_test_init() {
  host_libvirtd >/dev/null || { echo "libvirtd is not running as a daemon of its own (libvirtd -d); skipped" >&2; exit 77; }
  on_exit 'ensure_libvirtd || true'
  lv_setup "$1" "$2"
}

# start_test_qcommitd CONFIG_TEXT: qcommitd ($QCOMMITD) with that policy (printf %b) on socket
# $dir/d.sock, log $dir/d.log; sets dpid. qstatus ARGS...: `qcommit status` of that qcommitd.
start_test_qcommitd() {
  printf '%b' "$1" >qcommitd.conf
  spawn "$QCOMMITD" --config qcommitd.conf --socket "$dir/d.sock" >d.log 2>&1
  dpid=$!
  wait_until 5 test -S "$dir/d.sock" || fail "qcommitd did not start"
}
qstatus() { "$QCOMMIT" status --socket "$dir/d.sock" "$@"; }
