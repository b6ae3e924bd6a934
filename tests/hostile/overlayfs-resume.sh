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
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup hostile.overlayfs_resume
on_exit 'cd /; umount "$work/merged" 2>/dev/null; umount "$work/upper-fs" 2>/dev/null'
mkdir -p lower upper-fs merged
mount -t tmpfs -o size=256M tmpfs upper-fs || { echo "cannot mount tmpfs: skipped"; exit 77; }
mkdir -p upper-fs/upper upper-fs/work
mount -t overlay overlay -o "lowerdir=$work/lower,upperdir=$work/upper-fs/upper,workdir=$work/upper-fs/work" merged ||
  { echo "cannot mount overlayfs: skipped"; exit 77; }
cd merged
small_chain
# What an interrupted run leaves: a checkpoint beside BASE (here one of another merge).
printf 'qcommit-merge-checkpoint v1\nanother merge\n0\n' >.base.qcow2.qcommit-merge
chmod 600 .base.qcow2.qcommit-merge
"$QCOMMIT" merge top.qcow2 --budget off >out.txt 2>err.txt ||
  fail "the merge on overlayfs over tmpfs failed (exit $?): $(cat err.txt)"
same_view view.raw base.qcow2 || fail "BASE does not show TOP's view"
[[ ! -e .base.qcow2.qcommit-merge ]] || fail "checkpoint left"
echo "overlayfs over tmpfs: the merge that found a checkpoint finished"
