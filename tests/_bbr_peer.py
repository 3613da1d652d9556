"""QUIC bulk sender and receiver for tests/test_bbr_transfer.py, each run inside a network
namespace (``ip netns exec``) on either side of the TUN shaper.

``python _bbr_peer.py send HOST PORT CC BYTES``: serves QUIC (aioquic, congestion control
``CC``) on HOST:PORT, prints ``{"ready": true, "sha256": of what it sends}``; to every connection it sends BYTES octets (a
deterministic pattern) on one unidirectional stream. When a connection's bytes are all
acknowledged it prints one JSON line: ``{"done": i, "state": congestion_state(),
"others": {j: bytes the other live connection j had delivered (acknowledged) by then}}``.
Serves until its stdin closes.

``python _bbr_peer.py recv URL CONNECTIONS``: opens CONNECTIONS connections at once, reads
each stream to its end, prints ``{"bytes": [...], "sha256": [...]}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from functools import partial
from typing import Any

from kvsp_moq.transport import (BaseConnectionHandler, Connection, ConnectionClosedError,
                                TransportConfig, connect, serve)
from kvsp_moq.transport.tls import make_self_signed

CHUNK = 1 << 16
DATAGRAM = 1452


def pattern(size: int) -> bytes:
    """The bytes a sender sends: a repeated counter, so a receiver can check them."""
    block = bytes(range(256)) * (CHUNK // 256)
    return (block * (size // CHUNK + 1))[:size]


async def send(host: str, port: int, cc: str, size: int) -> None:
    loop = asyncio.get_running_loop()
    live: dict[int, Connection] = {}
    accepted = [0]
    payload = memoryview(pattern(size))

    class Sender(BaseConnectionHandler):
        def connection_made(self, conn: Connection, alpn: str) -> None:
            self.index = accepted[0]
            accepted[0] += 1
            live[self.index] = conn
            loop.create_task(self.run(conn))

        async def run(self, conn: Connection) -> None:
            sid = conn.open_uni()
            for off in range(0, size, CHUNK):
                await conn.write(sid, payload[off:off + CHUNK], end_stream=off + CHUNK >= size)
            try:
                await conn.drain()
            except ConnectionClosedError:
                pass  # the receiver closes once it has every byte, before our last ACK may come
            others = {j: (c.congestion_state() or {}).get("delivered") for j, c in live.items()
                      if j != self.index}
            print(json.dumps({"done": self.index, "state": conn.congestion_state(),
                              "others": others}), flush=True)
            del live[self.index]

    cert = make_self_signed(ip_addresses=(host,))
    config = TransportConfig(backend="aioquic", certificate_pem=cert.cert_pem,
                             private_key_pem=cert.key_pem, max_datagram_size=DATAGRAM,
                             congestion_control_algorithm=cc, datagrams=False,
                             alpn_protocols=("kvsp-test",))
    server = await serve(host, port, lambda: Sender(), config)
    print(json.dumps({"ready": True, "sha256": hashlib.sha256(payload).hexdigest()}), flush=True)
    stdin_closed: asyncio.Future[None] = loop.create_future()

    def stdin_readable() -> None:
        if not os.read(0, 1 << 12) and not stdin_closed.done():
            loop.remove_reader(0)
            stdin_closed.set_result(None)

    loop.add_reader(0, stdin_readable)
    await stdin_closed
    server.close()
    await server.wait_closed()


class Receiver(BaseConnectionHandler):
    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.count = 0
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        self.hash.update(data)
        self.count += len(data)
        if end_stream and not self.ended.done():
            self.ended.set_result(None)


async def recv(url: str, connections: int) -> None:

    config = TransportConfig(backend="aioquic", insecure=True, max_datagram_size=DATAGRAM,
                             datagrams=False, alpn_protocols=("kvsp-test",))
    handlers = [Receiver() for _ in range(connections)]
    conns: list[Any] = await asyncio.gather(*(connect(url, partial(_same, h), config)
                                              for h in handlers))
    await asyncio.wait_for(asyncio.gather(*(h.ended for h in handlers)), 120)
    print(json.dumps({"bytes": [h.count for h in handlers],
                      "sha256": [h.hash.hexdigest() for h in handlers]}), flush=True)
    for c in conns:
        await c.aclose()


def _same(handler: Receiver) -> Receiver:
    return handler


def main(argv: list[str]) -> None:
    if argv[0] == "send":
        asyncio.run(send(argv[1], int(argv[2]), argv[3], int(argv[4])))
    else:
        asyncio.run(recv(argv[1], int(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
