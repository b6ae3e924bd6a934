# SPDX-License-Identifier: GPL-2.0-or-later
# shellcheck shell=bash
# qcommit lab fixture: slow sync storage (qcommit-slowfs) + busybox test guest under libvirtd.
# Source this file from bash (set -euo pipefail recommended), then:
#
#   lab_init TAG                      unique run (LAB_ID, LAB_DIR), daemons, guest assets, EXIT trap
#   lab_storage_start [--bandwidth 50M] [--latency-ms N] [--max-background N]
#                                     mount slowfs at $LAB_MNT (backing in $LAB_DIR/backing)
#   lab_storage_set RATE [LAT_MS]     change bandwidth (and latency) while running
#   lab_storage_wait_idle [TIMEOUT]   wait until the slowfs FIFO queue is empty
#   lab_guest_start [--cache writeback|none] [--fill MiB] [--interval MS] [--disk-size SIZE]
#                                     base.raw on the slow storage; domain $LAB_DOM defined,
#                                     started paused, disk-only snapshot to $LAB_MNT/overlay.qcow2,
#                                     resumed; the guest fills, then probes
#   lab_wait_console REGEX [TIMEOUT]  wait for a console line (fails on "LAB ERROR")
#   lab_wait_probing [TIMEOUT]        wait until the fill is done and the probe runs
#   lab_guest_ready [--bandwidth B] [--wait S] [--baseline S] GUEST_OPTIONS...
#                                     storage at B (50M), the guest started with GUEST_OPTIONS
#                                     while it is fast, probing within S (300) s, storage back at
#                                     B and idle, then S (0) s of baseline probing
#   fail MESSAGE                      (tests/lib/test.sh) ends the test; fail_context adds the
#                                     tails of qcommitd's and the merge's logs
#   lab_mark NAME                     record host time of an event in $LAB_DIR/events
#   lab_merge CMD...                  run a host command as the merge action (marks merge_start /
#                                     merge_end, sets LAB_MERGE_RC, LAB_MERGE_S); CMD sees LAB_DOM,
#                                     LAB_MNT, LAB_BASE, LAB_OVERLAY, LAB_BW_BPS
#   lab_job_watch_start [DISK] / lab_job_watch_stop
#                                     when QEMU's job first had a speed (LAB_JOB_govern_ms from
#                                     merge_start) and what it had copied by then
#   lab_collect ROW BASELINE_S [SETTLE_S]
#                                     probe statistics around the merge: sets LAB_STATS_* vars,
#                                     appends ROW's samples to $LAB_DIR/timeline.csv
#   lab_teardown                      domain destroyed+undefined, storage unmounted, processes
#                                     gone, backing data removed (called by the EXIT trap)
#   lab_assert_clean                  fails if anything of this run is left behind
#
# Environment: QCOMMIT_BUILD_DIR (default <repo>/build), LAB_KEEP=1 keeps the backing data,
# LAB_VERBOSE=1 logs more, LAB_BASE_FORMAT=qcow2 gives the guest a qcow2 base (default raw).
# LAB_DIRECT_READERS=1 mounts the storage with slowfs --direct-readers: a read-only open (qcommitd's
# fd on a job's target) then leaves QEMU's O_DIRECT writes to that file parallel, as on NFS.
# LAB_BASE_PREEXTEND=1 (with LAB_BASE_FORMAT=qcow2) makes the base file long enough that the
# merge's cluster allocations never write past its end, which FUSE would serialise.
# LAB_RUN_ROOT puts the runs elsewhere than <build>/lab-run (a directory another libvirtd's QEMU
# sees at the same path), LAB_ID_PREFIX names them (default qcl), LAB_LOCAL_DAEMONS=0 leaves
# this host's libvirtd alone and LAB_URI names the libvirtd the runs use (default
# qemu:///system; tests/lab/platform.sh sets these for the Debian 13 platform). Needs root,
# /dev/fuse, qemu-system-x86, libvirt.

# wait_until, gone, fail (tests/lib/test.sh; its setup and traps are not used here: lab_init has its own).
. "$(dirname "${BASH_SOURCE[0]}")/../lib/test.sh"

