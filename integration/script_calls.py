#!/usr/bin/env python3
"""Sends N calls of a Lua script to a redis-server, pipelined, as the service
sends them: `bucket.lua`'s packed arguments (src/store/redis/script_args.rs)
hold bytes a shell argument cannot, so redis-benchmark cannot send them.

    script_calls.py PORT SHA KIND N [--pipeline P] [--spread K] [--batch B]

KIND, one decision of one bucket (burst and rate 10^9 a second):
  token_bucket   plain
  dedupe         an attempt's start, a fresh id per call
  dedupe_repeat  an attempt's start, always the same id (repeats)
  reserve        a reservation's start, a fresh id per call
  fixed_window   a plain fixed-window decision (10^9 an hour)
  minimal        the plain decision's numbers as decimals, for
                 integration/minimal-bucket.lua
  minimal_fixed_window, minimal_dedupe
                 the same for integration/minimal-fixed-window.lua and
                 integration/minimal-dedupe.lua (a fresh id per call)
  sliding_window, calendar (today, UTC), charge (an overdraft's charge)
                 those kinds' plain decisions, for bucket.lua
  slots          a concurrency slot's start, a fresh id per call, for
                 src/store/redis/slots.lua
  minimal_sliding_window, minimal_calendar, minimal_charge,
  minimal_reserve, minimal_slots
                 the same for integration/minimal-*.lua
  ratelimit_counter
                 no script (SHA unused): a fixed window counted as
                 envoyproxy/ratelimit counts it and the service sends it
                 (src/store/redis/counter.rs), INCRBY key 1 + EXPIRE key
                 3600, two replies a call
--spread K: each call's key drawn from K (default: one hot key).
--batch B: B decisions per call (SHA must be the batch script, bucket.lua
behind `#!lua flags=allow-cross-slot-keys`), each on its own key.
"""
import argparse
import random
import socket
import struct
import sys
import time


def bulk(p):
    if isinstance(p, str):
        p = p.encode()
    return b"$%d\r\n%s\r\n" % (len(p), p)


def fixed_window_group():
    """A plain fixed-window decision: a limit of 10^9 an hour."""
    out = struct.pack("<HBBBBBBddd", 1, 0, 0, 0, 1, 0, 0, 1, 1, 1000)
    return out + struct.pack("<dddd", 1e9, 1e9, 3600, -1)


def window_group(flag, a1, a2, a3, a4):
    """A window's decision: flag 'sliding' or 'calendar', the bucket's
    four numbers as bucket.lua reads them for that kind."""
    sliding, calendar = int(flag == "sliding"), int(flag == "calendar")
    out = struct.pack("<HBBBBBBddd", 1, 0, 0, 0, 0, sliding, calendar, 1, 1, 1000)
    return out + struct.pack("<dddd", a1, a2, a3, a4)


def day():
    """Today's period (UTC): its start, end and the next one's end."""
    now = int(time.time())
    start = now - now % 86400
    return start, start + 86400, start + 2 * 86400


def group(attempt=None, charge=0):
    """One decision's packed numbers: n, the flags (hash layout, charge,
    attempt, fixed, sliding, calendar), needed, deducted, margin ms, the
    bucket's capacity, tokens per unit, unit seconds, max debt (-1: the
    burst), then an attempt's phase, mode, ttl ms and repeats."""
    out = struct.pack("<HBBBBBBddd", 1, 0, charge, int(attempt is not None), 0, 0, 0, 1, 1, 1000)
    out += struct.pack("<dddd", 1e9, 1e9, 1, -1)
    if attempt is not None:
        out += struct.pack("<BBdd", 0, attempt, 60000, 3)
    return out


