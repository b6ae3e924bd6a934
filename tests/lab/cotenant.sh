# SPDX-License-Identifier: GPL-2.0-or-later
# shellcheck shell=bash
# Co-tenant scenario helpers (source after lab.sh): a second qcow2 chain on the lab's slow
# storage, next to the probing guest's disk, to be merged on the host while the guest probes.
#
#   lab_cotenant_prepare MIB [CLUSTER]
#       $LAB_MNT/ct-base.qcow2 (qcow2, 64 MiB of its own data at the start) and
#       $LAB_MNT/ct-top.qcow2 on it, with MIB MiB written into TOP by qemu-io (sequential
#       64 MiB writes, a different pattern per write, overwriting BASE's data too), all synced
#       to the storage. Run it while the storage is fast (lab_storage_set 5G); it waits until
#       the slowfs queue is idle. Exports LAB_CT_BASE, LAB_CT_TOP, LAB_CT_BYTES.
#   lab_cotenant_check
#       BASE equals TOP's view (qemu-img compare) and is clean (qemu-img check); run after the
#       merge. Returns non-zero with a message on stderr otherwise.

kCotenantPieceMiB=64

lab_cotenant_prepare() {
  local mib=$1 cluster=${2:-64k} vsize cmds=() off=0 n pat=1
  [ "$mib" -gt 0 ] || lab_die "lab_cotenant_prepare: size must be > 0 MiB"
  LAB_CT_BASE=$LAB_MNT/ct-base.qcow2
  LAB_CT_TOP=$LAB_MNT/ct-top.qcow2
  LAB_CT_BYTES=$((mib << 20))
  export LAB_CT_BASE LAB_CT_TOP LAB_CT_BYTES
  vsize=$(((mib + 1024) << 20))
  qemu-img create -q -f qcow2 -o cluster_size="$cluster" "$LAB_CT_BASE" "$vsize"
  qemu-io -f qcow2 -c "write -q -P 0xb0 0 ${kCotenantPieceMiB}M" "$LAB_CT_BASE" >/dev/null
  qemu-img create -q -f qcow2 -o cluster_size="$cluster" -b ct-base.qcow2 -F qcow2 "$LAB_CT_TOP"
  while [ "$off" -lt "$mib" ]; do
    n=$((mib - off < kCotenantPieceMiB ? mib - off : kCotenantPieceMiB))
    cmds+=(-c "write -q -P $((pat % 255 + 1)) ${off}M ${n}M")
    off=$((off + n))
    pat=$((pat + 1))
  done
  qemu-io -f qcow2 "${cmds[@]}" "$LAB_CT_TOP" >/dev/null
  sync -f "$LAB_CT_TOP"
  sync "$LAB_CT_BASE" "$LAB_CT_TOP"
  lab_storage_wait_idle 300
  lab_log "co-tenant chain: $LAB_CT_TOP (${mib} MiB written) on $LAB_CT_BASE"
}

lab_cotenant_check() {
  local out
  if ! out=$(qemu-img compare -f qcow2 -F qcow2 "$LAB_CT_BASE" "$LAB_CT_TOP" 2>&1); then
    echo "co-tenant: BASE differs from TOP's view: $out" >&2
    return 1
  fi
  if ! out=$(qemu-img check -f qcow2 "$LAB_CT_BASE" 2>&1); then
    echo "co-tenant: qemu-img check BASE: $out" >&2
    return 1
  fi
  return 0
}

# Storage-side share of the guest's latency during the last merge: for each request on the
# guest's disk issued from merge_start to merge_end + SETTLE_S, the bytes queued ahead of it in
# the slowfs FIFO when it arrived, as time at the storage bandwidth, plus its own service: the
# delay the queue causes (the budget's meaning), free of guest CPU noise (TCG on a loaded host)
# and of the emulator's own stalls when the host starves it (its measured wait then exceeds this;
# the max of wait + service is LAB_FIFO_wait_max).  The guest's disk: its overlay (writes and
# flushes; a guest sync write is one of each), and any file made during the merge and gone by
# now that was written beyond offset 0 (`qcommit live`'s fresh overlay, which the guest writes
# from the snapshot to the pivot).  Not the guest's: every other file still on the storage (a
# merge's target, a co-tenant's chain) and files written only at offset 0 (the shared-queue
# probes of qcommitd and qcommit merge).  Sets LAB_FIFO_{n,p99,max,wait_max} (ms).
lab_cotenant_fifo_wait() {
  local settle=${1:-0} ino others out kv
  ino=$(stat -c %i "$LAB_DIR/backing/$(basename "$LAB_OVERLAY")")
  others=$(find "$LAB_DIR/backing" -type f -printf '%i\n' | grep -vx "$ino" | paste -sd' ' || true)
  out=$(awk -F, -v ino="$ino" -v others="$others" -v bw="$LAB_BW_BPS" -v ms="$(lab_event merge_start)" \
    -v me="$(lab_event merge_end)" -v st="$settle" '
    BEGIN { k = split(others, o, " "); for (i = 1; i <= k; i++) other[o[i]] = 1 }
    NR > 1 && !($3 in other) && $1 >= ms && $1 <= me + st {
      c[$3]++; d[$3, c[$3]] = 1000 * $7 / bw + $9; w[$3, c[$3]] = $8 + $9
      if ($2 == "W" && $4 != 0) beyond0[$3] = 1
    }
    END {
      for (f in c) {
        if (f != ino && !(f in beyond0)) continue
        for (i = 1; i <= c[f]; i++) { n++; v[n] = d[f, i]; if (w[f, i] > wmax) wmax = w[f, i] }
      }
      for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
      k = int(0.99 * n + 0.999999); if (k < 1) k = 1
      printf "n=%d p99=%.1f max=%.1f wait_max=%.1f\n", n, n ? v[k] : -1, n ? v[n] : -1, wmax + 0
    }' "$LAB_DIR/slowfs.csv")
  for kv in $out; do printf -v "LAB_FIFO_${kv%%=*}" '%s' "${kv#*=}"; done
}