LAB_SOURCE_DIR=${QCOMMIT_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
LAB_BUILD_DIR=$(realpath -m "${QCOMMIT_BUILD_DIR:-$LAB_SOURCE_DIR/build}")
LAB_SLOWFS=$LAB_BUILD_DIR/lab/qcommit-slowfs
LAB_PROBE=$LAB_BUILD_DIR/lab/qcommit-lab-probe
LAB_CACHE=$LAB_BUILD_DIR/lab-cache
export LIBVIRT_DEFAULT_URI=${LAB_URI:-qemu:///system}

lab_log() { printf '[lab %s] %s\n' "$(date +%T)" "$*" >&2; }
lab_die() {
  printf 'lab: %s\n' "$*" >&2
  exit 1
}
lab_now() { printf '%s' "$EPOCHREALTIME"; }
fail_context() {
  local f
  for f in qcommitd.log merge.log; do
    [ -z "${LAB_DIR:-}" ] || [ ! -f "$LAB_DIR/$f" ] || tail -n 20 "$LAB_DIR/$f"
  done
}

lab_ensure_daemons() {
  # /dev/kvm usable by libvirt's QEMU user, or libvirtd probes QEMU again on every define.
  "$LAB_SOURCE_DIR/scripts/dev-kvm-mode" >&2
  pgrep -x virtlogd >/dev/null || virtlogd -d
  pgrep -x libvirtd >/dev/null || libvirtd -d
  wait_until 40 virsh -q version >/dev/null 2>&1 || lab_die "libvirtd does not answer on $LIBVIRT_DEFAULT_URI"
}

lab_init() {
  local tag=${1:-run}
  local run_root=${LAB_RUN_ROOT:-$LAB_BUILD_DIR/lab-run}
  [ "$(id -u)" -eq 0 ] || lab_die "the lab needs root (FUSE mount, libvirt system URI)"
  [ -x "$LAB_SLOWFS" ] || lab_die "$LAB_SLOWFS missing: build target qcommit-slowfs"
  [ -x "$LAB_PROBE" ] || lab_die "$LAB_PROBE missing: build target qcommit-lab-probe"
  LAB_ID=${LAB_ID_PREFIX:-qcl}-$tag-$(date +%m%d%H%M%S)-$$-$RANDOM
  LAB_DIR=$run_root/$LAB_ID
  LAB_MNT=$LAB_DIR/mnt
  LAB_DOM=$LAB_ID
  LAB_SLOWFS_PID=""
  LAB_READER_PID=""
  LAB_DOM_DEFINED=0
  export LAB_ID LAB_DIR LAB_MNT LAB_DOM
  mkdir -p "$LAB_DIR/backing" "$LAB_MNT"
  # QEMU runs as its own user: every directory down to the run's must let it through.
  [ -n "${LAB_RUN_ROOT:-}" ] || chmod 755 "$LAB_BUILD_DIR"
  chmod 755 "$run_root" "$LAB_DIR"
  : >"$LAB_DIR/events"
  : >"$LAB_DIR/timeline.csv"
  trap 'lab_teardown' EXIT
  trap 'exit 130' INT TERM HUP
  [ "${LAB_LOCAL_DAEMONS:-1}" = 0 ] || lab_ensure_daemons
  "$LAB_SOURCE_DIR/scripts/lab-guest-build" "$LAB_CACHE" "$LAB_PROBE" >/dev/null
  lab_log "run $LAB_ID in $LAB_DIR against $LIBVIRT_DEFAULT_URI"
}

lab_storage_start() {
  local bw=50M lat=0 maxbg=""
  while [ $# -gt 0 ]; do
    case $1 in
      --bandwidth) bw=$2; shift 2 ;;
      --latency-ms) lat=$2; shift 2 ;;
      --max-background) maxbg=$2; shift 2 ;;
      *) lab_die "lab_storage_start: unknown option $1" ;;
    esac
  done
  printf 'bandwidth=%s\nlatency_ms=%s\n' "$bw" "$lat" >"$LAB_DIR/slowfs.control"
  local args=(--backing "$LAB_DIR/backing" --mount "$LAB_MNT" --bandwidth "$bw" --latency-ms "$lat"
    --control "$LAB_DIR/slowfs.control" --log "$LAB_DIR/slowfs.csv" --stats "$LAB_DIR/slowfs.stats"
    --backing-log "$LAB_DIR/slowfs-backing.csv" --pidfile "$LAB_DIR/slowfs.pid")
  [ -n "$maxbg" ] && args+=(--max-background "$maxbg")
  [ "${LAB_DIRECT_READERS:-0}" = 1 ] && args+=(--direct-readers)
  "$LAB_SLOWFS" "${args[@]}" </dev/null >>"$LAB_DIR/slowfs.err" 2>&1 &
  LAB_SLOWFS_PID=$!
  wait_until 10 _lab_storage_up || lab_die "qcommit-slowfs did not mount $LAB_MNT"
  gone "$LAB_SLOWFS_PID" && lab_die "qcommit-slowfs exited: $(cat "$LAB_DIR/slowfs.err")"
  LAB_BW_BPS=$(awk -F= '$1=="bandwidth_bps"{print $2}' "$LAB_DIR/slowfs.stats")
  export LAB_BW_BPS
  lab_log "slowfs mounted at $LAB_MNT ($bw B/s, latency ${lat} ms, pid $LAB_SLOWFS_PID)"
}
# Mounted with its first statistics written, or exited.
_lab_storage_up() {
  { grep -q " $LAB_MNT fuse" /proc/mounts && [ -s "$LAB_DIR/slowfs.stats" ]; } || gone "$LAB_SLOWFS_PID"
}

