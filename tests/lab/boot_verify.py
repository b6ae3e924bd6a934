#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Regenerates what the lab guest's `probe pattern` mode wrote (tests/lab/guest/probe.c) and
checks an image against it.

    boot_verify.py RAW_IMAGE LAST_PHASE

RAW_IMAGE: the guest's disk as raw (e.g. `qemu-img convert -O raw` of the active layer).
Phases 0..LAST_PHASE were written in order.  Prints the CRC-32 of the pattern region as the
guest computes it ("LAB SUM"), and exits 1 naming the first differing block when the image does
not hold the expected bytes.
"""
import struct
import sys
import zlib

MIB = 1024 * 1024
PAT_BLOCK = 64 * 1024
PAT_BLOCKS = 512
PAT_REGION = PAT_BLOCKS * PAT_BLOCK + MIB


RAMP = bytes((k * 131) & 0xFF for k in range(PAT_BLOCK))


def block(phase: int, i: int) -> bytes:
    c = i * 7 + phase * 29 + 1
    b = bytearray(RAMP.translate(bytes((x + c) & 0xFF for x in range(256))))
    b[0:16] = b"QCLB" + struct.pack("<IQ", phase, i)
    return bytes(b)


def expected(last_phase: int) -> bytearray:
    region = bytearray(PAT_REGION)
    for phase in range(last_phase + 1):
        for i in range(PAT_BLOCKS):
            if phase > 0 and (i + phase) % (phase + 1) != 0:
                continue
            off = i * PAT_BLOCK + phase * 4096
            region[off:off + PAT_BLOCK] = block(phase, i)
    return region


def main() -> int:
    image, last_phase = sys.argv[1], int(sys.argv[2])
    want = expected(last_phase)
    with open(image, "rb") as f:
        have = f.read(PAT_REGION)
    print(f"{zlib.crc32(want):08x}")
    if have != want:
        bad = next((k for k in range(min(len(have), len(want))) if have[k] != want[k]), len(have))
        print(f"{image}: differs from phases 0..{last_phase} at byte {bad} (block {bad // PAT_BLOCK})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
