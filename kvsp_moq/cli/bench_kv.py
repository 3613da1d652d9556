"""``kvsp bench kv``: loading one KV block (default 32 layers x 1 MiB) into a layer sink.

Figures, all from one run, each against a baseline measured in the same run (a raw TCP socket
copy of the same bytes over loopback, ``bench.moqt._tcp_copy``):

* MOQT direct (``load_block`` from a ``MoqtHolder``): time to the first verified layer and to
  the whole verified block;
* through the relay, cold (the relay FETCHes upstream, store-and-forward) and warm (served
  from its cache);
* HTTP GET of the same block (the KVB1 container, §6.7) from the control plane's holder
  service (``kvsp_moq.control.http.serve_holder`` on the same store), read with a plain
  HTTP/1.1 client on asyncio streams into one preallocated buffer. Time to first layer =
  the container header and layer 0 received; the whole block includes SHA-256 of the body.

This module lives in ``kvsp_moq.cli`` (not ``kvsp_moq.bench``) because it starts the relay
and the HTTP holder: ``kvsp_moq.bench`` may not import ``kvsp_moq.control`` or ``relay``
(tests/test_layering.py).

Every load verifies every layer digest (the MOQT paths while receiving); sessions are
connected before the clock starts (we time the block, not the handshake).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import numpy as np

from relay import Relay, RelayConfig

from ..bench.moqt import _tcp_copy
from ..bench.report import Figure
from ..bridge import MoqtHolder, SessionPool, load_block, sink_for_record
from ..control.auth import Authorizer, Grant, Principal
from ..control.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from ..control.http import serve_holder
from ..kvsp.layout import Geometry
from ..storage import BlockStore, HostTier, RecordKey
from ..transport import TransportConfig, new_event_loop
from ..transport.tls import make_self_signed

__all__ = ["run"]

_TOKEN = "bench-kv-token".ljust(32, "x")


def _block(layers: int, layer_bytes: int) -> tuple[Geometry, int, list[tuple[np.ndarray, np.ndarray]]]:
    geometry = Geometry.from_descriptor_fields(8, 128, "bf16")  # 4 KiB per token (K + V)
    tokens = layer_bytes // (2 * geometry.section_bytes(1))
    rng = np.random.default_rng(1)
    shape = geometry.shape(tokens)
    n = geometry.section_bytes(tokens)

    def section() -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8).view(geometry.numpy_dtype).reshape(shape)

    return geometry, tokens, [(section(), section()) for _ in range(layers)]


async def _timed_load(record: Any, geometry: Geometry, tokens: int, pool: SessionPool
                      ) -> tuple[float, float]:
    sink = sink_for_record(record, geometry, tokens, backend="numpy")
    start = time.perf_counter()
    first: list[float] = []

    async def first_layer() -> None:
        await sink.wait_for_layer(0)
        first.append(time.perf_counter())

    waiter = asyncio.ensure_future(first_layer())
    result = await load_block(record, sink, pool=pool)
    end = time.perf_counter()
    await waiter
    if not result.complete:
        raise AssertionError(f"load incomplete: {result.attempts}")
    return first[0] - start, end - start


async def _http_once(port: int, path: str, header_and_first: int,
                     total: int) -> tuple[float, float]:
    """GET ``path`` on 127.0.0.1:``port`` (HTTP/1.1, Content-Length body) into one buffer."""
    buf = bytearray(total)
    view = memoryview(buf)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = time.perf_counter()
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {_TOKEN}\r\nConnection: close\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"HTTP GET failed: {head[:200]!r}")
        got, first = 0, None
        while got < total:
            chunk = await reader.read(min(1 << 20, total - got))
            if not chunk:
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
            if first is None and got >= header_and_first:
                first = time.perf_counter()
        hashlib.sha256(view[:got]).digest()  # Repr-Digest is over the whole container
        end = time.perf_counter()
    finally:
        writer.close()
    if got != total or first is None:
        raise AssertionError(f"HTTP GET returned {got} of {total} octets")
    return first - start, end - start


async def _http_holder(store: BlockStore) -> Any:
    principal = Principal("bench", scopes=Grant(everything=True), holders=Grant(everything=True))
    config = ControlConfig(auth=Authorizer.from_tokens({_TOKEN: principal}),
                           index=IndexConfig(purge_interval_ms=0),
                           holder=HolderConfig(tiers=(TierConfig("host", 1 << 30),)))
    return await serve_holder(config, "127.0.0.1", 0, store=store)


async def _measure(layers: int, layer_bytes: int, datagram_size: int, repeat: int,
                   http: bool) -> dict[str, tuple[float, float]]:
    cert = make_self_signed()
    server = TransportConfig(certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
                             max_datagram_size=datagram_size)
    client = TransportConfig(insecure=True, max_datagram_size=datagram_size)
    geometry, tokens, arrays = _block(layers, layer_bytes)
    store = BlockStore([HostTier(4 * layers * layer_bytes)])
    key = RecordKey(b"\x01" * 32, b"\x02" * 16, b"\x03" * 32)
    store.put_layers(key, arrays, token_count=tokens, geometry=geometry)
    holder = MoqtHolder(store)
    out: dict[str, tuple[float, float]] = {}
    relay = await Relay(RelayConfig(server_transport=server, upstream_transport=client,
                                    cache_bytes=4 * layers * layer_bytes)).start()
    pool = SessionPool(client)
    try:
        holder.publish(key)
        await holder.serve("127.0.0.1", 0, server)
        await holder.attach_relay(relay.url, client)
        await holder.wait_announced()
        direct = holder.replica_record(key, holder=holder.url)
        via_relay = holder.replica_record(key, holder=relay.url)
        await pool.get(direct.holder)
        await pool.get(via_relay.holder)
        runs = [await _timed_load(direct, geometry, tokens, pool) for _ in range(repeat + 1)]
        out["direct"] = min(runs[1:], key=lambda r: r[1])
        out["relay_cold"] = await _timed_load(via_relay, geometry, tokens, pool)
        runs = [await _timed_load(via_relay, geometry, tokens, pool) for _ in range(repeat)]
        out["relay_warm"] = min(runs, key=lambda r: r[1])
        if http:
            server = await _http_holder(store)
            try:
                total = store.open_reader(key, touch=False).size
                first = total - (layers - 1) * layer_bytes
                path = f"{server.base_path.rstrip('/')}/blocks/{key.path}"
                runs = [await _http_once(server.port, path, first, total)
                        for _ in range(repeat + 1)]
                out["http"] = min(runs[1:], key=lambda r: r[1])
            finally:
                await server.close()
    finally:
        await pool.close()
        await holder.close()
        await relay.close()
    return out


def run(layers: int = 32, layer_bytes: int = 1 << 20, datagram_size: int = 16384,
        repeat: int = 3, http: bool = True) -> list[Figure]:
    block = layers * layer_bytes
    data = np.random.default_rng(2).integers(0, 256, block, dtype=np.uint8).tobytes()
    tcp = min((_tcp_copy(data, layer_bytes) for _ in range(max(repeat, 3))), key=lambda t: t[0])
    loop = new_event_loop(use_uvloop=True)
    try:
        got = loop.run_until_complete(_measure(layers, layer_bytes, datagram_size, repeat, http))
    finally:
        loop.close()
    params: dict[str, object] = {"layers": layers, "layer_bytes": layer_bytes, "max_datagram_size": datagram_size}
    figures = []
    for path, (first, whole) in got.items():
        figures.append(Figure(f"kv_{path}_first_layer", "ms", first * 1e3,
                              "tcp_first_layer", tcp[1] * 1e3, params=params))
        figures.append(Figure(f"kv_{path}_block", "ms", whole * 1e3,
                              "tcp_copy", tcp[0] * 1e3, params=params))
    return figures
