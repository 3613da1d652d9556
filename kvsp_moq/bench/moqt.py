"""``kvsp bench moqt``: one publisher -> one subscriber over MOQT on loopback.

Workload: a 32 MiB block as 32 objects of 1 MiB in one group, received straight into one
preallocated buffer (the ``on_object_begin`` path the layer sinks use). For each QUIC max
datagram size (1200, 1452, 8952, 16384) it reports the transfer rate (MB/s, from the first
object written to the last one received) and the time to the first whole object.

Baseline, same run: a raw TCP socket copy of the same bytes over loopback (``sendall`` from
one thread, ``recv_into`` one buffer in another), its rate and the time to its first MiB.

``url`` (``--url``) says where the bench's server listens (``host:port``; port 0: any) and
over what the subscriber connects: ``moqt://`` raw QUIC only; ``https://`` also MOQT over
WebTransport (docs/transport.md "WebTransport") to the same server, one port, alternated with
raw QUIC run by run, so each ``moqt_wt_*`` figure has for baseline the raw-QUIC figure of the
same datagram size measured beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from urllib.parse import urlsplit, urlunsplit

from ..pubsub import Catalog, TrackPublisher, connect, serve
from ..pubsub.endpoints import MoqtServer
from ..transport import MoqtUrl, TransportConfig, new_event_loop, parse_moqt_url
from ..transport.tls import make_self_signed
from .baseline import tcp_copy
from .report import Figure

DATAGRAM_SIZES = (1200, 1452, 8952, 16384)
DEFAULT_URL = "moqt://127.0.0.1:0/bench"
_NS = ("kvsp-bench", "moqt")


async def _transfer(server: MoqtServer, catalog: Catalog, url: str, name: str, data: bytes,
                    object_size: int, datagram_size: int) -> tuple[float, float]:
    """One block from the server's ``name`` track to a client connected at ``url``:
    (seconds for the block, seconds to the first object)."""
    track = catalog.add(TrackPublisher(_NS, name, keep=False))
    buf = bytearray(len(data))
    view = memoryview(buf)
    client = await connect(url, TransportConfig(insecure=True, max_datagram_size=datagram_size,
                                                use_uvloop=True))
    try:
        sub = await client.subscribe(_NS, name,
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
    finally:
        await client.close()
    if hashlib.sha256(buf).digest() != hashlib.sha256(data).digest():
        raise AssertionError(f"MOQT transfer over {url} corrupted the data")
    return elapsed, first


async def _runs(url: str, data: bytes, object_size: int, datagram_size: int,
                repeat: int) -> dict[str, list[tuple[float, float]]]:
    """``repeat`` transfers per transport on one server (raw QUIC, then WebTransport when
    ``url`` is https://, alternated): {"quic": [...], "webtransport": [...]}."""
    parsed = listen_url(url)
    cert = make_self_signed()
    catalog = Catalog()
    server = await serve(parsed.host, parsed.port, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
        max_datagram_size=datagram_size, use_uvloop=True, webtransport=parsed.is_webtransport),
        catalog=catalog)
    base = parse_moqt_url(_with_port(url, server.port))
    urls = {"quic": str(base.with_scheme("moqt"))}
    if parsed.is_webtransport:
        urls["webtransport"] = str(base.with_scheme("https"))
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in urls}
    try:
        for i in range(repeat):
            for kind, target in urls.items():
                out[kind].append(await _transfer(server, catalog, target, f"block-{kind}-{i}",
                                                 data, object_size, datagram_size))
    finally:
        server.close()
        await server.wait_closed()
    return out


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return urlunsplit((parts.scheme, f"{host}:{port}", parts.path, parts.query, ""))


def listen_url(url: str) -> MoqtUrl:
    """``url`` with port 0 allowed (any free port), otherwise as ``parse_moqt_url`` checks it."""
    any_port = urlsplit(url).port == 0
    parsed = parse_moqt_url(_with_port(url, 1) if any_port else url)
    return dataclasses.replace(parsed, port=0) if any_port else parsed


def run(block_bytes: int = 32 << 20, object_size: int = 1 << 20,
        datagram_sizes: tuple[int, ...] = DATAGRAM_SIZES, repeat: int = 1,
        url: str = DEFAULT_URL) -> list[Figure]:
    listen_url(url)  # a bad URL fails before anything runs
    data = os.urandom(block_bytes)
    tcp = min((tcp_copy(data, object_size) for _ in range(max(repeat, 3))), key=lambda t: t[0])
    tcp_mbps = block_bytes / tcp[0] / 1e6
    figures = []
    loop = new_event_loop(use_uvloop=True)
    try:
        for size in datagram_sizes:
            runs = loop.run_until_complete(_runs(url, data, object_size, size, max(repeat, 1)))
            params: dict[str, object] = {"block_bytes": block_bytes, "object_size": object_size,
                                         "max_datagram_size": size}
            elapsed, first = min(runs["quic"], key=lambda r: r[0])
            quic_mbps = block_bytes / elapsed / 1e6
            figures.append(Figure(f"moqt_block_dgram{size}", "MB/s", quic_mbps,
                                  "tcp_copy", tcp_mbps, params=params))
            figures.append(Figure(f"moqt_first_object_dgram{size}", "ms", first * 1e3,
                                  "tcp_first_object", tcp[1] * 1e3, params=params))
            if "webtransport" in runs:
                wt_elapsed, wt_first = min(runs["webtransport"], key=lambda r: r[0])
                figures.append(Figure(f"moqt_wt_block_dgram{size}", "MB/s", block_bytes / wt_elapsed / 1e6,
                                      f"moqt_block_dgram{size}", quic_mbps, params=params))
                figures.append(Figure(f"moqt_wt_first_object_dgram{size}", "ms", wt_first * 1e3,
                                      f"moqt_first_object_dgram{size}", first * 1e3, params=params))
    finally:
        loop.close()
    return figures
