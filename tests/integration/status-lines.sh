#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# cli.status_lines: what `qcommit status` says under its table of a job that escaped governance,
# a mirror that does not converge (and its converge floor), the time to govern and a floor, from
# the status of a stand-in qcommitd (a socket that answers one canned status line, the member
# names of plugin/daemon/control.cpp); and nothing of that for a job that needs none of it.
# usage: status-lines.sh QCOMMIT
set -euo pipefail
. "$(dirname "$0")/lib.sh"
QCOMMIT=$(realpath "$1")
setup cli.status_lines

python3 - >answer.json <<'PY'
import json
jobs = [
    {"id": 1, "domain": "vm1", "disk": "vda", "type": "active-commit", "target": "/s/base.qcow2",
     "storage": "dev:39", "pool": "", "budget_ms": 20, "speed_bytes_per_s": 8388608,
     "window_bytes": 524288, "backlog_bytes": 0, "latency_p99_ms": 12.5, "bytes_left": 209715200,
     "eta_s": None, "phase": "steady", "ready": False, "probe": "local",
     "time_to_govern_ms": 41.5, "found_by": "event", "late_adoption": True,
     "copied_before_governed_bytes": 50331648,
     "escaped": True, "escaped_bytes": 536870912, "escape_cost_s": 10.7, "escape_held": True,
     "bdi_limit": "on: bdi 0:39 max_bytes 32.6 MiB, strict_limit 1",
     "converging": False, "added_bytes_per_s": 4194304, "converge_floor_bytes_per_s": 8388608,
     "floor": "QEMU mirror: 1 MiB requests (16 in flight) at cache=none"},
    {"id": 2, "domain": "vm2", "disk": "vdb", "type": "commit", "target": "/s/b2.qcow2",
     "storage": "dev:39", "pool": "", "budget_ms": 20, "speed_bytes_per_s": 4194304,
     "window_bytes": 524288, "backlog_bytes": 0, "latency_p99_ms": 9.0, "bytes_left": 1048576,
     "eta_s": 3, "phase": "steady", "ready": False, "probe": "local",
     "escaped": False, "converging": None, "added_bytes_per_s": 0,
     "converge_floor_bytes_per_s": 0, "floor": ""},
]
print(json.dumps({"ok": True, "connected": True, "jobs": jobs, "released": []}))
PY
socket_stub "$work/qcd.sock" answer.json

"$QCOMMIT" status --socket "$work/qcd.sock" >out.txt 2>err.txt || fail "status exited $?: $(cat err.txt)"
expect() {
  grep -qxF -- "$1" out.txt || fail "no line \"$1\" in: $(cat out.txt)"
}
expect "governed: vm1 vda: 41.5ms after it was found (event), late adoption: 48.0MiB copied unpaced"
expect "escaped: vm1 vda: 512.0MiB dirty, about 10.7s of storage; held at the floor; kernel dirty limit on: bdi 0:39 max_bytes 32.6 MiB, strict_limit 1"
expect "converging: vm1 vda: no, its work left grows; the guests add 4.0MiB/s; converge floor 8.0MiB/s until ready, above the budget where need be"
expect "floor: vm1 vda: QEMU mirror: 1 MiB requests (16 in flight) at cache=none"
# The job that needs none of it gets none of those lines.
grep -E '^(governed|escaped|converging|floor): vm2 ' out.txt &&
  fail "lines for vm2, which escaped nothing and converges: $(cat out.txt)"
echo "cli.status_lines: OK"
