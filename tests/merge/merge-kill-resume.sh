#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# merge.kill_resume: a kill matrix on real qcommit processes. Each trial runs `qcommit merge TOP
# --rebase CHILD` (or a --delete variant) over BELOW <- BASE <- TOP <- CHILD (over 1 GiB to
# merge), SIGKILLs it at chosen moments (its re-runs too, in a sequence), runs the same command
# to completion and checks what the merge promises:
#   after every kill: TOP's and CHILD's views equal the copies saved before the first run; CHILD
#     is backed by TOP or BASE; qemu-img check finds no corruption in BASE (leaks allowed); the
#     checkpoint beside BASE exists, or BASE is byte-identical (nothing is written before it);
#   the run that completes: exit 0, a result event with "resumed": true exactly when a killed run
#     had left a checkpoint, BASE shows TOP's saved view, qemu-img check BASE exits 0 (the leaks
#     repaired), CHILD's view unchanged and backed by BASE, no checkpoint left, with --delete TOP
#     gone.
# The chain: BELOW (raw, 1280 MiB of 0xb7) backs BASE (512 MiB), smaller than TOP (1280 MiB): the
# merge grows BASE, and where TOP provides nothing in the grown range TOP reads zeros (nothing is
# read past the end of a backing file), as the grown BASE must, never BELOW's bytes. TOP holds
# ~1 GiB: 5120 scattered 64 KiB clusters below 512 MiB, eight 92 MiB runs in the grown range with
# gaps, zero clusters over data in both. CHILD has 64 partial-cluster writes all over the disk.
#
# Moments: named ones, where strace injects SIGKILL right before the Nth system call of a kind (on
# a given file), listed with the trials below; timed ones: 1 ms and 5 ms after the start, and at
# fractions of the copy stratified over it (timed from the run's first progress event of the
# copy), each followed by a kill of the resumed run somewhere in its own copy.
# Counts are asserted: every named kill hits a running process, most timed ones do, the run that
# completes says "resumed": true after every kill that left a checkpoint and false after the
# others, and the matrix includes kills before the first write and resumes past a window.
#
# usage: merge-kill-resume.sh QCOMMIT        (needs qemu-img, qemu-io, jq, strace)
# KILL_TIMED=N runs N timed trials instead of 8 (ctest: 5); KILL_SEED=N with the same KILL_TIMED
# repeats the timed kills of an earlier run (same fractions).
set -euo pipefail
QCOMMIT=$(realpath "$1")
. "$(dirname "$(realpath "$0")")/../lib/test.sh"
setup merge.kill_resume
for tool in qemu-img qemu-io jq strace; do command -v "$tool" >/dev/null || fail "$tool not found"; done
pid=
on_exit '[[ -z ${pid:-} ]] || kill -9 "$pid" 2>/dev/null'
t_begin=$(date +%s.%N)
seed=${KILL_SEED:-$RANDOM}
RANDOM=$seed
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
tfail() { soft_fail "[$tname] $*"; }  # a failure of trial $tname

MiB=$((1024 * 1024))
CP=.base.qcow2.qcommit-merge
# Setup only: qemu-io without flushes (the images are read back through the page cache).
unsafe_io() { qemu-io -t unsafe "$@" >/dev/null; }