def decision(kind, key, rng):
    """(keys, args) of one decision."""
    if kind == "token_bucket":
        return [key], [group()]
    if kind == "minimal":
        return [key], ["1", "1", "1", "1000", "0", "1000000000", "1000000000", "1", "-1"]
    if kind == "fixed_window":
        return [key], [fixed_window_group()]
    if kind == "sliding_window":
        return [key], [window_group("sliding", 1e9, 1e9, 3600, -1)]
    if kind == "minimal_sliding_window":
        return [key], ["1000000000", "3600"]
    if kind == "calendar":
        start, stop, after = day()
        return [key], [window_group("calendar", start, 1e9, stop, after)]
    if kind == "minimal_calendar":
        return [key], ["1000000000"] + [str(x) for x in day()]
    if kind == "charge":
        return [key], [group(charge=1)]
    if kind == "minimal_charge":
        return [key], ["1", "1", "1", "1000", "0", "1000000000", "1000000000", "1", "-1"]
    if kind in ("slots", "minimal_slots"):
        ident = str(rng.randrange(10**12))
        tag = key.split("}")[0] + "}"
        return [f"{tag}s"], ["0", ident, "1000000000", "60000", "3"]
    if kind == "minimal_reserve":
        ident = str(rng.randrange(10**12))
        tag = key.split("}")[0] + "}"
        return [key, f"{tag}a:{ident}", f"{tag}r"], ["1", "1", "1", "1000", "0", "1000000000",
                                                      "1000000000", "1", "-1", "60000", ident]
    if kind == "minimal_fixed_window":
        return [key], ["1000000000", "3600"]
    if kind == "minimal_dedupe":
        ident = str(rng.randrange(10**12))
        tag = key.split("}")[0] + "}"
        return [key, f"{tag}a:{ident}"], ["1", "1", "1", "1000", "0", "1000000000",
                                          "1000000000", "1", "-1", "60000"]
    if kind in ("dedupe", "dedupe_repeat", "reserve"):
        ident = "1" if kind == "dedupe_repeat" else str(rng.randrange(10**12))
        tag = key.split("}")[0] + "}"
        keys = [key, f"{tag}a:{ident}"]
        if kind == "reserve":
            keys.append(f"{tag}r")
            return keys, [group(attempt=1), ident]
        return keys, [group(attempt=0), ident]
    sys.exit(f"unknown kind {kind}")


def call(sha, kind, spread, batch, rng):
    def key(i):
        n = rng.randrange(spread) if spread else 0
        return f"rls:{{{'hot' if not spread else n}{i}}}:k"
    if kind == "ratelimit_counter":
        k = f"edge_api_key_{rng.randrange(spread) if spread else 'hot'}_1733500800"
        return (b"*3\r\n" + bulk("INCRBY") + bulk(k) + bulk("1")
                + b"*3\r\n" + bulk("EXPIRE") + bulk(k) + bulk("3600"))
    parts = [b"EVALSHA", sha.encode()]
    keys, args = decision(kind, key(0), rng)
    body = [bulk(str(len(keys)))] + [bulk(k) for k in keys] + [bulk(a) for a in args]
    for i in range(1, batch):
        k, a = decision(kind, key(i), rng)
        body += [bulk(x) for x in a] + [bulk(x) for x in k]
    return b"*%d\r\n" % (2 + len(body)) + b"".join(bulk(p) for p in parts) + b"".join(body)


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("sha")
    p.add_argument("kind")
    p.add_argument("n", type=int)
    p.add_argument("--pipeline", type=int, default=16)
    p.add_argument("--spread", type=int, default=0)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(7)
    s = socket.create_connection(("127.0.0.1", a.port))
    f = s.makefile("rb")
    sent = 0
    fresh = ("dedupe", "reserve", "minimal_dedupe", "minimal_reserve", "slots", "minimal_slots")
    fixed = None if a.spread or a.kind in fresh else call(a.sha, a.kind, 0, a.batch, rng)
    replies = 2 if a.kind == "ratelimit_counter" else 1
    while sent < a.n:
        count = min(a.pipeline, a.n - sent)
        s.sendall(b"".join(fixed or call(a.sha, a.kind, a.spread, a.batch, rng) for _ in range(count)))
        for _ in range(count * replies):
            read_reply(f)
        sent += count


if __name__ == "__main__":
    main()
