"""gRPC ShouldRateLimit bodies for h2load's -d (integration/bench.sh,
integration/bench-floor.sh): domain bench, one descriptor (KEY, k0),
written as it goes on the wire (no compression flag, the length, the
message).

    python3 integration/h2load_body.py DIR NAME=KEY [NAME=KEY ...]

writes DIR/NAME.bin for each."""
import struct
import sys


def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | 0x80 if n else b])
        if not n:
            return out


def field(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data


def body(key):
    msg = field(1, b"bench") + field(2, field(1, field(1, key) + field(2, b"k0")))
    return b"\0" + struct.pack(">I", len(msg)) + msg


if __name__ == "__main__":
    out = sys.argv[1]
    for pair in sys.argv[2:]:
        name, key = pair.split("=", 1)
        with open(f"{out}/{name}.bin", "wb") as f:
            f.write(body(key.encode()))