lab_storage_set() {
  local bw=$1 lat=${2:-}
  [ -n "$lat" ] || lat=$(awk -F= '$1=="latency_ms"{print $2}' "$LAB_DIR/slowfs.control")
  printf 'bandwidth=%s\nlatency_ms=%s\n' "$bw" "$lat" >"$LAB_DIR/slowfs.control.tmp"
  mv "$LAB_DIR/slowfs.control.tmp" "$LAB_DIR/slowfs.control"
  sleep 0.6  # control poll (50 ms) + stats period (500 ms)
  LAB_BW_BPS=$(awk -F= '$1=="bandwidth_bps"{print $2}' "$LAB_DIR/slowfs.stats")
  export LAB_BW_BPS
}

lab_storage_wait_idle() {
  wait_until "${1:-120}" _lab_storage_idle || lab_die "slowfs queue not idle after ${1:-120}s"
}
_lab_storage_idle() { [ "$(awk -F= '$1=="queued_reqs"{print $2}' "$LAB_DIR/slowfs.stats")" = 0 ]; }

lab_guest_ready() {
  local bw=50M wait_s=300 baseline=0
  while [ $# -gt 0 ]; do
    case $1 in
      --bandwidth) bw=$2; shift 2 ;;
      --wait) wait_s=$2; shift 2 ;;
      --baseline) baseline=$2; shift 2 ;;
      *) break ;;
    esac
  done
  lab_storage_start --bandwidth "$bw"
  lab_storage_set 5G # fast while the guest fills; the scenario is about the merge
  lab_guest_start "$@"
  lab_wait_probing "$wait_s"
  lab_storage_set "$bw"
  lab_storage_wait_idle 90
  sleep "$baseline"
}

lab_storage_stop() {
  [ -n "${LAB_SLOWFS_PID:-}" ] || return 0
  kill -TERM "$LAB_SLOWFS_PID" 2>/dev/null || true
  if ! wait_until 10 gone "$LAB_SLOWFS_PID"; then
    lab_log "qcommit-slowfs $LAB_SLOWFS_PID ignores SIGTERM; killing"
    kill -KILL "$LAB_SLOWFS_PID" 2>/dev/null || true
  fi
  wait "$LAB_SLOWFS_PID" 2>/dev/null || true
  if grep -q " $LAB_MNT fuse" /proc/mounts; then umount -l "$LAB_MNT" || true; fi
  LAB_SLOWFS_PID=""
}