# ---------------------------------------------------------------------------------------------
# The chain.
t0=$(now)
qemu-img create -q -f raw below.raw 1280M
unsafe_io -f raw -c "write -P 0xb7 0 1280M" below.raw
qemu-img create -q -f qcow2 -b below.raw -F raw base.qcow2 512M
unsafe_io -f qcow2 -c "write -P 0x11 0 64M" -c "write -z 64M 32M" base.qcow2
qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 top.qcow2 1280M
args=()
# i * odd constant mod 8192 is a permutation: 5120 distinct clusters below 512 MiB.
for ((i = 0; i < 5120; i++)); do args+=(-c "write -P $((i % 251 + 1)) $(((i * 2654435761 % 8192) * 65536)) 64k"); done
for ((k = 0; k < 8; k++)); do args+=(-c "write -P $((0x40 + k)) $((512 * MiB + k * 96 * MiB)) 92M"); done
args+=(-c "write -z 32M 8M" -c "write -z 1200M 16M")
unsafe_io -f qcow2 "${args[@]}" top.qcow2
qemu-img create -q -f qcow2 -b top.qcow2 -F qcow2 child.qcow2
args=()
for ((i = 0; i < 64; i++)); do args+=(-c "write -P $((0xc0 + i % 50)) $(((i * 20 + 3) * MiB + 4096 * i)) 256k"); done
unsafe_io -f qcow2 "${args[@]}" child.qcow2
top_data=$(qemu-img map --output=json top.qcow2 | jq '[.[] | select(.depth == 0 and .data) | .length] | add')
((top_data >= 1024 * MiB)) || fail "setup: TOP holds only $((top_data / MiB)) MiB"
qemu-img convert -t unsafe -O raw top.qcow2 top.view &
qemu-img convert -t unsafe -O raw child.qcow2 child.view
wait $!
# The grown range's gaps read zeros in TOP (BELOW is not visible past BASE's end).
cmp -s -n $((4 * MiB)) -i $((1276 * MiB)) top.view /dev/zero || fail "setup: TOP's tail is not zeros"
# The pristine copies live in a directory of their own: a copy of the child beside TOP would be
# an image backed by TOP, a user that --delete refuses to orphan.
mkdir -p orig
cp base.qcow2 orig/base.orig
cp child.qcow2 orig/child.orig
ln top.qcow2 orig/top.orig # TOP itself is only read; --delete unlinks this name
top_sum=$(sha256sum <orig/top.orig)
echo "setup: TOP holds $((top_data / MiB)) MiB of data, $(since "$t0") s"

