"""The instance side of ``kvsp bench kv`` / ``kvsp bench wan``: timed, verified block loads.

* :func:`timed_load`: ``load_block`` (MOQT FETCH, binding v1 §5) of one block into a fresh
  torch layer sink (CPU; every layer verified against the record's digest) — time to the
  first verified layer and to the whole block;
* :func:`http_once`: the HTTP GET of the same block (the KVB1 container, kvsp-draft §6.7) on
  asyncio streams into one preallocated buffer, SHA-256 of the body (Repr-Digest) included;
* :func:`measure`: both against a holder described by a :class:`HolderInfo` line.

``python -m kvsp_moq.cli.bench.kv.loader --info LINE`` runs :func:`measure` and prints one JSON
line ``{"moqt": [first_s, block_s], "http": [first_s, block_s]}`` (best of ``--repeat`` after
a warm-up): ``kvsp bench wan`` runs it in the loader's network namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from typing import Any

from ....bridge import MoqtPool, load_block, sink_for_record
from ....kvsp.layout import Geometry
from ....kvsp.records import ReplicaRecord
from ....transport import TransportConfig, new_event_loop
from .holder import BENCH_TOKEN, HolderInfo, freeze_heap, geometry

__all__ = ["http_once", "measure", "timed_load"]

Timing = tuple[float, float]  # (seconds to the first layer, seconds to the whole block)


async def timed_load(record: ReplicaRecord, geo: Geometry, tokens: int, pool: MoqtPool,
                     sink_backend: str = "torch", device: str | None = None) -> Timing:
    """Load the block of ``record`` over MOQT into a new sink on ``device`` (torch: None or
    "cpu" in place, "cuda[:i]" through pinned staging), every layer verified. On CUDA a
    layer counts as loaded when its device copy has completed (its copy event)."""
    sink = sink_for_record(record, geo, tokens, backend=sink_backend, device=device)
    start = time.perf_counter()
    first: list[float] = []

    async def copied(layer: int) -> None:
        event = getattr(sink, "layer_event", lambda _layer: None)(layer)
        if event is not None:  # the H2D copy of a verified layer (sinks/cuda.py)
            await asyncio.to_thread(event.synchronize)

    async def first_layer() -> None:
        await sink.wait_for_layer(sink.first_layer)
        await copied(sink.first_layer)
        first.append(time.perf_counter())

    waiter = asyncio.ensure_future(first_layer())
    result = await load_block(record, sink, pool=pool, timeout=600.0)  # a slow WAN path too
    if result.complete:
        await copied(sink.last_layer)  # one side stream: the last copy ends after the others
    end = time.perf_counter()
    await waiter
    if not result.complete:
        raise AssertionError(f"load incomplete: {result.attempts}")
    return first[0] - start, end - start


async def http_once(host: str, port: int, path: str, header_and_first: int, total: int) -> Timing:
    """GET ``path`` (HTTP/1.1, Content-Length body) into one buffer; SHA-256 of the body."""
    buf = bytearray(total)
    view = memoryview(buf)
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        start = time.perf_counter()
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {BENCH_TOKEN}\r\nConnection: close\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"HTTP GET failed: {head[:200]!r}")
        got, first = 0, None
        body = hashlib.sha256()
        while got < total:
            chunk = await reader.read(min(1 << 20, total - got))
            if not chunk:
                break
            view[got:got + len(chunk)] = chunk
            body.update(chunk)  # Repr-Digest covers the whole container (§6.7)
            got += len(chunk)
            if first is None and got >= header_and_first:
                first = time.perf_counter()
        body.digest()
        end = time.perf_counter()
    finally:
        writer.close()
    if got != total or first is None:
        raise AssertionError(f"HTTP GET returned {got} of {total} octets")
    return first - start, end - start


def _best(runs: list[Timing]) -> Timing:
    return min(runs, key=lambda r: r[1])


async def measure(info: HolderInfo, config: TransportConfig, repeat: int, http: bool = True,
                  http_host: str | None = None, device: str | None = None,
                  sink_backend: str = "torch",
                  cpu: dict[str, float] | None = None) -> dict[str, Timing]:
    """Best of ``repeat`` MOQT loads (after one warm-up load on a connected session) and, with
    ``http``, best of ``repeat`` HTTP GETs of the same block from the same holder. ``cpu``
    (filled in when given): ``cpu["moqt"]``, the CPU seconds this process (every thread: the
    loop, the transport's network thread, the hash worker) spent on the best MOQT load."""
    record = ReplicaRecord.from_json(info.record)
    geo = geometry()
    out: dict[str, Timing] = {}
    pool = MoqtPool(config, connect_timeout=30.0)
    try:
        await pool.get(record.holder)  # we time the block, not the handshake
        runs: list[tuple[Timing, float]] = []
        for _ in range(repeat + 1):
            cpu_start = time.process_time()
            timing = await timed_load(record, geo, info.tokens, pool, sink_backend, device)
            runs.append((timing, time.process_time() - cpu_start))
        best = min(runs[1:], key=lambda r: r[0][1])
        out["moqt"] = best[0]
        if cpu is not None:
            cpu["moqt"] = best[1]
    finally:
        await pool.close()
    if http:
        host = http_host or _host_of(record.holder)
        layers = len(record.layer_digests or ())
        layer_bytes = 2 * geo.section_bytes(info.tokens)
        first = info.container_bytes - (layers - 1) * layer_bytes
        gets = [await http_once(host, info.http_port, info.http_path, first, info.container_bytes)
                for _ in range(repeat + 1)]
        out["http"] = _best(gets[1:])
    return out


def _host_of(url: str) -> str:
    from ....transport import parse_moqt_url

    return parse_moqt_url(url).host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.kv.loader")
    p.add_argument("--info", required=True, help="the holder's JSON line (kv.holder)")
    p.add_argument("--backend", default="aioquic")
    p.add_argument("--datagram-size", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--congestion-control", default=None,
                   help="TransportConfig.congestion_control_algorithm (default: the backend's)")
    p.add_argument("--sink", default="torch", choices=("torch", "numpy"),
                   help="the layer sink (numpy: where torch is not installed)")
    args = p.parse_args(argv)
    config = TransportConfig(backend=args.backend, insecure=True,
                             max_datagram_size=args.datagram_size,
                             congestion_control_algorithm=args.congestion_control)
    if args.sink == "torch":
        from ....sinks import import_torch

        import_torch()  # before the clock and the loop: the first sink would import it
    freeze_heap()
    loop = new_event_loop(use_uvloop=True)
    try:
        got: dict[str, Any] = loop.run_until_complete(
            measure(HolderInfo.from_line(args.info), config, args.repeat, not args.no_http,
                    sink_backend=args.sink))
    finally:
        loop.close()
    print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
