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
# ext4 in the kernel, no /dev/fuse).
# usage: offline-pools.sh QCOMMIT fs
#        offline-pools.sh QCOMMIT netfs SLOWFS
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
mode=$2
SLOWFS=${3:+$(realpath "$3")}
# $work (/var/tmp): views, the ext4 image, slowfs' backing dir and logs; $dir: the pool's target.
lv_setup "libvirt.offline_${mode}_pool" qpool /var/tmp
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
dir=/var/lib/libvirt/images/$tag pool=$tag-$mode export_dir=/export/$tag loop='' slowfs_pid=''
lv_pools+=("$pool")  # pool-destroy umounts the target (both modes)
undo_mounts() {
  if [[ -n $slowfs_pid ]]; then
    mountpoint -q "$dir" && { fusermount3 -u "$dir" 2>/dev/null || umount -l "$dir"; }
    wait_until 5 gone "$slowfs_pid"
    stop "$slowfs_pid"
  fi
  mountpoint -q "$dir" && umount -l "$dir"
  [[ -n $loop ]] && losetup -d "$loop"
  rmdir "$dir" 2>/dev/null || rm -rf "$dir"
}
on_exit undo_mounts
mkdir -p "$dir"

# --- The pool ----------------------------------------------------------------------------------
if [[ $mode == fs ]]; then
  truncate -s 256M "$work/fs.img"
  mkfs.ext4 -q -F "$work/fs.img"
  loop=$(losetup -f --show "$work/fs.img" 2>"$work/losetup.err") || skip "losetup refused: $(cat "$work/losetup.err")"
  pool_source="<device path='$loop'/><format type='ext4'/>"
else
  mkdir -p "$work/backing"
  spawn "$SLOWFS" --backing "$work/backing" --mount "$dir" --bandwidth 1G --fsname "lab:$export_dir" \
    --stats "$work/slowfs.stats" </dev/null >"$work/slowfs.err" 2>&1
  slowfs_pid=$!
  fuse_mounted() { grep -q " $dir fuse" /proc/mounts || gone "$slowfs_pid"; }
  wait_until 10 fuse_mounted || fail "qcommit-slowfs did not mount $dir in 10 s"
  gone "$slowfs_pid" && fail "qcommit-slowfs exited: $(cat "$work/slowfs.err")"
  grep -q "^lab:$export_dir $dir fuse.qcommit-slowfs " /proc/mounts ||
    fail "slowfs not mounted as lab:$export_dir on $dir: $(grep " $dir " /proc/mounts)"
  pool_source="<host name='lab'/><dir path='$export_dir'/><format type='nfs'/>"
fi
mounts_before=$(grep -c " $dir " /proc/mounts || true)
virsh -q pool-define /dev/stdin >/dev/null <<XML
<pool type='$mode'><name>$pool</name><source>$pool_source</source><target><path>$dir</path></target></pool>
XML
virsh -q pool-start "$pool" >"$work/start.out" 2>&1 || fail "pool-start $pool ($mode): $(cat "$work/start.out")"
mnt=$(awk -v d="$dir" '$2==d{print $1, $3}' /proc/mounts)
if [[ $mode == fs ]]; then
  [[ $mnt == "$loop ext4" ]] || fail "pool-start did not mount $loop on $dir (mounts: '$mnt')"
else
  # Still the one FUSE mount: libvirt took it as the export and mounted nothing on top.
  [[ $mnt == "lab:$export_dir fuse.qcommit-slowfs" && $(grep -c " $dir " /proc/mounts) == "$mounts_before" ]] ||
    fail "libvirt mounted something on $dir: '$mnt'"
fi
echo "pool $pool ($mode) active on $dir: $mnt"

# --- The chain ---------------------------------------------------------------------------------
cd "$dir"
layers 64M "$dir/base.qcow2=write -P 1 0 8M;write -P 9 40M 1M" \
  "$dir/s1.qcow2=write -P 2 1M 2M;write -z 40M 64k;write -P 5 50M 512k" \
  "$dir/s2.qcow2=write -P 3 2M 2M;write -z 6M 1M;write -P 4 63M 1M"
