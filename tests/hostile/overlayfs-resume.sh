#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# hostile.overlayfs_resume: BASE on overlayfs whose upper layer is a tmpfs. A run that finds a
# checkpoint reads BASE from its storage again, dropping its cached pages first; on such a stack
# the page cache is the storage and nothing can be dropped: the merge must see through the
# overlay to the tmpfs (engine/storage_kind.h) and finish, instead of failing with a cause it never
# saw ("close what keeps it open"). The checkpoint is one an interrupted run of another merge into
# this BASE left (an identity that does not match): the re-run repairs leaks and merges in full.
# Needs root (mounts); exit 77 without.
#
# usage: overlayfs-resume.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
[[ $(id -u) == 0 ]] || { echo "needs root: skipped"; exit 77; }
work=$(mktemp -d "${TMPDIR:-/var/tmp}/qcommit-ovl.XXXXXX")
cleanup() {
  cd /
  umount "$work/merged" 2>/dev/null || true
  umount "$work/upper-fs" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/lower" "$work/upper-fs" "$work/merged"
mount -t tmpfs -o size=256M tmpfs "$work/upper-fs" || { echo "cannot mount tmpfs: skipped"; exit 77; }
mkdir -p "$work/upper-fs/upper" "$work/upper-fs/work"
if ! mount -t overlay overlay \
    -o "lowerdir=$work/lower,upperdir=$work/upper-fs/upper,workdir=$work/upper-fs/work" \
    "$work/merged"; then
  echo "cannot mount overlayfs: skipped"
  exit 77
fi
cd "$work/merged"
qemu-img create -q -f qcow2 base.qcow2 64M
qemu-io -f qcow2 -c "write -P 1 0 8M" base.qcow2 >/dev/null
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 64M
qemu-io -f qcow2 -c "write -P 7 4M 16M" top.qcow2 >/dev/null
qemu-img convert -O raw top.qcow2 view.raw
# What an interrupted run leaves: a checkpoint beside BASE (here one of another merge).
printf 'qcommit-merge-checkpoint v1\nanother merge\n0\n' >.base.qcow2.qcommit-merge
chmod 600 .base.qcow2.qcommit-merge
rc=0
"$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt || rc=$?
if [[ $rc != 0 ]]; then
  echo "FAIL: the merge on overlayfs over tmpfs failed (exit $rc): $(cat err.txt)"
  exit 1
fi
qemu-img compare -q view.raw base.qcow2 || { echo "FAIL: BASE does not show TOP's view"; exit 1; }
[[ ! -e .base.qcow2.qcommit-merge ]] || { echo "FAIL: checkpoint left"; exit 1; }
echo "overlayfs over tmpfs: the merge that found a checkpoint finished"
