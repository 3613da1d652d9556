"""UDP probe for tests/test_bench_wan.py, run inside a network namespace (``ip netns exec``).

``python _wan_probe.py send HOST PORT COUNT``: COUNT datagrams, each ``(sequence number,
CLOCK_MONOTONIC send time in ns)`` padded to 64 octets of payload, as fast as it can.

``python _wan_probe.py recv HOST PORT``: binds, prints ``ready``, records every datagram with
its receive time; once a count arrives on stdin it reads until it has that many, then prints
``[[seq, sent_ns, received_ns], ...]`` as one JSON line. (CLOCK_MONOTONIC is one clock for
every namespace, so received - sent is the one-way time.)
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import sys
import time

PAYLOAD = struct.Struct("!QQ48x")  # 64 octets: a 92-octet IPv4 packet


def send(host: str, port: int, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for seq in range(count):
            sock.sendto(PAYLOAD.pack(seq, time.monotonic_ns()), (host, port))


def recv(host: str, port: int) -> None:
    got: list[tuple[int, int, int]] = []
    expected: int | None = None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, selectors.DefaultSelector() as sel:
        sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root): hold a burst
        sock.bind((host, port))
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        sel.register(sys.stdin, selectors.EVENT_READ)
        print("ready", flush=True)
        while expected is None or len(got) < expected:
            for key, _ in sel.select():
                if key.fileobj is sys.stdin:
                    expected = int(sys.stdin.readline())
                    sel.unregister(sys.stdin)
                    continue
                while True:
                    try:
                        data = sock.recv(2048)
                    except BlockingIOError:
                        break
                    now = time.monotonic_ns()
                    seq, sent = PAYLOAD.unpack(data)
                    got.append((seq, sent, now))
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        recv(sys.argv[2], int(sys.argv[3]))
