#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.doctor_iothreads: qcommit doctor names each disk that no iothread serves (it shares QEMU's
# main loop with the block jobs), by domain and target, also in a domain that has <iothreads>; a
# disk with its own iothread, or on a virtio-scsi controller with one, is said to have it.
# Definitions read through libvirt's test driver (test:///FILE), no libvirtd needed.
# usage: doctor-iothreads.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.doctor_iothreads

disk() {  # disk TARGET BUS [DRIVER_ATTRS]
  file_disk "$1" "$2" "$work/$1.qcow2" "" "cache='none' io='native' ${3:-}"
}
cat >node.xml <<XML
<node>
$(test_domain "io one" "    <iothreads>2</iothreads>
    <devices>
$(disk vda virtio "iothread='1'")
$(disk vdb virtio)
$(disk sda scsi)
      <controller type='scsi' index='0' model='virtio-scsi'><driver iothread='2'/></controller>
    </devices>")
$(test_domain "io none" "    <devices>$(disk vda virtio)</devices>")
</node>
XML

"$QCOMMIT" doctor --uri "test://$work/node.xml" --socket "$work/none.sock" --output=json >doctor.json
main_loop() {  # main_loop DOMAIN DISK REASON
  expect_finding doctor.json "domain $1 disk $2" "info no iothread: the disk shares QEMU's main loop | $3"
}
own_iothread() {  # own_iothread DOMAIN DISK ID
  expect_finding doctor.json "domain $1 disk $2" "ok iothread $3 |"
  no_finding doctor.json "domain $1 disk $2" "shares QEMU's main loop"
}
main_loop "io one" vdb "the domain has <iothreads> but none serves this disk"
main_loop "io none" vda "the domain has no <iothreads>"
own_iothread "io one" vda 1
own_iothread "io one" sda 2
# No remark about iothreads for a domain as a whole: each one names its disk.
for d in "io one" "io none"; do
  [[ -z $(findings doctor.json "domain $d") ]] || fail "domain-wide finding for $d: $(findings doctor.json "domain $d")"
done
echo "cli.doctor_iothreads: OK"
