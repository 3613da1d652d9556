"""The holder side of ``kvsp bench kv`` / ``kvsp bench wan``, runnable in its own process.

``python -m kvsp_moq.cli.bench.kv.holder --host H [--layers N --layer-mib M --datagram-size D
--backend B]`` builds the benchmark block (:func:`make_block`, deterministic), stores it, serves
it over MOQT (``MoqtHolder.serve``, binding v1) and over HTTP (the control plane's
``serve_holder``, kvsp-draft §6.7) on ``H``, prints one JSON line (:class:`HolderInfo`) and
serves until its stdin closes. Its own process so that the send side can be profiled apart
from the receive side (docs/perf/), and placed in another network namespace (``bench wan``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import sys
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from ....bridge import MoqtHolder
from ....control.common.auth import Authorizer, Grant, Principal
from ....control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from ....control.holder.serve import serve_holder
from ....kvsp.layout import Geometry
from ....storage import BlockStore, HostTier, RecordKey
from ....transport import TransportConfig, new_event_loop
from ....transport.tls import make_self_signed

__all__ = ["BENCH_TOKEN", "HolderInfo", "KEY", "freeze_heap", "geometry", "make_block", "serve_block"]

#: Bearer token of the benchmark's HTTP holder (DESIGN.md §5).
BENCH_TOKEN = "bench-kv-token".ljust(32, "x")
KEY = RecordKey(b"\x01" * 32, b"\x02" * 16, b"\x03" * 32)


def freeze_heap() -> None:
    """Move every object alive now (imports: torch alone brings ~10^5) out of the cyclic GC's
    reach (``gc.freeze``), so that the collections the transfer's allocations trigger do not
    traverse them again and again (docs/perf/README.md: 7 % of the receive side before)."""
    gc.collect()
    gc.freeze()


def geometry() -> Geometry:
    """8 KV heads x 128 dims, bf16: 4 KiB per token (K + V)."""
    return Geometry.from_descriptor_fields(8, 128, "bf16")


def make_block(layers: int, layer_bytes: int) -> tuple[Geometry, int, list[tuple[np.ndarray, np.ndarray]]]:
    """The benchmark block: ``layers`` layers of ``layer_bytes`` (K || V), random octets."""
    geo = geometry()
    tokens = layer_bytes // (2 * geo.section_bytes(1))
    rng = np.random.default_rng(1)
    shape = geo.shape(tokens)
    n = geo.section_bytes(tokens)

    def section() -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8).view(geo.numpy_dtype).reshape(shape)

    return geo, tokens, [(section(), section()) for _ in range(layers)]


def store_block(layers: int, layer_bytes: int) -> tuple[BlockStore, int]:
    """A store holding the benchmark block under :data:`KEY`; and its token count."""
    geo, tokens, arrays = make_block(layers, layer_bytes)
    store = BlockStore([HostTier(4 * layers * layer_bytes)])
    store.put_layers(KEY, arrays, token_count=tokens, geometry=geo)
    return store, tokens


@dataclass(frozen=True)
class HolderInfo:
    """What a loader needs: the record (holder = the ``moqt://`` URL) and the HTTP path."""

    record: dict[str, Any]
    tokens: int
    container_bytes: int
    http_port: int
    http_path: str

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> HolderInfo:
        return cls(**json.loads(line))


async def http_holder(store: BlockStore, host: str) -> Any:
    """The control plane's holder service on ``store`` (HTTP, §6.7), bearer :data:`BENCH_TOKEN`."""
    principal = Principal("bench", scopes=Grant(everything=True), holders=Grant(everything=True))
    config = ControlConfig(auth=Authorizer.from_tokens({BENCH_TOKEN: principal}),
                           index=IndexConfig(purge_interval_ms=0),
                           holder=HolderConfig(tiers=(TierConfig("host", 1 << 30),)))
    return await serve_holder(config, host, 0, store=store)


async def serve_block(host: str, layers: int, layer_bytes: int, datagram_size: int,
                      backend: str, stop: asyncio.Future[None],
                      congestion_control: str | None = None) -> None:
    """Serve the block over MOQT and HTTP on ``host`` until ``stop``; print the info line.
    ``congestion_control``: ``TransportConfig.congestion_control_algorithm`` (the sender's)."""
    cert = make_self_signed()
    config = TransportConfig(backend=backend, certificate_pem=cert.cert_pem,
                             private_key_pem=cert.key_pem, max_datagram_size=datagram_size,
                             congestion_control_algorithm=congestion_control)
    store, tokens = store_block(layers, layer_bytes)
    holder = MoqtHolder(store)
    http = await http_holder(store, host)
    try:
        holder.publish(KEY)
        await holder.serve(host, 0, config)
        record = holder.replica_record(KEY, holder=holder.url)
        info = HolderInfo(record.to_json(), tokens, store.open_reader(KEY, touch=False).size,
                          http.port, f"{http.base_path.rstrip('/')}/blocks/{KEY.path}")
        freeze_heap()
        print(info.to_line(), flush=True)
        await stop
    finally:
        await http.close()
        await holder.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.kv.holder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-mib", type=int, default=1)
    p.add_argument("--datagram-size", type=int, default=16384)
    p.add_argument("--backend", default="aioquic")
    p.add_argument("--congestion-control", default=None,
                   help="TransportConfig.congestion_control_algorithm (aioquic: reno, cubic, "
                        "bbr; default: the backend's)")
    args = p.parse_args(argv)
    return serve_until_stdin_closes(lambda stop: serve_block(args.host, args.layers, args.layer_mib << 20,
                                                             args.datagram_size, args.backend, stop,
                                                             args.congestion_control))


def serve_until_stdin_closes(serve: Callable[[asyncio.Future[None]], Coroutine[Any, Any, Any]]) -> int:
    """Run ``serve(stop)`` on a new uvloop until it returns; ``stop`` is done once the parent
    closes our stdin (or dies). A bench's child process's ``main``."""
    loop = new_event_loop(use_uvloop=True)
    stop: asyncio.Future[None] = loop.create_future()
    fd = sys.stdin.fileno()
    # typeshed types TextIO.buffer as BinaryIO, which has no read1; stdin's is a BufferedReader.
    stdin = cast(io.BufferedReader, sys.stdin.buffer)

    def stdin_readable() -> None:
        if not stdin.read1(1 << 16):
            loop.remove_reader(fd)
            if not stop.done():
                stop.set_result(None)

    loop.add_reader(fd, stdin_readable)
    try:
        loop.run_until_complete(serve(stop))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
