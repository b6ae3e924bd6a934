# SPDX-License-Identifier: GPL-2.0-or-later
# Shared pieces of the tests against a real libvirtd (source it).

# define_disk_domain NAME SOURCE_FILE [DIR]: defines (does not start) a minimal TCG domain whose
# vda is the qcow2 file SOURCE_FILE; the XML is left in DIR/dom.xml (default: the current dir).
define_disk_domain() {
  local name=$1 source=$2 dir=${3:-.}
  cat >"$dir/dom.xml" <<XML
<domain type='qemu'>
  <name>$name</name>
  <memory unit='MiB'>64</memory>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='$source'/>
      <target dev='vda' bus='virtio'/>
    </disk>
  </devices>
</domain>
XML
  virsh -q define "$dir/dom.xml" >/dev/null
}

# vda_source DOMAIN: the file DOMAIN's vda reads now (virsh domblklist).
vda_source() { virsh -q domblklist "$1" | awk '$1 == "vda" {print $2}'; }

# daemon_test_init TEST PREFIX: the set-up of a test with one domain and a qcommitd of its own:
# libvirtd reachable, DIR (/var/lib/libvirt/images/PREFIX-PID-RANDOM, the working directory from
# here on), DOM (its domain), fail() naming TEST and showing qcommitd's log tail, and a cleanup on
# exit that stops qcommitd, removes DOM and DIR.
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
  if ! host_libvirtd >/dev/null; then libvirtd -d; fi
  local i
  for ((i = 0; i < 100; i++)); do virsh -q list >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

# start_two_layer_domain SIZE BASE_DATA TOP_DATA: base.qcow2 of SIZE with BASE_DATA ("OFFSET
# LENGTH", pattern 1) <- top.qcow2 with TOP_DATA (pattern 2), in $dir; the guest's view in
# view-before.raw; the domain $dom defined on top.qcow2 and started.
start_two_layer_domain() {
  qemu-img create -q -f qcow2 base.qcow2 "$1"
  qemu-io -c "write -P 1 $2" base.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b "$dir/base.qcow2" -F qcow2 top.qcow2
  qemu-io -c "write -P 2 $3" top.qcow2 >/dev/null
  qemu-img convert -O raw top.qcow2 view-before.raw
  define_disk_domain "$dom" "$dir/top.qcow2" "$dir"
  virsh -q start "$dom" >/dev/null
}

daemon_test_init() {
  virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
  TEST_NAME=$1
  local tag=$2-$$-$RANDOM
  dir=/var/lib/libvirt/images/$tag
  dom=$tag-dom
  dpid=
  trap daemon_test_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
  mkdir -p "$dir"
  cd "$dir"
}
daemon_test_cleanup() {
  [[ -n $dpid ]] && kill "$dpid" 2>/dev/null
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
  virsh -q undefine "$dom" >/dev/null 2>&1 || true
  wait 2>/dev/null || true
  rm -rf "$dir"
}
fail() { echo "$TEST_NAME: $*" >&2; [[ -f $dir/d.log ]] && tail -n 20 "$dir/d.log" >&2; exit 1; }

# start_test_qcommitd CONFIG_TEXT: qcommitd ($QCOMMITD) with that policy on socket DIR/d.sock,
# log DIR/d.log; sets dpid.
start_test_qcommitd() {
  printf '%b' "$1" >qcommitd.conf
  "$QCOMMITD" --config qcommitd.conf --socket "$dir/d.sock" >d.log 2>&1 &
  dpid=$!
  local i
  for ((i = 0; i < 100; i++)); do [[ -S $dir/d.sock ]] && break; sleep 0.05; done
  [[ -S $dir/d.sock ]] || fail "qcommitd did not start"
}

# scenario_test_init PREFIX: the set-up of a test whose scenarios each define a domain of their
# own: libvirtd reachable, TAG (PREFIX-PID-RANDOM), ROOT (/var/lib/libvirt/images/TAG), DOMS (the
# domains to remove: add each as it is defined), FAILS and fail() naming the scenario ($scen),
# and a cleanup on exit that runs scenario_cleanup_hook first when the test defines one (its own
# processes), then removes DOMS (with their snapshot metadata) and ROOT.
scenario_test_init() {
  virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
  tag=$1-$$-$RANDOM
  root=/var/lib/libvirt/images/$tag
  doms=()
  fails=()
  trap scenario_test_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
  mkdir -p "$root"
  fail() { echo "FAIL [$scen]: $*" >&2; fails+=("$scen: $*"); }
}
scenario_test_cleanup() {
  if declare -F scenario_cleanup_hook >/dev/null; then scenario_cleanup_hook || true; fi
  local d
  for d in "${doms[@]}"; do
    virsh -q destroy "$d" >/dev/null 2>&1 || true
    virsh -q undefine "$d" --snapshots-metadata >/dev/null 2>&1 || true
  done
  rm -rf "$root"
}
