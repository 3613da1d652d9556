"""The loader side of ``kvsp bench wan --codec``, in the loader's network namespace.

``python -m kvsp_moq.cli.bench.wan.codec.loader --info LINE --codec C[,C...] --repeat R``
loads the holder's block over HTTP/TCP with the client library's verified retrieval
(``control.client.retrieval.retrieve_block``: Repr-Digest, and for raw the layer and replica
digests, kvsp-draft §6.7) once raw and once per codec (``codec=n``: the holder's transcoded
representation), decoding each layer to the element type (bf16) as soon as it has arrived and
been checked, on a worker thread while the event loop reads the next layers. One JSON line: for each codec
(and ``raw``) the best seconds of ``repeat`` loads after one untimed, from the request to the
last layer decoded, and the octets received. With ``--moqt-backend`` also, keyed
``moqt:<codec>``, the coded tracks through the holder's transcoding relay (:mod:`.moqt`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import numpy as np

from .....control.client.http import HttpBlockFetcher
from .....control.client.retrieval import BlockFetcher, retrieve_block
from .....control.common.tls import TlsConfig
from .....kvsp.codecs import decode_layer, layer_codec
from .....kvsp.container import DecodedLayer
from .....kvsp.layout import Geometry
from .....kvsp.records import ReplicaRecord
from .....transport import TransportConfig, new_event_loop
from ...kv.holder import BENCH_TOKEN
from .holder import CodecHolderInfo, descriptor
from .moqt import load_moqt

__all__ = ["DecodingSink", "load", "main"]


class DecodingSink:
    """A :class:`~kvsp_moq.control.client.retrieval.LayerSink` that decodes each verified
    layer into arrays of the element type as it arrives (raw: a copy out of the body), on a
    worker thread, so the event loop goes on reading the next layers meanwhile; :meth:`done`
    waits for the last one."""

    def __init__(self, codec: str, geometry: Geometry, tokens: int, worker: ThreadPoolExecutor) -> None:
        self.codec, self.geometry, self.tokens, self.worker = codec, geometry, tokens, worker
        self.pending: list[Future[tuple[np.ndarray, np.ndarray]]] = []

    def _decode(self, layer: DecodedLayer) -> tuple[np.ndarray, np.ndarray]:
        k, v = decode_layer(self.codec, layer.k, layer.v, self.geometry, self.tokens)
        if self.codec == "raw":  # decode_layer's views of the body: copied out, as a sink does
            k, v = k.copy(), v.copy()
        return k, v

    def layer(self, record: ReplicaRecord, layer: DecodedLayer) -> None:
        self.pending.append(self.worker.submit(self._decode, layer))

    def discard(self, record: ReplicaRecord) -> None:
        self.pending.clear()

    async def done(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [await asyncio.wrap_future(f) for f in self.pending]


async def load(info: CodecHolderInfo, codecs: Sequence[str], repeat: int, host: str) -> dict[str, list[float]]:
    """codec -> [best seconds, octets received] over ``repeat`` timed loads (one untimed first)."""
    record = ReplicaRecord.from_json({**info.record, "holder": f"http://{host}:{info.http_port}/"})
    doc = descriptor(len(record.layer_digests or ()), info.tokens)
    geometry = Geometry.from_descriptor_fields(doc["kv_heads"], doc["head_dim"], doc["kv_dtype"])
    # The namespaces' private link (10.211.0.0/24), plain HTTP as the kv bench's baseline.
    fetcher = HttpBlockFetcher(BENCH_TOKEN, timeout_s=600.0, read_timeout_s=60.0, chunk_octets=1 << 20,
                               tls=TlsConfig(allow_plain_http=True))
    out: dict[str, list[float]] = {}
    worker = ThreadPoolExecutor(1, thread_name_prefix="decode")
    try:
        for name in ("raw", *codecs):
            value = layer_codec(name).codec.value
            best, received = float("inf"), 0
            for run in range(repeat + 1):
                sink = DecodingSink(name, geometry, info.tokens, worker)
                start = time.perf_counter()
                got = await retrieve_block(cast(BlockFetcher, fetcher), [record], codec=None if name == "raw" else value,
                                           sink=sink, geometry=geometry)
                decoded = await sink.done()
                elapsed = time.perf_counter() - start
                if got.header.codec != value or len(decoded) != len(record.layer_digests or ()):
                    raise AssertionError(f"{name}: got codec {got.header.codec}, {len(decoded)} layers")
                received = got.header.total_size
                if run > 0:
                    best = min(best, elapsed)
            out[name] = [best, float(received)]
    finally:
        await fetcher.close()
        worker.shutdown()
    return out


async def _load_moqt(info: CodecHolderInfo, codecs: Sequence[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """``moqt:<codec>`` -> [best seconds, coded octets] through the holder's transcoding relay."""
    assert info.moqt_record is not None
    record = ReplicaRecord.from_json(info.moqt_record)
    doc = descriptor(len(record.layer_digests or ()), info.tokens)
    geometry = Geometry.from_descriptor_fields(doc["kv_heads"], doc["head_dim"], doc["kv_dtype"])
    config = TransportConfig(backend=args.moqt_backend, insecure=True, max_datagram_size=args.datagram_size,
                             congestion_control_algorithm=args.congestion_control)
    got = await load_moqt(record, geometry, info.tokens, codecs, args.repeat, config)
    return {f"moqt:{name}": value for name, value in got.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.wan.codec.loader")
    p.add_argument("--info", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--codec", default="fp8-e4m3")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--moqt-backend", default=None, help="also load the coded tracks through the holder's relay")
    p.add_argument("--datagram-size", type=int, default=1452)
    p.add_argument("--congestion-control", default=None)
    args = p.parse_args(argv)
    info = CodecHolderInfo.from_line(args.info)
    codecs = [c for c in args.codec.split(",") if c]
    loop = new_event_loop(use_uvloop=True)
    try:
        got = loop.run_until_complete(load(info, codecs, args.repeat, args.host))
        if args.moqt_backend is not None and info.moqt_record is not None:
            got.update(loop.run_until_complete(_load_moqt(info, codecs, args)))
    finally:
        loop.close()
    print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
