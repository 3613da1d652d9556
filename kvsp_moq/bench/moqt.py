"""``kvsp bench moqt``: one publisher -> one subscriber over MOQT on loopback.

Workload: a 32 MiB block as 32 objects of 1 MiB in one group, received straight into one
preallocated buffer (the ``on_object_begin`` path the layer sinks use). For each QUIC max
datagram size (1200, 1452, 8952, 16384) it reports the transfer rate (MB/s, from the first
object written to the last one received) and the time to the first whole object.

Baseline, same run: a raw TCP socket copy of the same bytes over loopback (``sendall`` from
one thread, ``recv_into`` one buffer in another), its rate and the time to its first MiB.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

from ..pubsub import Catalog, TrackPublisher, connect, serve
from ..transport import TransportConfig, new_event_loop
from ..transport.tls import make_self_signed
from .baseline import tcp_copy
from .report import Figure

DATAGRAM_SIZES = (1200, 1452, 8952, 16384)
_NS = ("kvsp-bench", "moqt")


async def _moqt_once(data: bytes, object_size: int, datagram_size: int) -> tuple[float, float]:
    cert = make_self_signed()
    catalog = Catalog()
    track = catalog.add(TrackPublisher(_NS, "block", keep=False))
    server = await serve("127.0.0.1", 0, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
        max_datagram_size=datagram_size, use_uvloop=True), catalog=catalog)
    buf = bytearray(len(data))
    view = memoryview(buf)
    try:
        client = await connect(f"moqt://127.0.0.1:{server.port}/bench",
                               TransportConfig(insecure=True, max_datagram_size=datagram_size,
                                               use_uvloop=True))
        sub = await client.subscribe(_NS, "block",
                                     on_object_begin=lambda info: view[info.object_id * object_size:
                                                                       (info.object_id + 1) * object_size])
        count = len(data) // object_size
        start = time.perf_counter()
        first = 0.0

        async def publish() -> None:
            for i in range(count):
                await track.write_object(0, i, memoryview(data)[i * object_size:(i + 1) * object_size])

        sender = asyncio.ensure_future(publish())
        received = 0
        async for _obj in sub:
            received += 1
            if received == 1:
                first = time.perf_counter() - start
            if received == count:
                break
        elapsed = time.perf_counter() - start
        await sender
        await client.close()
    finally:
        server.close()
        await server.wait_closed()
    if hashlib.sha256(buf).digest() != hashlib.sha256(data).digest():
        raise AssertionError("MOQT transfer corrupted the data")
    return elapsed, first


def run(block_bytes: int = 32 << 20, object_size: int = 1 << 20,
        datagram_sizes: tuple[int, ...] = DATAGRAM_SIZES, repeat: int = 1) -> list[Figure]:
    data = os.urandom(block_bytes)
    tcp = min((tcp_copy(data, object_size) for _ in range(max(repeat, 3))), key=lambda t: t[0])
    tcp_mbps = block_bytes / tcp[0] / 1e6
    figures = []
    loop = new_event_loop(use_uvloop=True)
    try:
        for size in datagram_sizes:
            runs = [loop.run_until_complete(_moqt_once(data, object_size, size)) for _ in range(repeat)]
            elapsed, first = min(runs, key=lambda r: r[0])
            params: dict[str, object] = {"block_bytes": block_bytes, "object_size": object_size,
                                         "max_datagram_size": size}
            figures.append(Figure(f"moqt_block_dgram{size}", "MB/s", block_bytes / elapsed / 1e6,
                                  "tcp_copy", tcp_mbps, params=params))
            figures.append(Figure(f"moqt_first_object_dgram{size}", "ms", first * 1e3,
                                  "tcp_first_object", tcp[1] * 1e3, params=params))
    finally:
        loop.close()
    return figures
