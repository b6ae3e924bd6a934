#!/usr/bin/env bash
# cli.doctor_iothreads: qcommit doctor names each disk that no iothread serves (it shares QEMU's
# main loop with the block jobs), by domain and target, also in a domain that has <iothreads>; a
# disk with its own iothread, or on a virtio-scsi controller with one, is said to have it.
# Definitions read through libvirt's test driver (test:///FILE), no libvirtd needed.
# usage: doctor-iothreads.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-doctor.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "cli.doctor_iothreads: $*" >&2; exit 1; }

disk() {  # disk TARGET BUS [DRIVER_ATTRS]
  cat <<XML
      <disk type='file' device='disk'>
        <driver name='qemu' type='qcow2' cache='none' io='native' ${3:-}/>
        <source file='$work/$1.qcow2'/>
        <target dev='$1' bus='$2'/>
      </disk>
XML
}
cat >node.xml <<XML
<node>
  <domain type='test'>
    <name>io one</name>
    <memory>65536</memory>
    <iothreads>2</iothreads>
    <os><type>hvm</type></os>
    <devices>
$(disk vda virtio "iothread='1'")
$(disk vdb virtio)
$(disk sda scsi)
      <controller type='scsi' index='0' model='virtio-scsi'><driver iothread='2'/></controller>
    </devices>
  </domain>
  <domain type='test'>
    <name>io none</name>
    <memory>65536</memory>
    <os><type>hvm</type></os>
    <devices>
$(disk vda virtio)
    </devices>
  </domain>
</node>
XML

"$QCOMMIT" doctor --uri "test://$work/node.xml" --socket "$work/none.sock" --output=json >doctor.json
# finding SUBJECT: the finding lines doctor gives for SUBJECT, as "LEVEL FINDING | REASON".
finding() { jq -r --arg s "$1" '.findings[] | select(.subject == $s) | "\(.level) \(.finding) | \(.reason)"' doctor.json; }
main_loop() {  # main_loop DOMAIN DISK REASON
  finding "domain $1 disk $2" | grep -q "^info no iothread: the disk shares QEMU's main loop | $3" ||
    fail "$1 $2: no main-loop finding with '$3': $(finding "domain $1 disk $2")"
}
own_iothread() {  # own_iothread DOMAIN DISK ID
  finding "domain $1 disk $2" | grep -q "^ok iothread $3 |" ||
    fail "$1 $2: iothread $3 not found: $(finding "domain $1 disk $2")"
  ! finding "domain $1 disk $2" | grep -q "shares QEMU's main loop" || fail "$1 $2: said to share the main loop"
}
main_loop "io one" vdb "the domain has <iothreads> but none serves this disk"
main_loop "io none" vda "the domain has no <iothreads>"
own_iothread "io one" vda 1
own_iothread "io one" sda 2
# No remark about iothreads for a domain as a whole: each one names its disk.
for d in "io one" "io none"; do
  [[ -z $(finding "domain $d") ]] || fail "domain-wide finding for $d: $(finding "domain $d")"
done
echo "cli.doctor_iothreads: OK"
