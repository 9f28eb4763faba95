#!/usr/bin/env python3
"""Sends N calls of a Lua script to a redis-server, pipelined, as the service
sends them: `bucket.lua`'s packed arguments (src/store/redis/script_args.rs)
need bytes a shell argument cannot hold, so redis-benchmark cannot.

    script_calls.py PORT SHA KIND N [PIPELINE]

KIND: `token_bucket` (one plain decision: burst and rate 10^9 a second, one
hot key), `minimal` (the same decision's numbers as decimals, for
integration/minimal-bucket.lua).
"""
import socket
import struct
import sys


def command(*parts):
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        if isinstance(p, str):
            p = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def token_bucket_group():
    # n, then the flags (hash layout, charge, attempt, fixed, sliding,
    # calendar), needed, deducted, margin ms, then the bucket's capacity,
    # tokens per unit, unit seconds, max debt (-1: the burst)
    return struct.pack("<HBBBBBBddd", 1, 0, 0, 0, 0, 0, 0, 1, 1, 1000) + struct.pack(
        "<dddd", 1e9, 1e9, 1, -1
    )


def main():
    port, sha, kind, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    pipeline = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    if kind == "token_bucket":
        call = command("EVALSHA", sha, "1", "rls:{hot}:k", token_bucket_group())
    elif kind == "minimal":
        call = command("EVALSHA", sha, "1", "rls:{hot}:k", "1", "1", "1", "1000", "0",
                       "1000000000", "1000000000", "1", "-1")
    else:
        sys.exit(f"unknown kind {kind}")
    s = socket.create_connection(("127.0.0.1", port))
    f = s.makefile("rb")
    sent = 0
    while sent < n:
        batch = min(pipeline, n - sent)
        s.sendall(call * batch)
        for _ in range(batch):
            read_reply(f)
        sent += batch


def read_reply(f):
    line = f.readline()
    kind, rest = line[:1], line[1:].strip()
    if kind == b"-":
        sys.exit(f"error: {rest.decode()}")
    if kind == b"*":
        for _ in range(int(rest)):
            read_reply(f)
    elif kind == b"$" and int(rest) >= 0:
        f.read(int(rest) + 2)


if __name__ == "__main__":
    main()