# compare_views WHAT VIEW IMAGE [WHAT VIEW IMAGE]...: qemu-img compare of saved raw views with
# the images' views, side by side; each mismatch fails with WHAT and the offset.
compare_views() {
  local pids=() what=() i
  for ((i = 0; $#; i++)); do
    qemu-img compare -f raw -F qcow2 "$2" "$3" >"cmp$i.out" 2>&1 &
    pids+=($!)
    what+=("$1")
    shift 3
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || tfail "$label: ${what[$i]}: $(head -c 200 "cmp$i.out")"
  done
}

backing_of() {
  local b
  b=$(qemu-img info --output=json "$work/$1" | jq -r '."full-backing-filename" // empty')
  [[ -n $b ]] && realpath -m "$b"
  return 0
}
check_base() { # $1: the exit codes allowed, as a regex; sets last_leaks
  local rc=0 c l
  qemu-img check --output=json base.qcow2 >chk.json 2>chk.err || rc=$?
  c=$(jq '.corruptions // 0' chk.json 2>/dev/null || echo '?')
  l=$(jq '.leaks // 0' chk.json 2>/dev/null || echo '?')
  [[ $rc =~ ^($1)$ && $c == 0 ]] || tfail "$label: qemu-img check BASE exit $rc, corruptions $c: $(head -c 300 chk.err)"
  [[ $l =~ ^[0-9]+$ ]] && last_leaks=$l || last_leaks=0
}

# ---------------------------------------------------------------------------------------------
# Counters.
kills=0 hits=0 misses=0 named_kills=0 named_hits=0
left_checkpoint=0 left_untouched=0 left_complete=0 leaky_kills=0
resumes_expected=0 resumes_seen=0 fresh_runs=0 resumed_past_zero=0 completed=0
declare -A phase_count=()

reset_images() {
  rm -f "$CP" "$CP.tmp" run.json run.err final.json final.err
  cp orig/base.orig base.qcow2
  cp orig/child.orig child.qcow2
  ln -f orig/top.orig top.qcow2
}

# One run of the merge, killed as `spec` says:
#   after:SECONDS               SIGKILL SECONDS after the start
#   copy:FRACTION               SIGKILL when FRACTION of this run's copy should be done: its
#                               first progress event of the copy gives the bytes it copies, the
#                               uninterrupted run how long copying takes here
#   sys:CALLS:FILE:N            strace injects SIGKILL before the Nth of the system calls CALLS
#                               (comma-separated) that touch FILE (any file if empty)
# Sets killed_running (1 when it died of the kill before printing its result) and phase.
run_killed() {
  local spec=$1 rc=0 line delay calls file n paths=() decile
  : >run.json # both there even if the kill comes before the shell's redirection
  : >run.err
  kills=$((kills + 1))
  case $spec in
    after:*)
      "${CMD[@]}" >run.json 2>run.err &
      pid=$!
      sleep "${spec#after:}"
      kill -9 "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || rc=$?
      ;;
    copy:*)
      rm -f out.fifo
      mkfifo out.fifo
      "${CMD[@]}" >out.fifo 2>run.err &
      pid=$!
      exec {fifo}<out.fifo
      while IFS= read -r line <&"$fifo"; do
        printf '%s\n' "$line" >>run.json
        if [[ $line =~ \"phase\":\ \"copy\",\ \"done\":\ ([0-9]+),\ \"total\":\ ([0-9]+) ]] &&
          ((BASH_REMATCH[2] > 0)); then
          delay=$(awk -v f="${spec#copy:}" -v b="${BASH_REMATCH[2]}" -v B="$copy_bytes" -v T="$copy_seconds" \
            'BEGIN { printf "%.3f", f * T * b / B }')
          sleep "$delay"
          kill -9 "$pid" 2>/dev/null || true
          break
        fi
      done
      # The rest (of a run that finished first); bash's "Killed" job notice goes to /dev/null.
      {
        cat <&"$fifo" >>run.json
        exec {fifo}<&-
        wait "$pid"
      } 2>/dev/null || rc=$?
      ;;
    sys:*)
      named_kills=$((named_kills + 1))
      IFS=: read -r _ calls file n <<<"$spec"
      # strace matches a path argument as spelled and a descriptor by its absolute path.
      [[ -n $file ]] && paths=(-P "$file" -P "./$file" -P "$work/$file")
      strace -f -qq -o /dev/null "${paths[@]}" -e trace="$calls" -e inject="$calls:signal=SIGKILL:when=$n" \
        "${CMD[@]}" >run.json 2>run.err &
      pid=$!
      wait "$pid" 2>/dev/null || rc=$?
      ;;
  esac
  pid=
  killed_running=0
  if [[ $rc == 137 ]] && ! grep -q '"event": "result"' run.json; then
    killed_running=1
    hits=$((hits + 1))
    [[ $spec == sys:* ]] && named_hits=$((named_hits + 1))
  else
    misses=$((misses + 1))
    [[ $spec == sys:* ]] &&
      tfail "$label: the named kill did not hit a running merge (exit $rc): $(grep -v '^strace: Requested path' run.err | head -c 300)"
  fi
  # What the run had got to (its last event), for the summary.
  phase=$(jq -rs 'map(select(.event == "progress")) | last // {} |
                  if .phase == null then "start"
                  elif .phase == "copy" and .total > 0 then "copy \((.done * 10 / .total | floor) * 10)%"
                  else .phase end' run.json 2>/dev/null || echo '?')
  if [[ $spec == copy:* && $phase == copy* ]]; then # when in its copy, rather than its last report
    decile=$(awk -v f="${spec#copy:}" 'BEGIN { printf "%d", int(f * 10) * 10 }')
    phase="copy, $decile-$((decile + 10))% of its time"
  fi
}

# The state a kill left. Sets state: resume (a checkpoint: the next run must resume), fresh
# (nothing written: the next run starts over), complete (the job was done before the kill).
after_kill() {
  local child_backing
  child_backing=$(backing_of child.qcow2)
  if [[ -e top.qcow2 ]]; then
    compare_views "TOP's view changed" top.view top.qcow2 "CHILD's view changed" child.view child.qcow2
  else
    ((deleting)) || tfail "$label: TOP is gone without --delete"
    compare_views "CHILD's view changed" child.view child.qcow2
  fi
  [[ $child_backing == "$work/top.qcow2" || $child_backing == "$work/base.qcow2" ]] ||
    tfail "$label: CHILD's backing file is '$child_backing'"
  check_base '0|3'
  ((last_leaks > 0)) && leaky_kills=$((leaky_kills + 1))
  if [[ -e $CP ]]; then
    state=resume
    left_checkpoint=$((left_checkpoint + 1))
    [[ $child_backing == "$work/base.qcow2" ]] && phase="switch (CHILD rebased)"
    [[ -e top.qcow2 ]] || phase="delete (TOP gone)"
  elif [[ $child_backing == "$work/top.qcow2" ]]; then
    state=fresh
    left_untouched=$((left_untouched + 1))
    cmp -s base.qcow2 orig/base.orig || tfail "$label: BASE was written but no checkpoint is there"
  else
    state=complete
    left_complete=$((left_complete + 1))
  fi
  phase_count["$phase"]=$((${phase_count["$phase"]:-0} + 1))
  echo "  $label: $phase, $([[ $killed_running == 1 ]] && echo killed || echo "not killed (had finished)"), $state, BASE leaks $last_leaks"
}

# The merge is done: BASE shows TOP's view, CHILD is on BASE, nothing left behind.
verify_done() {
  compare_views "BASE's view is not TOP's" top.view base.qcow2 "CHILD's view changed" child.view child.qcow2
  check_base '0'
  [[ $(backing_of child.qcow2) == "$work/base.qcow2" ]] || tfail "$label: CHILD's backing file is '$(backing_of child.qcow2)', not BASE"
  [[ -e $CP || -e $CP.tmp ]] && tfail "$label: checkpoint left behind"
  if ((deleting)); then
    [[ ! -e top.qcow2 ]] || tfail "$label: TOP not deleted"
  else
    [[ -e top.qcow2 ]] || tfail "$label: TOP deleted without --delete"
  fi
  completed=$((completed + 1))
}

# The same command to completion.
run_final() {
  local expect=$1 result resumed from
  "${CMD[@]}" >final.json 2>final.err || { tfail "$label: exit $?: $(head -c 400 final.err)"; return; }
  result=$(jq -c 'select(.event == "result")' final.json 2>/dev/null || true)
  [[ -n $result && $(wc -l <<<"$result") == 1 ]] || { tfail "$label: no result event: $(tail -c 300 final.json)"; return; }
  resumed=$(jq -r '.resumed' <<<"$result")
  from=$(jq -r '."resumed-from"' <<<"$result")
  [[ $resumed == true ]] && resumes_seen=$((resumes_seen + 1))
  if [[ $expect == resume ]]; then
    resumes_expected=$((resumes_expected + 1))
    [[ $resumed == true ]] || tfail "$label: a killed run left a checkpoint, but the result says \"resumed\": $resumed"
  else
    fresh_runs=$((fresh_runs + 1))
    [[ $resumed == false ]] || tfail "$label: nothing to resume, but the result says \"resumed\": $resumed"
  fi
  [[ $resumed == true && $from -gt 0 ]] && resumed_past_zero=$((resumed_past_zero + 1))
  echo "  $label: completed, resumed $resumed from $((from / MiB)) MiB, leaks repaired $(jq '."leaks-repaired"' <<<"$result"), $(jq '."total-seconds"' <<<"$result") s"
  verify_done
}

# trial NAME DELETE SPEC...: fresh images, the runs killed as the SPECs say, then a run to
# completion (unless a kill came after the job was done), all verified; with no SPEC, a whole run.
trial() {
  tname=$1 deleting=$2
  shift 2
  local t0 k=0
  t0=$(now)
  reset_images
  CMD=("$QCOMMIT" merge top.qcow2 --rebase child.qcow2 --budget off --output=json)
  # The re-run after TOP is gone finds BASE by name: the same command names it from the start.
  ((deleting)) && CMD+=(--base base.qcow2 --delete)
  echo "trial $tname$( ((deleting)) && echo ' (--delete)'):"
  state=fresh
  for spec in "$@"; do
    k=$((k + 1))
    label="kill $k ($spec)"
    run_killed "$spec"
    after_kill
    [[ $state == complete ]] && break
  done
  # Also after a failure: whether the re-run repairs what the kill left is worth knowing.
  label="final run"
  if [[ $state == complete ]]; then verify_done; else run_final "$state"; fi
  echo "  ($(since "$t0") s)"
}

# ---------------------------------------------------------------------------------------------
# An uninterrupted run first (and how long a whole merge takes here).
t_run=$(now)
trial uninterrupted 0
copy_bytes=$(jq -s 'map(select(.event == "progress" and .phase == "copy")) | first | .total' final.json)
copy_seconds=$(jq -s 'map(select(.event == "result")) | first | ."copy-seconds"' final.json)
[[ $copy_bytes =~ ^[1-9][0-9]*$ && $copy_seconds =~ ^[0-9.]+$ ]] ||
  fail "the uninterrupted run reported no copy to time kills by: $(tail -c 300 final.json)"
# The first run here is the slowest (cold caches: it took 3.5 s where later whole copies took
# 2.5-2.9 s, and kills timed by it came after the job); the copy time is the faster of two runs.
trial uninterrupted 0
copy_seconds=$(jq -s --argjson t "$copy_seconds" 'map(select(.event == "result")) | first | [."copy-seconds", $t] | min' final.json)
echo "uninterrupted merge: $(since "$t_run") s for two, copying $((copy_bytes / MiB)) MiB in $copy_seconds s at best (kill seed $seed, KILL_TIMED=${KILL_TIMED:-8})"

# Timed kills: the first kill of each timed trial at a fraction of the copy stratified over
# [0, 1) with jitter, the second one, in the run that resumes, anywhere in its own copy.
TIMED=${KILL_TIMED:-8}
first=() second=()
for ((i = 0; i < TIMED; i++)); do
  first+=("copy:$(awk -v i="$i" -v n="$TIMED" -v r="$RANDOM" 'BEGIN { printf "%.3f", (i + r / 32768) / n }')")
  second+=("copy:$(awk -v r="$RANDOM" 'BEGIN { printf "%.3f", r / 32768 }')")
done

# Named moments.
W="pwrite64,pwritev,pwritev2"     # writes through a descriptor
B="ftruncate,fallocate,$W"        # anything that changes BASE's file
R="rename,renameat,renameat2"     # the checkpoint's versions are renamed into place
U="unlink,unlinkat"
trial very-start 0 "after:0.001" "after:0.005"
trial first-checkpoint 0 "sys:$R::1"                       # nothing written yet
trial grow 0 "sys:$B:base.qcow2:1"                          # first change to BASE: the grow
trial grow-commit 0 "sys:$W:base.qcow2:3"                   # inside the grow's commit
trial window-checkpoint 0 "sys:$R::2" "sys:$B:base.qcow2:1" # a window written, not checkpointed;
                                                            # then the resumed run's first write
trial second-window-checkpoint 0 "sys:$R::3"                # resumes past the first window
trial switch 0 "sys:$W:child.qcow2:1"                       # before CHILD's header is rewritten
trial checkpoint-removal 0 "sys:$U:$CP:1"                   # CHILD rebased, checkpoint still there
trial delete 1 "sys:$U:top.qcow2:1"                         # before TOP is unlinked
trial after-delete 1 "sys:$U:$CP:1"                         # TOP gone, checkpoint still there
for ((i = 0; i < TIMED; i++)); do
  trial "timed-$i" $((i % 4 == 3)) "${first[$i]}" "${second[$i]}"
done

# ---------------------------------------------------------------------------------------------
tname=summary
[[ "$(sha256sum <orig/top.orig)" == "$top_sum" ]] || tfail "TOP's file was modified"
timed_kills=$((kills - named_kills))
timed_hits=$((hits - named_hits))
((named_hits == named_kills)) || tfail "$((named_kills - named_hits)) of $named_kills named kills missed"
# A timed kill misses when the run was done before it: a resumed run with little left to copy.
((timed_hits * 3 >= timed_kills * 2)) || tfail "only $timed_hits of $timed_kills timed kills hit a running merge"
((resumes_seen == resumes_expected)) || tfail "$resumes_seen results said resumed, $resumes_expected runs followed a checkpoint"
# Eight named kills leave a checkpoint (all but first-checkpoint's), the timed ones more.
((resumes_expected >= 8)) || tfail "only $resumes_expected runs resumed an interrupted one"
((left_untouched >= 1)) || tfail "no kill came before the first write"
((resumed_past_zero >= 1)) || tfail "no run resumed past a committed window"
summary="kills $kills (named $named_kills), hit a running merge $hits, after the job $misses;"
summary+=" left a checkpoint $left_checkpoint, nothing written $left_untouched, job done $left_complete,"
summary+=" leaks after $leaky_kills; runs resumed $resumes_seen of $resumes_expected expected"
summary+=" ($resumed_past_zero past a committed window), fresh $fresh_runs; completed $completed merges"
echo "phases hit:"
for p in "${!phase_count[@]}"; do echo "  ${phase_count[$p]} x $p"; done | sort -k3
echo "merge.kill_resume: $summary; $(since "$t_begin") s"
finish "merge.kill_resume: OK"
