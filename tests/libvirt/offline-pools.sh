#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# libvirt.offline_fs_pool / libvirt.offline_netfs_pool: offline merges of volumes in libvirt `fs`
# and `netfs` pools, against a real libvirtd.
#   fs:    a sparse file formatted ext4 on a loop device is the pool's source device; pool-start
#          makes libvirt mount it on the target directory.
#   netfs: the lab's FUSE storage (qcommit-slowfs) is mounted on the target directory with the
#          mount source "lab:/export/TAG" (--fsname). libvirt's netfs backend takes a target that
#          /proc/mounts already shows mounted from "HOST:DIR" as started and runs no mount(8)
#          (storage_backend_fs.c, virStorageBackendFileSystemIsMounted compares mnt_dir with the
#          target path and mnt_fsname with "HOST:DIR"). There is no NFS server: were libvirt to
#          try `mount -t nfs lab:/export/TAG`, pool-start would fail (host "lab" does not exist).
# In both, a chain base.qcow2 <- s1.qcow2 <- s2.qcow2 with a pattern in each layer, then
#   1. qcommit merge --pool POOL --vol s1.qcow2: base == s1's old view, s2's view unchanged,
#      images clean, the pool refreshed (pool-info Available moved to the file system's free
#      space; vol-info allocation of base.qcow2 = the file's);
#   2. qcommit merge --domain DOM --disk vda --delete on a shut-off domain on s2.qcow2 (the active
#      layer into s1.qcow2): s1 == s2's old view (a qemu-img convert copy), domblklist and the
#      inactive dumpxml name s1.qcow2 <- base.qcow2, s2.qcow2 is gone and vol-list (libvirt's
#      cached volume list: stale without a pool refresh) lists exactly the pool directory's
#      entries; the domain starts on the merged chain.
# Then pool-destroy unmounts the target.
# Exits 77 (ctest SKIP) with the reason when the machine cannot (not root, no loop devices, no
# ext4 in the kernel, no /dev/fuse). Cleans up domain, pool, mount, loop device and files on exit.
# usage: offline-pools.sh QCOMMIT fs
#        offline-pools.sh QCOMMIT netfs SLOWFS
set -euo pipefail
source "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
mode=$2
SLOWFS=${3:-}
kSkip=77
skip() { echo "SKIP: $*"; exit "$kSkip"; }
virsh -q list >/dev/null 2>&1 || { echo "libvirtd is not reachable (start it: virtlogd -d; libvirtd -d)" >&2; exit 1; }
[[ $(id -u) == 0 ]] || skip "needs root (losetup, mount)"
case $mode in
  fs)
    [[ -e /dev/loop-control ]] || skip "no /dev/loop-control: this machine cannot create loop devices"
    grep -qw ext4 /proc/filesystems || modprobe ext4 2>/dev/null || true
    grep -qw ext4 /proc/filesystems || skip "the kernel has no ext4 (/proc/filesystems)"
    command -v mkfs.ext4 >/dev/null || skip "mkfs.ext4 is not installed (e2fsprogs)"
    ;;
  netfs)
    [[ -x $SLOWFS ]] || { echo "usage: offline-pools.sh QCOMMIT netfs SLOWFS (qcommit-slowfs binary)" >&2; exit 2; }
    [[ -c /dev/fuse ]] || skip "no /dev/fuse: this machine cannot mount FUSE filesystems"
    ;;
  *) echo "usage: offline-pools.sh QCOMMIT fs|netfs [SLOWFS]" >&2; exit 2 ;;
esac

