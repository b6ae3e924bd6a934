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