# The test guest's domain XML: NAME, DIR (holding vmlinuz and initramfs.cpio.gz), raw disk BASE,
# CACHE mode, FILL MiB, probe INTERVAL ms, serial CONSOLE file[, busy WRITER KiB/s, READ probe 0|1].
lab_domain_xml() {
  local name=$1 dir=$2 base=$3 cache=$4 fill=$5 interval=$6 console=$7 writer=${8:-0} read=${9:-0}
  cat <<EOF
<domain type='qemu'>
  <name>$name</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>$dir/vmlinuz</kernel>
    <initrd>$dir/initramfs.cpio.gz</initrd>
    <cmdline>console=ttyS0 quiet panic=1 lab.fill=$fill lab.interval=$interval lab.writer=$writer lab.read=$read</cmdline>
  </os>
  <features><acpi/></features>
  <clock offset='utc'><timer name='hpet' present='yes'/></clock>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='${LAB_BASE_FORMAT:-raw}' cache='$cache'/>
      <source file='$base'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='file'>
      <source path='$console'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
</domain>
EOF
}

# The options of lab_guest_start and lab_guest2_start (WHO), set in the caller's locals: cache,
# fill, interval, size, writer (--writer KiB/s: a busy guest's writer, tests/lab/guest/probe.c),
# read (--read-probe: a 4 KiB read probe too), and uri where WHO takes --uri.
lab_guest_options() {
  local who=$1
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --uri) [ "$who" = lab_guest2_start ] || lab_die "$who: unknown option $1"; uri=$2; shift 2 ;;
      --cache) cache=$2; shift 2 ;;
      --fill) fill=$2; shift 2 ;;
      --interval) interval=$2; shift 2 ;;
      --disk-size) size=$2; shift 2 ;;
      --writer) writer=$2; shift 2 ;;
      --read-probe) read=1; shift ;;
      *) lab_die "$who: unknown option $1" ;;
    esac
  done
  case $cache in writeback | none | writethrough | directsync | unsafe) ;; *) lab_die "bad cache mode $cache" ;; esac
}

# Defines domain NAME from XML on URI and starts it paused under an external disk-only snapshot
# (its disk's new active layer is OVERLAY); the caller resumes it.
lab_domain_boot() {
  local uri=$1 name=$2 xml=$3 overlay=$4
  virsh -q -c "$uri" define "$xml" >/dev/null
  virsh -q -c "$uri" start --paused "$name" >/dev/null
  virsh -q -c "$uri" snapshot-create-as "$name" --name lab-overlay --disk-only --no-metadata \
    --atomic --diskspec "vda,snapshot=external,file=$overlay" >/dev/null
}

lab_guest_start() {
  local cache=writeback fill=0 interval=100 size=2560M writer=0 read=0
  lab_guest_options lab_guest_start "$@"
  LAB_BASE=$LAB_MNT/base.${LAB_BASE_FORMAT:-raw}
  LAB_OVERLAY=$LAB_MNT/overlay.qcow2
  export LAB_BASE LAB_OVERLAY
  if [ "${LAB_BASE_FORMAT:-raw}" = qcow2 ]; then
    qemu-img create -q -f qcow2 "$LAB_BASE" "$size"
    # LAB_BASE_PREEXTEND=1: the file is made sparse-long enough for every cluster the merge
    # allocates, so no write goes past its end. FUSE takes the inode's lock exclusively for an
    # O_DIRECT write past the end of file (one at a time); an NFS client does not.
    if [ "${LAB_BASE_PREEXTEND:-0}" = 1 ]; then truncate -s "$((2 * $(numfmt --from=iec "$size")))" "$LAB_BASE"; fi
  else
    truncate -s "$size" "$LAB_BASE"
  fi
  # Per-run copies: libvirt relabels kernel/initrd, so runs must not share them.
  cp "$LAB_CACHE/vmlinuz" "$LAB_CACHE/initramfs.cpio.gz" "$LAB_DIR/"
  : >"$LAB_DIR/console.log"
  lab_domain_xml "$LAB_DOM" "$LAB_DIR" "$LAB_BASE" "$cache" "$fill" "$interval" "$LAB_DIR/console.log" \
    "$writer" "$read" >"$LAB_DIR/domain.xml"
  LAB_DOM_DEFINED=1
  lab_domain_boot "$LIBVIRT_DEFAULT_URI" "$LAB_DOM" "$LAB_DIR/domain.xml" "$LAB_OVERLAY"
  lab_reader_start
  virsh -q resume "$LAB_DOM" >/dev/null
  lab_mark guest_resumed
  lab_log "guest $LAB_DOM running (cache=$cache, fill ${fill} MiB, probe every ${interval} ms, writer ${writer} KiB/s, read probe $read)"
}