tag=qpool-$$-$RANDOM
work=/var/tmp/$tag                      # views, the ext4 image, slowfs' backing dir and logs
dir=/var/lib/libvirt/images/$tag        # the pool's target directory
pool=$tag-$mode
dom=$tag-dom
export_dir=/export/$tag
loop=
slowfs_pid=
cleanup() {
  set +e
  virsh -q destroy "$dom" >/dev/null 2>&1
  virsh -q undefine "$dom" --snapshots-metadata >/dev/null 2>&1
  virsh -q pool-destroy "$pool" >/dev/null 2>&1   # umounts the target (both modes)
  virsh -q pool-undefine "$pool" >/dev/null 2>&1
  if [[ -n $slowfs_pid ]]; then
    mountpoint -q "$dir" && { fusermount3 -u "$dir" 2>/dev/null || umount -l "$dir"; }
    local i
    for i in $(seq 50); do kill -0 "$slowfs_pid" 2>/dev/null || break; sleep 0.1; done
    kill "$slowfs_pid" 2>/dev/null && wait "$slowfs_pid" 2>/dev/null
  fi
  mountpoint -q "$dir" && umount -l "$dir"
  [[ -n $loop ]] && losetup -d "$loop"
  rmdir "$dir" 2>/dev/null || rm -rf "$dir"
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM  # Ctrl-C or kill: cleaned up by the EXIT trap too
fails=()
fail() { echo "FAIL: $*" >&2; fails+=("$*"); }
mkdir -p "$work" "$dir"

# --- The pool ----------------------------------------------------------------------------------
if [[ $mode == fs ]]; then
  truncate -s 256M "$work/fs.img"
  mkfs.ext4 -q -F "$work/fs.img"
  loop=$(losetup -f --show "$work/fs.img" 2>"$work/losetup.err") || skip "losetup refused: $(cat "$work/losetup.err")"
  cat >"$work/pool.xml" <<XML
<pool type='fs'>
  <name>$pool</name>
  <source><device path='$loop'/><format type='ext4'/></source>
  <target><path>$dir</path></target>
</pool>
XML
else
  mkdir -p "$work/backing"
  "$SLOWFS" --backing "$work/backing" --mount "$dir" --bandwidth 1G --fsname "lab:$export_dir" \
    --stats "$work/slowfs.stats" </dev/null >"$work/slowfs.err" 2>&1 &
  slowfs_pid=$!
  for i in $(seq 100); do
    grep -q " $dir fuse" /proc/mounts && break
    kill -0 "$slowfs_pid" 2>/dev/null || { echo "FAIL: qcommit-slowfs exited: $(cat "$work/slowfs.err")" >&2; exit 1; }
    sleep 0.1
  done
  grep -q "^lab:$export_dir $dir fuse.qcommit-slowfs " /proc/mounts ||
    { echo "FAIL: slowfs not mounted as lab:$export_dir on $dir: $(grep " $dir " /proc/mounts)" >&2; exit 1; }
  cat >"$work/pool.xml" <<XML
<pool type='netfs'>
  <name>$pool</name>
  <source><host name='lab'/><dir path='$export_dir'/><format type='nfs'/></source>
  <target><path>$dir</path></target>
</pool>
XML
fi
mounts_before=$(grep -c " $dir " /proc/mounts || true)
virsh -q pool-define "$work/pool.xml" >/dev/null
virsh -q pool-start "$pool" >"$work/start.out" 2>&1 ||
  { echo "FAIL: pool-start $pool ($mode): $(cat "$work/start.out")" >&2; exit 1; }
mnt=$(awk -v d="$dir" '$2==d{print $1, $3}' /proc/mounts)
if [[ $mode == fs ]]; then
  [[ $mnt == "$loop ext4" ]] || { echo "FAIL: pool-start did not mount $loop on $dir (mounts: '$mnt')" >&2; exit 1; }
else
  # Still the one FUSE mount: libvirt took it as the export and mounted nothing on top.
  [[ $mnt == "lab:$export_dir fuse.qcommit-slowfs" && $(grep -c " $dir " /proc/mounts) == "$mounts_before" ]] ||
    { echo "FAIL: libvirt mounted something on $dir: '$mnt'" >&2; exit 1; }
fi
echo "pool $pool ($mode) active on $dir: $mnt"

# --- The chain ---------------------------------------------------------------------------------
cd "$dir"
qemu-img create -q -f qcow2 base.qcow2 64M
qemu-img create -q -f qcow2 -b "$dir/base.qcow2" -F qcow2 s1.qcow2
qemu-img create -q -f qcow2 -b "$dir/s1.qcow2" -F qcow2 s2.qcow2
qemu-io -c 'write -P 1 0 8M' -c 'write -P 9 40M 1M' base.qcow2 >/dev/null
qemu-io -c 'write -P 2 1M 2M' -c 'write -z 40M 64k' -c 'write -P 5 50M 512k' s1.qcow2 >/dev/null
qemu-io -c 'write -P 3 2M 2M' -c 'write -z 6M 1M' -c 'write -P 4 63M 1M' s2.qcow2 >/dev/null
qemu-img convert -O raw s1.qcow2 "$work/view1.raw"
qemu-img convert -O raw s2.qcow2 "$work/view2.raw"
virsh -q pool-refresh "$pool" >/dev/null
# libvirt caches a pool's capacity figures from its last refresh (Available = statvfs f_bfree *
# f_frsize of the target); vol-info, by contrast, re-reads the volume on every call.
pool_avail() { virsh pool-info --bytes "$pool" | awk '/^Available/{print $2}'; }
fs_free() { stat -f -c '%f %S' "$dir" | awk '{printf "%.0f\n", $1 * $2}'; }
avail0=$(pool_avail)
alloc_of() { virsh vol-info --pool "$pool" "$1" --bytes | awk '/Allocation/{print $2}'; }
vol_list_matches_dir() {
  local vols files
  vols=$(virsh -q vol-list "$pool" | awk '{print $1}' | sort | xargs)
  files=$(find "$dir" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | xargs)
  [[ $vols == "$files" ]] || fail "$1: vol-list says '$vols', the directory holds '$files'"
}

# 1. A volume of the pool into its backing file.
t0=$(date +%s.%N)
"$QCOMMIT" merge --pool "$pool" --vol s1.qcow2 --budget off >"$work/out1.txt" 2>&1 ||
  fail "pool merge failed: $(cat "$work/out1.txt")"
t1=$(date +%s.%N)
sed 's/^/  qcommit: /' "$work/out1.txt"
qemu-img compare -q -f raw -F qcow2 "$work/view1.raw" base.qcow2 || fail "base.qcow2 differs from s1's view after the pool merge"
qemu-img compare -q -f raw -F qcow2 "$work/view2.raw" s2.qcow2 || fail "s2's view changed by the pool merge"
for f in base.qcow2 s1.qcow2 s2.qcow2; do qemu-img check -q "$f" || fail "$f not clean after the pool merge"; done
grep -q "refreshed storage pool $pool" "$work/out1.txt" || fail "pool $pool not refreshed: $(cat "$work/out1.txt")"
avail1=$(pool_avail) free1=$(fs_free)
[[ $avail1 != "$avail0" ]] || fail "pool-info Available still $avail0 after the pool merge: pool not refreshed"
if [[ $mode == fs ]]; then  # the ext4 is ours alone: the refreshed figure is the file system's now
  ((avail1 - free1 <= 1048576 && free1 - avail1 <= 1048576)) ||
    fail "pool-info Available $avail1, the file system has $free1 bytes free"
fi
echo "pool-info Available: $avail0 before the pool merge, $avail1 after (statvfs now $free1)"
a=$(alloc_of base.qcow2)
[[ $a == $(($(stat -c '%b * %B' base.qcow2))) ]] ||
  fail "vol-info allocation of base.qcow2 $a != the file's $(($(stat -c '%b * %B' base.qcow2)))"
vol_list_matches_dir "after the pool merge"

# 2. The shut-off domain's active layer into s1.qcow2; s2.qcow2 deleted.
define_disk_domain "$dom" "$dir/s2.qcow2" "$work"
td=$(date +%s.%N)
"$QCOMMIT" merge --domain "$dom" --disk vda --delete --budget off >"$work/out2.txt" 2>&1 ||
  fail "domain merge failed: $(cat "$work/out2.txt")"
t2=$(date +%s.%N)
sed 's/^/  qcommit: /' "$work/out2.txt"
qemu-img compare -q -f raw -F qcow2 "$work/view2.raw" s1.qcow2 || fail "s1.qcow2 differs from s2's old view after the domain merge"
for f in base.qcow2 s1.qcow2; do qemu-img check -q "$f" || fail "$f not clean after the domain merge"; done
[[ ! -e s2.qcow2 ]] || fail "s2.qcow2 still exists after merge --delete"
src=$(vda_source "$dom")
[[ $src == "$dir/s1.qcow2" ]] || fail "domblklist says vda is '$src', expected $dir/s1.qcow2"
virsh dumpxml --inactive "$dom" | python3 -c '
import sys, xml.etree.ElementTree as ET
d = sys.argv[1]
disk = next(x for x in ET.parse(sys.stdin).getroot().iter("disk") if x.find("target").get("dev") == "vda")
problems = []
want = [d + "/s1.qcow2", d + "/base.qcow2"]
node, got = disk, []
while node is not None and node.find("source") is not None:
    if node.find("format" if node.tag == "backingStore" else "driver").get("type") != "qcow2":
        problems.append("%s is not qcow2" % node.find("source").get("file"))
    got.append(node.find("source").get("file"))
    node = node.find("backingStore")
if got != want: problems.append("chain %s, expected %s" % (got, want))
if node is None or len(node) != 0: problems.append("the chain does not end in an empty <backingStore/>")
print("; ".join(problems))
sys.exit(1 if problems else 0)' "$dir" >"$work/xml.txt" || fail "definition after the domain merge: $(cat "$work/xml.txt")"
grep -q "refreshed storage pool $pool" "$work/out2.txt" || fail "pool $pool not refreshed by the domain merge: $(cat "$work/out2.txt")"
vol_list_matches_dir "after the domain merge"
a=$(alloc_of s1.qcow2)
[[ $a == $(($(stat -c '%b * %B' s1.qcow2))) ]] ||
  fail "vol-info allocation of s1.qcow2 $a != the file's $(($(stat -c '%b * %B' s1.qcow2)))"
left=$(find "$dir" -maxdepth 1 -name '*.qcommit-merge*' | xargs)
[[ -z $left ]] || fail "checkpoint files left behind: $left"
! virsh -q metadata "$dom" urn:qcommit:domain-merge --config >/dev/null 2>&1 || fail "merge journal left in the definition"
# libvirt runs the domain on the merged chain in the pool.
if virsh -q start "$dom" >"$work/dstart.err" 2>&1; then
  live=$(vda_source "$dom")
  [[ $live == "$dir/s1.qcow2" ]] || fail "the started domain runs vda on '$live'"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
else
  fail "domain does not start on the merged chain: $(cat "$work/dstart.err")"
fi
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$td" 'BEGIN{printf "merge times (with their qcommit start-up): pool %.2f s, domain %.2f s\n", b - a, c - d}' </dev/null

# pool-destroy unmounts the target (for netfs: the FUSE mount, which ends slowfs).
cd /
virsh -q pool-destroy "$pool" >"$work/destroy.out" 2>&1 || fail "pool-destroy: $(cat "$work/destroy.out")"
! mountpoint -q "$dir" || fail "$dir still mounted after pool-destroy"

if ((${#fails[@]})); then printf '  %s\n' "${fails[@]}" >&2; exit 1; fi
echo "libvirt.offline_${mode}_pool: OK"