qemu-img convert -O raw s1.qcow2 "$work/view1.raw"
qemu-img convert -O raw s2.qcow2 "$work/view2.raw"
virsh -q pool-refresh "$pool" >/dev/null
# libvirt caches a pool's capacity figures from its last refresh (Available = statvfs f_bfree *
# f_frsize of the target); vol-info, by contrast, re-reads the volume on every call.
pool_avail() { virsh pool-info --bytes "$pool" | awk '/^Available/{print $2}'; }
fs_free() { stat -f -c '%f %S' "$dir" | awk '{printf "%.0f\n", $1 * $2}'; }
avail0=$(pool_avail)
vol_list_matches_dir() {
  local vols files
  vols=$(virsh -q vol-list "$pool" | awk '{print $1}' | sort | xargs)
  files=$(find "$dir" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | xargs)
  [[ $vols == "$files" ]] || soft_fail "$1: vol-list says '$vols', the directory holds '$files'"
}
# merged N WHAT ARGS...: the WHAT merge, qcommit merge ARGS (output in $work/outN.txt, shown),
# which must refresh the pool.
merged() {
  "$QCOMMIT" merge "${@:3}" --budget off >"$work/out$1.txt" 2>&1 || soft_fail "$2 merge failed: $(cat "$work/out$1.txt")"
  sed 's/^/  qcommit: /' "$work/out$1.txt"
  grep -q "refreshed storage pool $pool" "$work/out$1.txt" || soft_fail "pool $pool not refreshed by the $2 merge: $(cat "$work/out$1.txt")"
}

# 1. A volume of the pool into its backing file.
t0=$(date +%s.%N)
merged 1 pool --pool "$pool" --vol s1.qcow2
t1=$(date +%s.%N)
qemu-img compare -q -f raw -F qcow2 "$work/view1.raw" base.qcow2 || soft_fail "base.qcow2 differs from s1's view after the pool merge"
qemu-img compare -q -f raw -F qcow2 "$work/view2.raw" s2.qcow2 || soft_fail "s2's view changed by the pool merge"
for f in base.qcow2 s1.qcow2 s2.qcow2; do qemu-img check -q "$f" || soft_fail "$f not clean after the pool merge"; done
avail1=$(pool_avail) free1=$(fs_free)
[[ $avail1 != "$avail0" ]] || soft_fail "pool-info Available still $avail0 after the pool merge: pool not refreshed"
if [[ $mode == fs ]]; then  # the ext4 is ours alone: the refreshed figure is the file system's now
  ((avail1 - free1 <= 1048576 && free1 - avail1 <= 1048576)) ||
    soft_fail "pool-info Available $avail1, the file system has $free1 bytes free"
fi
echo "pool-info Available: $avail0 before the pool merge, $avail1 after (statvfs now $free1)"
alloc_refreshed "$pool" base.qcow2
vol_list_matches_dir "after the pool merge"

# 2. The shut-off domain's active layer into s1.qcow2; s2.qcow2 deleted.
define_disk_domain "$dom" "$dir/s2.qcow2"
td=$(date +%s.%N)
merged 2 domain --domain "$dom" --disk vda --delete
t2=$(date +%s.%N)
qemu-img compare -q -f raw -F qcow2 "$work/view2.raw" s1.qcow2 || soft_fail "s1.qcow2 differs from s2's old view after the domain merge"
for f in base.qcow2 s1.qcow2; do qemu-img check -q "$f" || soft_fail "$f not clean after the domain merge"; done
[[ ! -e s2.qcow2 ]] || soft_fail "s2.qcow2 still exists after merge --delete"
vda_is "$dir/s1.qcow2" || soft_fail "domblklist says vda is '$(vda_source "$dom")', expected $dir/s1.qcow2"
want="file qcow2:file=$dir/s1.qcow2 qcow2:file=$dir/base.qcow2 end"
[[ $(vda_xml --inactive) == "$want" ]] || soft_fail "definition after the domain merge: $(vda_xml --inactive), expected $want"
vol_list_matches_dir "after the domain merge"
alloc_refreshed "$pool" s1.qcow2
left=$(find "$dir" -maxdepth 1 -name '*.qcommit-merge*' | xargs)
[[ -z $left ]] || soft_fail "checkpoint files left behind: $left"
no_journal || soft_fail "merge journal left in the definition"
# libvirt runs the domain on the merged chain in the pool.
if virsh -q start "$dom" >"$work/dstart.err" 2>&1; then
  vda_is "$dir/s1.qcow2" || soft_fail "the started domain runs vda on '$(vda_source "$dom")'"
  virsh -q destroy "$dom" >/dev/null 2>&1 || true
else
  soft_fail "domain does not start on the merged chain: $(cat "$work/dstart.err")"
fi
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$td" 'BEGIN{printf "merge times (with their qcommit start-up): pool %.2f s, domain %.2f s\n", b - a, c - d}' </dev/null

# pool-destroy unmounts the target (for netfs: the FUSE mount, which ends slowfs).
cd /
virsh -q pool-destroy "$pool" >"$work/destroy.out" 2>&1 || soft_fail "pool-destroy: $(cat "$work/destroy.out")"
! mountpoint -q "$dir" || soft_fail "$dir still mounted after pool-destroy"
finish "libvirt.offline_${mode}_pool: OK"