# A second guest on the run's storage, under another libvirtd (standing for a guest on another
# host that shares the export): `lab_guest2_start --uri URI [--cache C] [--fill MiB]
# [--interval ms] [--disk-size S]` starts domain $LAB_DOM-2 on URI with its disk at
# $LAB_MNT/second/base.raw under an external overlay (second/overlay.qcow2), and returns once its
# fill is written (its probe then runs every INTERVAL ms; a long interval leaves it idle).
# Sets LAB2_URI, LAB2_DOM, LAB2_BASE, LAB2_OVERLAY; lab_teardown removes it.
lab_guest2_start() {
  local uri="" cache=writeback fill=0 interval=100 size=2560M writer=0 read=0
  lab_guest_options lab_guest2_start "$@"
  [ -n "$uri" ] || lab_die "lab_guest2_start: --uri is required"
  local dir=$LAB_DIR/second
  mkdir -p "$dir" "$LAB_MNT/second"
  chmod 755 "$dir" "$LAB_MNT/second"
  LAB2_URI=$uri LAB2_DOM=$LAB_DOM-2
  LAB2_BASE=$LAB_MNT/second/base.raw LAB2_OVERLAY=$LAB_MNT/second/overlay.qcow2
  export LAB2_URI LAB2_DOM LAB2_BASE LAB2_OVERLAY
  truncate -s "$size" "$LAB2_BASE"
  cp "$LAB_CACHE/vmlinuz" "$LAB_CACHE/initramfs.cpio.gz" "$dir/"
  : >"$dir/console.log"
  lab_domain_xml "$LAB2_DOM" "$dir" "$LAB2_BASE" "$cache" "$fill" "$interval" "$dir/console.log" \
    "$writer" "$read" >"$dir/domain.xml"
  LAB2_DEFINED=1
  lab_domain_boot "$uri" "$LAB2_DOM" "$dir/domain.xml" "$LAB2_OVERLAY"
  virsh -q -c "$uri" resume "$LAB2_DOM" >/dev/null
  wait_until 900 grep -q '^LAB PROBING\|^LAB ERROR' "$dir/console.log" ||
    lab_die "second guest did not finish its fill in 900 s"
  grep -q '^LAB ERROR' "$dir/console.log" && lab_die "second guest: $(grep '^LAB ERROR' "$dir/console.log")"
  lab_log "second guest $LAB2_DOM on $uri filled ${fill} MiB (cache=$cache, probe every ${interval} ms)"
}

lab_guest2_stop() {
  [ "${LAB2_DEFINED:-0}" = 1 ] || return 0
  lab_domain_remove "$LAB2_URI" "$LAB2_DOM"
  LAB2_DEFINED=0
}

# Domain NAME on URI destroyed (shut off within 10 s) and undefined.
lab_domain_remove() {
  virsh -q -c "$1" destroy "$2" >/dev/null 2>&1 || true
  wait_until 10 _lab_shut_off "$1" "$2" || true
  virsh -q -c "$1" undefine "$2" >/dev/null 2>&1 || true
}
_lab_shut_off() { virsh -q -c "$1" domstate "$2" 2>/dev/null | grep -q 'shut off'; }

