#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Checks, after a merge, that the disk image holds what the lab guest wrote.

    live_verify.py IMAGE FILL_MIB CONSOLE_LOG

IMAGE is the raw disk the guest ran on (read through the lab mount after the domain is shut
down).  The probe (tests/lab/guest/probe.c) wrote, before the merge, FILL_MIB MiB from offset 0:
every MiB is the pattern byte[i] = (i * 131 + 7) & 0xff with its first 8 bytes replaced by the
MiB index (little-endian).  During and after the merge it wrote 4 KiB probes into the last
64 MiB of the disk, slot seq % 4096, first 8 bytes = seq; every "P seq ..." console line is a
completed O_DSYNC write.  So for every slot, the stored seq must be >= the largest completed seq
of that slot and congruent to it (a later write may have completed before the shutdown without
its line being printed).  Prints one line per problem (at most 10) and exits 1 on any.
"""
import re
import struct
import sys

MIB = 1024 * 1024
PROBE_AREA = 64 * MIB
PROBE_SLOTS = 4096
PROBE_BYTES = 4096


def main() -> int:
    image, fill_mib, console = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    pattern = bytearray((i * 131 + 7) & 0xFF for i in range(MIB))
    problems = []
    with open(image, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(0)
        for m in range(fill_mib):
            data = f.read(MIB)
            expect = struct.pack("<q", m) + pattern[8:]
            if data != expect:
                bad = next(i for i in range(min(len(data), MIB)) if i >= len(data) or data[i] != expect[i]) \
                    if len(data) == MIB else len(data)
                problems.append(f"{image}: fill MiB {m} differs (first difference at byte {bad})")
                if len(problems) >= 10:
                    break
        last = {}
        seq_re = re.compile(r"^P (\d+) ")
        with open(console, "r", errors="replace") as c:
            for line in c:
                mo = seq_re.match(line.strip())
                if mo:
                    seq = int(mo.group(1))
                    slot = seq % PROBE_SLOTS
                    if seq > last.get(slot, -1):
                        last[slot] = seq
        area = size - PROBE_AREA
        for slot, seq in sorted(last.items()):
            f.seek(area + slot * PROBE_BYTES)
            (stored,) = struct.unpack("<q", f.read(8))
            if stored < seq or stored % PROBE_SLOTS != slot:
                problems.append(f"{image}: probe slot {slot}: holds seq {stored}, "
                                f"completed write had seq {seq}")
                if len(problems) >= 10:
                    break
    for p in problems[:10]:
        print(p)
    if problems:
        return 1
    print(f"{image}: {fill_mib} MiB of fill and {len(last)} probe slots "
          f"(max seq {max(last.values()) if last else -1}) intact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
