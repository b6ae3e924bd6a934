#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Byte patches for hostile qcow2 images (tests/hostile). Reads the header itself (big-endian
fields from the qcow2 specification) and rewrites single table entries.

  qcow2_patch.py IMG l2-entry N VALUE|refcount-table|copy:M   set L2 entry N of L1[0]'s table
  qcow2_patch.py IMG l1-entry N VALUE|l1-table|eof          set L1 entry N (COPIED flag added)
  qcow2_patch.py IMG refcount-of N VALUE                     set the 16-bit refcount of the cluster
                                                             that L2 entry N points at
  qcow2_patch.py IMG overlong-compressed N zlib|zstd         replace the compressed stream of L2
                                                             entry N by one that inflates to 2 clusters
  qcow2_patch.py IMG autoclear VALUE                         set the autoclear feature bits (v3)
  qcow2_patch.py IMG extensions                              print the header extensions' magics
  qcow2_patch.py IMG info                                    print the fields used here
"""
import struct
import sys
import zlib

COPIED = 1 << 63
COMPRESSED = 1 << 62
OFFSET_MASK = 0x00FFFFFFFFFFFE00


def header(f):
    f.seek(0)
    h = f.read(112)
    magic, version = struct.unpack('>II', h[0:8])
    assert magic == 0x514649FB, 'not qcow2'
    cluster_bits = struct.unpack('>I', h[20:24])[0]
    l1_size, l1_off, rt_off = struct.unpack('>IQQ', h[36:56])
    incompat = struct.unpack('>Q', h[72:80])[0] if version >= 3 else 0
    refcount_order = struct.unpack('>I', h[96:100])[0] if version >= 3 else 4
    return dict(version=version, cs=1 << cluster_bits, cluster_bits=cluster_bits, l1_size=l1_size, l1=l1_off,
                rt=rt_off, ext_l2=bool(incompat & 16), refcount_order=refcount_order)


def rd64(f, off):
    f.seek(off)
    return struct.unpack('>Q', f.read(8))[0]


def wr64(f, off, v):
    f.seek(off)
    f.write(struct.pack('>Q', v))


def main():
    path, what = sys.argv[1], sys.argv[2]
    with open(path, 'r+b') as f:
        h = header(f)
        esz = 16 if h['ext_l2'] else 8
        if what == 'info':
            print(h, 'L1[0]=%#x' % rd64(f, h['l1']))
            return
        if what == 'extensions':
            f.seek(0)
            first = f.read(h['cs'])
            pos = struct.unpack('>I', first[100:104])[0] if h['version'] >= 3 else 72
            end = struct.unpack('>Q', first[8:16])[0] or h['cs']
            while pos + 8 <= end:
                magic, length = struct.unpack('>II', first[pos:pos + 8])
                if magic == 0:
                    break
                print('%#010x' % magic)
                pos += 8 + ((length + 7) & ~7)
            return
        if what == 'autoclear':
            assert h['version'] >= 3, 'v2 images have no autoclear field'
            wr64(f, 88, int(sys.argv[3], 0))
            return
        n = int(sys.argv[3])
        arg = sys.argv[4]
        if what == 'l1-entry':
            f.seek(0, 2)
            eof = f.tell()
            v = {'l1-table': h['l1'], 'eof': (eof + 16 * h['cs']) & ~(h['cs'] - 1)}.get(arg)
            v = int(arg, 0) if v is None else v
            wr64(f, h['l1'] + 8 * n, v | COPIED)
            return
        l2 = rd64(f, h['l1']) & OFFSET_MASK
        assert l2, 'L1[0] has no L2 table'
        if what == 'l2-entry':
            if arg == 'refcount-table':
                v = h['rt'] | COPIED
            elif arg.startswith('copy:'):
                v = rd64(f, l2 + esz * int(arg[5:]))
            else:
                v = int(arg, 0)
            wr64(f, l2 + esz * n, v)
            if h['ext_l2'] and arg.startswith('copy:'):
                wr64(f, l2 + esz * n + 8, rd64(f, l2 + esz * int(arg[5:]) + 8))
        elif what == 'refcount-of':
            assert h['refcount_order'] == 4, 'only 16-bit refcounts'
            cluster = (rd64(f, l2 + esz * n) & OFFSET_MASK) // h['cs']
            assert cluster, 'L2 entry is unallocated'
            per_block = h['cs'] // 2
            block = rd64(f, h['rt'] + 8 * (cluster // per_block)) & ~(h['cs'] - 1)
            f.seek(block + 2 * (cluster % per_block))
            f.write(struct.pack('>H', int(arg, 0)))
        elif what == 'overlong-compressed':
            e = rd64(f, l2 + esz * n)
            assert e & COMPRESSED, 'entry is not compressed'
            x = 62 - (h['cluster_bits'] - 8)
            data = bytes((i * 7) & 0xFF for i in range(2 * h['cs']))
            if arg == 'zlib':
                c = zlib.compressobj(9, zlib.DEFLATED, -12)
                stream = c.compress(data) + c.flush()
            else:
                import subprocess
                stream = subprocess.run(['zstd', '-q', '-c', '--no-check'], input=data,
                                        stdout=subprocess.PIPE, check=True).stdout
            f.seek(0, 2)
            off = (f.tell() + 511) & ~511
            f.seek(off)
            f.write(stream + b'\0' * (-len(stream) % 512))
            sectors = (len(stream) + 511) // 512
            assert sectors - 1 < (1 << (h['cluster_bits'] - 8)), 'stream too long for a descriptor'
            wr64(f, l2 + esz * n, COMPRESSED | ((sectors - 1) << x) | off)
        else:
            sys.exit('unknown patch ' + what)


if __name__ == '__main__':
    main()