# Stamps every console line with the host's wall clock (seconds since the epoch).
lab_reader_start() {
  perl -e '
    use strict; use Time::HiRes qw(time sleep); use IO::Handle;
    my ($in, $out) = @ARGV; my $fh;
    until (open($fh, "<", $in)) { sleep 0.05 }
    open(my $o, ">>", $out) or die "$out: $!"; $o->autoflush(1);
    my $buf = "";
    while (1) {
      my $n = sysread($fh, my $chunk, 65536);
      if ($n) {
        $buf .= $chunk;
        while ($buf =~ s/^([^\n]*)\n//) { my $l = $1; $l =~ s/\r//g; printf $o "%.6f\t%s\n", time, $l; }
      } else { sleep 0.005 }
    }' "$LAB_DIR/console.log" "$LAB_DIR/console.stamped" </dev/null >/dev/null 2>&1 &
  LAB_READER_PID=$!
}

lab_wait_console() {
  local re=$1 timeout=${2:-120} deadline
  deadline=$((SECONDS + ${2:-120}))
  while [ $SECONDS -lt $deadline ]; do
    grep -qE "$re" "$LAB_DIR/console.log" 2>/dev/null && return 0
    if grep -q "LAB ERROR" "$LAB_DIR/console.log" 2>/dev/null; then
      lab_die "guest: $(grep -m1 'LAB ERROR' "$LAB_DIR/console.log" | tr -d '\r')"
    fi
    virsh -q domstate "$LAB_DOM" 2>/dev/null | grep -q running || lab_die "guest $LAB_DOM is not running"
    sleep 0.2
  done
  lab_die "no console line matching '$re' after ${timeout}s (see $LAB_DIR/console.log)"
}

lab_wait_probing() { lab_wait_console '^LAB PROBING' "${1:-300}"; }

lab_mark() { printf '%s %s\n' "$1" "$(lab_now)" >>"$LAB_DIR/events"; }

lab_event() { awk -v k="$1" '$1==k {v=$2} END {print v}' "$LAB_DIR/events"; }

# lab_job_watch_start [DISK]: until lab_job_watch_stop, asks libvirt about DISK's (vda) block job
# every ~10 ms over one virsh connection and appends "host_time bandwidth cur end" per answer that
# shows a job to $LAB_DIR/jobwatch.txt. lab_job_watch_stop then sets LAB_JOB_govern_ms: from the
# first answer showing the job (its creation, to the watcher's ~10-20 ms) to the first showing a
# speed set on it ("-" when none did while it ran: the job went unpaced); LAB_JOB_unpaced_mib:
# what it had copied by then; LAB_JOB_seen_s: when the job was first seen, seconds after the
# merge's start ("-" when never); LAB_JOB_answers.
lab_job_watch_start() {
  local disk=${1:-vda}
  : >"$LAB_DIR/jobwatch.txt"
  rm -f "$LAB_DIR/jobwatch.stop"
  (
    while [ ! -e "$LAB_DIR/jobwatch.stop" ]; do
      echo "blockjob $LAB_DOM $disk --raw --bytes"
      sleep 0.01
    done | virsh -q 2>/dev/null | while IFS= read -r line; do
      case $line in
        *bandwidth=*) bw=${line##*=} ;;
        *cur=*) cur=${line##*=} ;;
        *end=*) printf '%s %s %s %s\n' "$EPOCHREALTIME" "${bw:-0}" "${cur:-0}" "${line##*=}" ;;
      esac
    done >>"$LAB_DIR/jobwatch.txt"
  ) &
  LAB_JOB_WATCH_PID=$!
}

lab_job_watch_stop() {
  [ -n "${LAB_JOB_WATCH_PID:-}" ] || return 0
  touch "$LAB_DIR/jobwatch.stop"
  wait "$LAB_JOB_WATCH_PID" 2>/dev/null || true
  LAB_JOB_WATCH_PID=""
  local out
  out=$(awk -v ms="$(lab_event merge_start)" '
    n++ == 0 { t0 = $1 }
    $2 > 0 && !found { found = 1; t = ($1 - t0) * 1000; cur = $3 }
    END {
      seen = n && ms != "" ? sprintf("%.3f", t0 - ms) : "-"
      if (found) printf "govern_ms=%.0f unpaced_mib=%.0f seen_s=%s answers=%d\n", t, cur / 1048576, seen, n
      else printf "govern_ms=- unpaced_mib=- seen_s=%s answers=%d\n", seen, n
    }' "$LAB_DIR/jobwatch.txt")
  local kv
  for kv in $out; do printf -v "LAB_JOB_${kv%%=*}" '%s' "${kv#*=}"; done
  lab_log "job watch: $out"
}

lab_merge() {
  lab_log "merge: $*"
  local t0 t1
  t0=$(lab_now)
  lab_mark merge_start
  set +e
  "$@" >>"$LAB_DIR/merge.log" 2>&1
  LAB_MERGE_RC=$?
  set -e
  lab_mark merge_end
  t1=$(lab_now)
  LAB_MERGE_S=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
  lab_log "merge finished rc=$LAB_MERGE_RC in ${LAB_MERGE_S}s"
  [ "$LAB_MERGE_RC" -eq 0 ] || lab_log "merge output: $(tail -n 5 "$LAB_DIR/merge.log")"
}

# awk: pct(a, n, p), the nearest-rank percentile P (0-1) of a[1..n] (sorts a), -1 when n is 0.
LAB_AWK_PCT='function pct(a, n, p,   i, j, t, k) {
  if (n == 0) return -1
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  k = int(p * n + 0.999999); if (k < 1) k = 1; if (k > n) k = n
  return a[k]
}'

