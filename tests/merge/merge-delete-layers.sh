#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.delete_layers: `merge --delete` never passes over a layer silently and never orphans a
# user of one.
#  (1) TOP cannot be unlinked (chattr +i): the merge is done, TOP is named with the reason
#      ("not-deleted" in JSON), exit 4, the checkpoint is kept; once TOP can go, the same command
#      deletes it (exit 0, checkpoint gone);
#  (2) TOP given as a symlink: the file the chain resolved and the link naming it are both
#      removed, and both names said;
#  (3) snap2.qcow2 backed by TOP (snap1.qcow2) in the same directory, not named with --rebase:
#      refused before anything is written (exit 1, the error names snap2.qcow2, every file
#      unchanged, no checkpoint); --dry-run says the same and exits the same; with --rebase
#      snap2.qcow2 the merge deletes snap1.qcow2 and snap2's view is unchanged.
# Exits 77 when (1) cannot run here (chattr +i refused: not root, or a filesystem without the
# immutable flag) and everything else passed.
# usage: merge-delete-layers.sh QCOMMIT
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.delete_layers
work=$(pwd -P)  # the names the merge reports are absolute, through no symlink
on_exit 'chattr -i "$work"/* 2>/dev/null'
skipped=

make_chain() {  # base.qcow2 <- $1 (its backing name: base.qcow2 after the prefix $2, if any)
  rm -f base.qcow2 "$1"
  layers 16M "${2:-}base.qcow2=write -P 1 0 4M" "$1=write -P 7 2M 6M;write -z 12M 1M"
  qemu-img convert -O raw "$1" view.raw
}
checkpoint=.base.qcow2.qcommit-merge

# (1) An unlink the kernel refuses.
make_chain top.qcow2
if chattr +i top.qcow2 2>/dev/null; then
  rc=0; "$QCOMMIT" merge top.qcow2 --budget off --delete --output=json >out1.json 2>err1.txt || rc=$?
  [[ $rc == 4 ]] || soft_fail "(1) exit $rc, not 4, when TOP could not be deleted: $(cat err1.txt)"
  [[ -e top.qcow2 ]] || soft_fail "(1) TOP is gone although it is immutable"
  jq -se --arg top "$work/top.qcow2" 'map(select(.event == "result")) | length == 1 and
    (.[0]["not-deleted"] == [{"path": $top, "reason": "Operation not permitted"}]) and (.[0].deleted == [])' \
    out1.json >/dev/null || soft_fail "(1) the result does not name TOP as not deleted: $(grep result out1.json)"
  [[ -e $checkpoint ]] || soft_fail "(1) the checkpoint was removed although TOP is left"
  same_view view.raw base.qcow2 || soft_fail "(1) BASE does not show TOP's view"
  chattr -i top.qcow2
  "$QCOMMIT" merge top.qcow2 --budget off --delete >out1b.txt 2>err1b.txt ||
    soft_fail "(1) the same command again exited $?: $(cat err1b.txt)"
  [[ ! -e top.qcow2 ]] || soft_fail "(1) the same command again did not delete TOP"
  [[ ! -e $checkpoint ]] || soft_fail "(1) the checkpoint is left after the re-run"
  grep -qx "deleted $work/top.qcow2" out1b.txt || soft_fail "(1) the re-run does not say it deleted TOP: $(cat out1b.txt)"
  same_view view.raw base.qcow2 || soft_fail "(1) BASE does not show TOP's view after the re-run"
else
  echo "(1) skipped: chattr +i is refused here"
  skipped=yes
fi

# (2) TOP given as a symlink to the layer.
mkdir -p real
make_chain real/top.qcow2 "$work/"
ln -s real/top.qcow2 top-link.qcow2
"$QCOMMIT" merge top-link.qcow2 --budget off --delete >out2.txt 2>err2.txt ||
  soft_fail "(2) merge of a symlinked TOP exited $?: $(cat err2.txt)"
[[ ! -e real/top.qcow2 ]] || soft_fail "(2) the layer the link named is still there"
[[ ! -L top-link.qcow2 ]] || soft_fail "(2) the link is still there"
grep -qx "deleted $work/top-link.qcow2" out2.txt || soft_fail "(2) the link's removal is not said: $(cat out2.txt)"
grep -qx "deleted $work/real/top.qcow2" out2.txt || soft_fail "(2) the layer's removal is not said: $(cat out2.txt)"
same_view view.raw base.qcow2 || soft_fail "(2) BASE does not show TOP's view"

# (3) A sibling image backed by TOP.
make_chain snap1.qcow2
qemu-img create -q -f qcow2 -b snap1.qcow2 -F qcow2 snap2.qcow2
qio snap2.qcow2 "write -P 9 6M 1M"
qemu-img convert -O raw snap2.qcow2 view2.raw
sha256sum base.qcow2 snap1.qcow2 snap2.qcow2 >sums3
rc=0; "$QCOMMIT" merge snap1.qcow2 --budget off --delete >out3.txt 2>err3.txt || rc=$?
[[ $rc == 1 ]] || soft_fail "(3) exit $rc, not 1, with snap2.qcow2 backed by TOP"
grep -q "snap2.qcow2" err3.txt || soft_fail "(3) the error does not name snap2.qcow2: $(cat err3.txt)"
[[ $(wc -l <err3.txt) == 1 ]] || soft_fail "(3) the error is not one line: $(cat err3.txt)"
sha256sum --quiet -c sums3 || soft_fail "(3) files changed although the merge was refused"
[[ ! -e $checkpoint ]] || soft_fail "(3) a checkpoint was written although the merge was refused"
qemu-img info snap2.qcow2 >/dev/null 2>&1 || soft_fail "(3) snap2.qcow2 can no longer be opened"
rc=0; "$QCOMMIT" merge snap1.qcow2 --budget off --delete --dry-run >out3d.txt 2>err3d.txt || rc=$?
[[ $rc == 1 ]] || soft_fail "(3) --dry-run exited $rc, not 1 as the merge would"
grep -q "would refuse --delete: image $work/snap2.qcow2" out3d.txt ||
  soft_fail "(3) --dry-run does not show the user: $(cat out3d.txt)"
grep -q "snap2.qcow2" err3d.txt || soft_fail "(3) --dry-run's error does not name snap2.qcow2: $(cat err3d.txt)"
sha256sum --quiet -c sums3 || soft_fail "(3) files changed by --dry-run"
"$QCOMMIT" merge snap1.qcow2 --budget off --delete --rebase snap2.qcow2 >out3r.txt 2>err3r.txt ||
  soft_fail "(3) with --rebase snap2.qcow2 the merge exited $?: $(cat err3r.txt)"
[[ ! -e snap1.qcow2 ]] || soft_fail "(3) snap1.qcow2 not deleted with --rebase snap2.qcow2"
same_view view2.raw snap2.qcow2 || soft_fail "(3) snap2's view changed"

finish
[[ -z $skipped ]] || exit 77
echo "merge.delete_layers: all passed"
