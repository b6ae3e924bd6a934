#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""The integration test's own QMP client (independent of qcommit's): one command, its "return"
value on stdout as JSON.  usage: qmp.py SOCKET COMMAND [ARGUMENTS-JSON]"""
import json
import socket
import sys


def main():
    sock, cmd = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sock)
    f = s.makefile("rw")

    def message():
        while True:
            line = f.readline()
            if not line:
                sys.exit(f"{sock}: connection closed")
            m = json.loads(line)
            if "event" not in m:
                return m

    if "QMP" not in message():
        sys.exit(f"{sock}: no greeting")
    for c, a in (("qmp_capabilities", None), (cmd, args)):
        req = {"execute": c}
        if a is not None:
            req["arguments"] = a
        f.write(json.dumps(req) + "\n")
        f.flush()
        r = message()
        if "error" in r:
            sys.exit(f"{sock}: {c}: {r['error'].get('desc')}")
    print(json.dumps(r["return"]))


main()