# Probe samples as "completion_epoch latency_ms", guest clock mapped onto the host clock by the
# smallest (host arrival - guest completion) difference. `lab_samples KIND` for the busy guest's
# lines: R (read probe: latency), W (writer: one per MiB, its fdatasync's latency).
lab_samples() {
  awk -F'\t' -v k="${1:-P}" '$2 ~ "^" k " " {split($2, f, " "); print $1, f[3] / 1000, f[4] / 1000}' \
    "$LAB_DIR/console.stamped" |
    awk '{h[NR] = $1; g[NR] = $2; l[NR] = $3; d = $1 - $2; if (NR == 1 || d < off) off = d}
         END {for (i = 1; i <= NR; i++) printf "%.6f %.3f\n", g[i] + off, l[i]}'
}

# The busy guest around the last merge (windows as lab_collect's: BASELINE s before it; the merge
# until SETTLE s after): the writer's MiB/s and its fdatasync p99/max, the read probe's p99/max.
# Sets LAB_STATS_w_base_mibps, w_mibps, w_kept_pct, w_sync_base_p99, w_sync_p99, w_sync_max,
# r_base_p99, r_base_max, r_p99, r_max ("-" where the guest had none).
lab_busy_collect() {
  local baseline=$1 settle=${2:-2} ms me kind out kv
  ms=$(lab_event merge_start)
  me=$(lab_event merge_end)
  for kind in W R; do
    lab_samples "$kind" >"$LAB_DIR/samples-$kind.txt"
    out=$(awk -v ms="$ms" -v me="$me" -v bl="$baseline" -v st="$settle" -v k="$kind" "$LAB_AWK_PCT"'
      function fpct(a, n, p) { return n ? sprintf("%.1f", pct(a, n, p)) : "-" }
      $1 >= ms - bl && $1 < ms { nb++; b[nb] = $2 }
      $1 >= ms && $1 <= me + st { nm++; m[nm] = $2; if ($2 > mx) mx = $2 }
      END {
        if (k == "W") {
          base = nb / bl; rate = me > ms ? nm / (me + st - ms) : 0
          printf "w_base_mibps=%s w_mibps=%s w_kept_pct=%s ", nb ? sprintf("%.2f", base) : "-", nm ? sprintf("%.2f", rate) : "-", nb && nm ? sprintf("%.0f", 100 * rate / base) : "-"
          printf "w_sync_base_p99=%s w_sync_p99=%s w_sync_max=%s\n", fpct(b, nb, 0.99), fpct(m, nm, 0.99), nm ? sprintf("%.1f", mx) : "-"
        } else {
          printf "r_base_p99=%s r_base_max=%s r_p99=%s r_max=%s\n", fpct(b, nb, 0.99), fpct(b, nb, 1), fpct(m, nm, 0.99), nm ? sprintf("%.1f", mx) : "-"
        }
      }' "$LAB_DIR/samples-$kind.txt")
    for kv in $out; do
      printf -v "LAB_STATS_${kv%%=*}" '%s' "${kv#*=}"
    done
    lab_log "busy guest ($kind): $out"
  done
}

# Statistics around the last merge: baseline = samples completed in the BASELINE_S before the
# merge; merge = samples completed after merge_start and issued before merge_end + SETTLE_S.
# max_gap = longest time without a completion from merge_start to the first completion after
# merge_end + SETTLE_S.
lab_collect() {
  local row=$1 baseline=$2 settle=${3:-2} ms me out
  ms=$(lab_event merge_start)
  me=$(lab_event merge_end)
  [ -n "$ms" ] && [ -n "$me" ] || lab_die "lab_collect: no merge recorded"
  lab_samples >"$LAB_DIR/samples.txt"
  out=$(awk -v ms="$ms" -v me="$me" -v bl="$baseline" -v st="$settle" -v row="$row" -v csv="$LAB_DIR/timeline.csv" "$LAB_AWK_PCT"'
    BEGIN { last = ms }
    {
      c = $1; l = $2
      printf "%s,%.3f,%.3f\n", row, c - ms, l >> csv
      if (c >= ms - bl && c < ms) { nb++; b[nb] = l; if (l > bmax) bmax = l }
      if (c >= ms && c - l / 1000 <= me + st) { nm++; m[nm] = l; if (l > mmax) mmax = l }
      if (c > ms && !done) { gap = c - last; if (gap > maxgap) maxgap = gap; last = c; if (c > me + st) done = 1 }
    }
    END {
      printf "base_n=%d base_p50=%.1f base_p99=%.1f base_max=%.1f ", nb, pct(b, nb, 0.5), pct(b, nb, 0.99), bmax
      printf "n=%d p50=%.1f p99=%.1f max=%.1f max_gap=%.1f merge_s=%.1f\n", nm, pct(m, nm, 0.5), pct(m, nm, 0.99), mmax, maxgap * 1000, me - ms
    }' "$LAB_DIR/samples.txt")
  local kv
  for kv in $out; do
    printf -v "LAB_STATS_${kv%%=*}" '%s' "${kv#*=}"
  done
  lab_log "$row: $out"
}

lab_guest_stop() {
  [ "${LAB_DOM_DEFINED:-0}" = 1 ] || return 0
  lab_domain_remove "$LIBVIRT_DEFAULT_URI" "$LAB_DOM"
  LAB_DOM_DEFINED=0
  local qlog=/var/log/libvirt/qemu/$LAB_DOM.log
  if [ -f "$qlog" ]; then
    cp "$qlog" "$LAB_DIR/qemu.log" 2>/dev/null
    rm -f "$qlog"
  fi
}

lab_teardown() {
  local rc=$?
  trap - EXIT
  set +e
  [ -n "${LAB_DIR:-}" ] || return "$rc"
  [ -z "${LAB_JOB_WATCH_PID:-}" ] || touch "$LAB_DIR/jobwatch.stop"
  lab_guest_stop
  lab_guest2_stop
  if [ -n "${LAB_READER_PID:-}" ]; then
    kill "$LAB_READER_PID" 2>/dev/null
    wait "$LAB_READER_PID" 2>/dev/null
    LAB_READER_PID=""
  fi
  lab_storage_stop
  if [ "${LAB_KEEP:-0}" != 1 ] && ! grep -q " $LAB_MNT fuse" /proc/mounts; then
    rm -rf "$LAB_DIR/backing" "$LAB_DIR/vmlinuz" "$LAB_DIR/initramfs.cpio.gz"
  fi
  [ "${LAB_VERBOSE:-0}" = 1 ] && lab_log "teardown of $LAB_ID done (logs in $LAB_DIR)"
  return "$rc"
}

lab_assert_clean() {
  local bad=0
  if virsh -q list --all --name | grep -qx "$LAB_DOM"; then
    echo "lab: domain $LAB_DOM left behind" >&2; bad=1
  fi
  if [ -n "${LAB2_URI:-}" ] && virsh -q -c "$LAB2_URI" list --all --name | grep -qx "$LAB2_DOM"; then
    echo "lab: domain $LAB2_DOM left behind on $LAB2_URI" >&2; bad=1
  fi
  if grep -q " $LAB_MNT " /proc/mounts; then
    echo "lab: mount $LAB_MNT left behind" >&2; bad=1
  fi
  local pids
  pids=$(pgrep -f "$LAB_ID" || true)
  if [ -n "$pids" ]; then
    echo "lab: processes of $LAB_ID left behind: $(ps -o pid=,args= -p "$(echo $pids | tr ' ' ,)")" >&2; bad=1
  fi
  return $bad
}
