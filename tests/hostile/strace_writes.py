#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Judges an `strace -f -e trace=open,openat,creat` log: every opening that may write (O_WRONLY,
O_RDWR, O_CREAT, O_TRUNC) must be one a planted symlink, FIFO or hard link cannot turn against
the user (common/safe_file.h):

  - O_TMPFILE (an unnamed file), or O_CREAT|O_EXCL (a new file: never follows a symlink);
  - a reopening of an open descriptor (/proc/self/fd/N, /proc/PID/fd/N);
  - O_NOFOLLOW on a name the user gave as an output (--allowed-output);
  - a name the user gave as an image (--allowed), opened as it was named;
  - a device node under /dev (a terminal, /dev/null, /dev/kvm).
Openings that failed are not judged: they touched nothing.

usage: strace_writes.py LOG [--allowed PATH]... [--allowed-output PATH]...
Prints each offending line and exits 1 when there is one; exits 0 otherwise. Exit 2 when the log
shows no opening at all (the trace did not work).
"""
import os
import re
import sys

WRITE_FLAGS = ('O_WRONLY', 'O_RDWR', 'O_CREAT', 'O_TRUNC')
CALL = re.compile(r'^(?:\[pid\s+\d+\]\s+|\d+\s+)?(open|openat|creat)\((.*)\)\s+=\s+(-?\d+)')
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def parse(line):
    m = CALL.match(line)
    if not m:
        return None
    call, args, result = m.groups()
    q = QUOTED.search(args)
    if not q:
        return None
    path = bytes(q.group(1), 'utf-8').decode('unicode_escape')
    rest = args[q.end():]
    flags = set(re.findall(r'O_[A-Z_]+', rest))
    if call == 'creat':
        flags |= {'O_CREAT', 'O_WRONLY', 'O_TRUNC'}
    return call, path, flags, int(result)


def acceptable(path, flags, allowed, outputs):
    if 'O_TMPFILE' in flags:
        return True
    if 'O_CREAT' in flags and 'O_EXCL' in flags:
        return True
    if re.fullmatch(r'/proc/(self|\d+)/fd/\d+', path):
        return True
    if path.startswith('/dev/') and not path.startswith('/dev/shm/'):
        return True  # device nodes (/dev/null, a terminal, /dev/kvm): nothing can be planted there
    if path in outputs or os.path.abspath(path) in outputs:
        return 'O_NOFOLLOW' in flags
    if path in allowed or os.path.abspath(path) in allowed:
        return 'O_CREAT' not in flags
    return False


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    log, allowed, outputs = argv[0], set(), set()
    i = 1
    while i < len(argv):
        if argv[i] == '--allowed':
            allowed.add(argv[i + 1])
            allowed.add(os.path.abspath(argv[i + 1]))
        elif argv[i] == '--allowed-output':
            outputs.add(argv[i + 1])
            outputs.add(os.path.abspath(argv[i + 1]))
        else:
            print(f'unknown argument {argv[i]}', file=sys.stderr)
            return 2
        i += 2
    seen, bad = 0, []
    with open(log, encoding='utf-8', errors='replace') as f:
        for line in f:
            p = parse(line)
            if not p:
                continue
            seen += 1
            call, path, flags, result = p
            if not any(w in flags for w in WRITE_FLAGS) or result < 0:
                continue  # reads only, or an opening that failed (it touched nothing)
            if not acceptable(path, flags, allowed, outputs):
                bad.append(line.rstrip())
    if seen == 0:
        print(f'{log}: no open/openat/creat in the trace', file=sys.stderr)
        return 2
    for b in bad:
        print(f'unsafe opening for writing: {b}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
