#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Counts pixels near given RGB colours in a PNG (8-bit RGB/RGBA, non-interlaced), stdlib only.
usage: png_colors.py FILE.png RRGGBB [RRGGBB...] -> one count per colour"""
import struct, sys, zlib

def decode(path):
    data = open(path, 'rb').read()
    assert data[:8] == b'\x89PNG\r\n\x1a\n', 'not a PNG'
    pos, idat, w = 8, b'', 0
    while pos < len(data):
        n, kind = struct.unpack('>I4s', data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b'IHDR':
            w, h, depth, ctype, _, _, interlace = struct.unpack('>IIBBBBB', body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, 'unsupported PNG layout'
            bpp = 3 if ctype == 2 else 4
        elif kind == b'IDAT':
            idat += body
        pos += 12 + n
    raw, stride, prev, rows = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c; pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line); prev = line
    return rows, bpp

rows, bpp = decode(sys.argv[1])
for hexc in sys.argv[2:]:
    r, g, b = (int(hexc[i:i + 2], 16) for i in (0, 2, 4))
    n = 0
    for line in rows:
        for i in range(0, len(line), bpp):
            if abs(line[i] - r) < 24 and abs(line[i + 1] - g) < 24 and abs(line[i + 2] - b) < 24: n += 1
    print(n)
