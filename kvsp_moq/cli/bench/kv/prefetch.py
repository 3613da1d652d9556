"""The prefetch rows of ``kvsp bench kv`` (issue 16): a prefetch directive's worth of small
blocks (the demo's system prompt: 12 blocks of 4 layers x 32 KiB) through a relay, each role in
its own process — the relay (``kv.relayed relay``), a holder attached to it as a publisher (the
``holder`` role of this module: ``MoqtHolder.attach_relay``) — and the instance's MOQT retriever
here (``control.client.moqt.MoqtBlockRetriever``), ``window`` blocks in flight on one session
(``[instance] prefetch_blocks_in_flight``), every layer verified against its record:

* ``kv_prefetch_land``: ``land()``: a FETCH per block (no TRACK_STATUS), each layer received
  straight into a ``BlockStore`` host tier (``bridge/landing.py``: one copy, one hash);
* ``kv_prefetch_container``: ``__call__`` then ``put_layers``, the path before landing: a sink,
  a KVB1 container assembled and hashed again, then copied and hashed into the store.

Each figure is the best of ``repeat`` runs, every run on blocks the relay has not seen (a miss,
cut through: relay/fetch/inflight.py), against the same run's TCP copy of the same octets (and the
landing against the container path). ``python -m kvsp_moq.cli.bench.kv.prefetch holder --relay
URL --blocks K --layers N --layer-kib S --datagram-size D`` stores K blocks, attaches, prints
one JSON line of records and serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ....bench.baseline import tcp_copy
from ....bench.report import Figure
from ....kvsp.records import ReplicaRecord
from ....storage import BlockStore, HostTier, RecordKey
from ....transport import TransportConfig, new_event_loop
from .relayed import publish_through_relay, stop_process

__all__ = ["measure_prefetch", "prefetch_figures"]

_MODULE = "kvsp_moq.cli.bench.kv.prefetch"
_RELAYED = "kvsp_moq.cli.bench.kv.relayed"
#: The demo's system prompt: 12 blocks of 64 tokens, 4 layers of 2 KV heads x 32 dims, fp32.
BLOCKS, LAYERS, LAYER_KIB = 12, 4, 32
#: Namespaces one publisher session keeps announced at once on the qh3 backend: each
#: PUBLISH_NAMESPACE holds one QUIC bidi stream of the holder's relay session while it is
#: announced, and qh3 grants a peer 100 (fixed; aioquic and aiopquic grant
#: ``TransportConfig.max_streams_bidi``, 4096: docs/transport.md "Stream limits").
QH3_ANNOUNCED = 96


def _spawn(module: str, args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        stop_process(proc)
        raise RuntimeError(f"{module} {args[0]} did not start (exit {proc.returncode})")
    return proc, line


async def _timed(records: Sequence[ReplicaRecord], window: int, retriever: Any, land: bool) -> float:
    """Seconds to prefetch ``records`` into a new store, ``window`` at a time."""
    size = sum(r.size for r in records)
    store = BlockStore([HostTier(2 * size)])
    gate = asyncio.Semaphore(window)

    async def one(record: ReplicaRecord) -> None:
        key = RecordKey(record.compat_id, record.scope_id, record.block_key)
        async with gate:
            if land:
                landed = await retriever.land([record], store, key)
                assert landed.info is not None
            else:
                got = await retriever([record])
                h = got.header
                store.put_layers(key, [(layer.k, layer.v) for layer in got.layers],
                                 token_count=h.token_count, first_layer=h.first_layer, codec=h.codec)

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in records))
    return time.perf_counter() - start


async def measure_prefetch(blocks: int, layers: int, layer_bytes: int, window: int,
                           datagram_size: int, backend: str, repeat: int) -> dict[str, float]:
    """Best seconds of each path (module docstring), each run on blocks new to the relay."""
    from ....control.client.moqt import MoqtBlockRetriever  # the instance's retriever

    common = ["--backend", backend, "--datagram-size", str(datagram_size)]
    relay, url = _spawn(_RELAYED, ["relay", *common, "--cache-mib", "256"])
    holder: subprocess.Popen[str] | None = None
    retriever = MoqtBlockRetriever(TransportConfig(backend=backend, insecure=True,
                                                   max_datagram_size=datagram_size))
    try:
        # A warm-up of each path, then repeat of each, alternated; every run on new blocks
        # (on qh3 at most QH3_ANNOUNCED blocks in all).
        runs = 2 * (repeat + 1)
        if backend == "qh3":
            runs = min(runs, max(4, QH3_ANNOUNCED // blocks // 2 * 2))
        holder, line = _spawn(_MODULE, ["holder", "--relay", url, "--blocks", str(runs * blocks),
                                        "--layers", str(layers), "--layer-kib", str(layer_bytes >> 10),
                                        *common])
        records = [ReplicaRecord.from_json(r) for r in json.loads(line)["records"]]
        await retriever.pool.get(url)  # we time the blocks, not the handshake
        best = {"land": float("inf"), "container": float("inf")}
        for run in range(runs):
            path = "land" if run % 2 == 0 else "container"
            took = await _timed(records[run * blocks:(run + 1) * blocks], window, retriever, path == "land")
            if run >= 2:  # after one warm-up of each
                best[path] = min(best[path], took)
        return best
    finally:
        await retriever.close()
        for p in (holder, relay):
            if p is not None:
                stop_process(p)


def prefetch_figures(blocks: int = BLOCKS, layers: int = LAYERS, layer_bytes: int = LAYER_KIB << 10,
                     window: int = 4, datagram_size: int = 16384, backend: str = "aioquic",
                     repeat: int = 3) -> list[Figure]:
    """The two rows (module docstring) beside the same run's TCP copy of the same octets."""
    octets = blocks * layers * layer_bytes
    data = np.random.default_rng(4).integers(0, 256, octets, dtype=np.uint8).tobytes()
    tcp = min((tcp_copy(data, layer_bytes) for _ in range(max(repeat, 3))), key=lambda t: t[0])[0]
    del data
    loop = new_event_loop(use_uvloop=True)
    try:
        got = loop.run_until_complete(measure_prefetch(blocks, layers, layer_bytes, window,
                                                       datagram_size, backend, repeat))
    finally:
        loop.close()
    params = {"blocks": blocks, "layers": layers, "layer_bytes": layer_bytes, "window": window,
              "backend": backend, "max_datagram_size": datagram_size, "relay": "own process, cold",
              "holder": "own process", "store": "host tier"}
    return [
        Figure("kv_prefetch_land", "ms", got["land"] * 1e3, "tcp_copy", tcp * 1e3, params=params),
        Figure("kv_prefetch_container", "ms", got["container"] * 1e3, "tcp_copy", tcp * 1e3, params=params),
        Figure("kv_prefetch_land_vs_container", "ms", got["land"] * 1e3, "kv_prefetch_container",
               got["container"] * 1e3, params=params),
    ]


# -- the holder process ---------------------------------------------------------------------------
async def _holder(args: argparse.Namespace, stop: asyncio.Future[None]) -> None:
    from ....kvsp.layout import Geometry

    layer_bytes = args.layer_kib << 10
    geo = Geometry.from_descriptor_fields(1, layer_bytes // 2, "fp8-e4m3")  # one token, octets
    rng = np.random.default_rng(5)
    store = BlockStore([HostTier(2 * args.blocks * args.layers * layer_bytes)])
    keys = [RecordKey(b"\x05" * 32, b"\x06" * 16, i.to_bytes(32, "big")) for i in range(args.blocks)]
    for key in keys:
        half = layer_bytes // 2
        store.put_layers(key, [(rng.bytes(half), rng.bytes(half)) for _ in range(args.layers)],
                         token_count=1, geometry=geo)
    await publish_through_relay(store, keys, args, stop)


def main(argv: list[str] | None = None) -> int:
    from .relayed import serve_until_stdin_closes

    p = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    p.add_argument("role", choices=("holder",))
    p.add_argument("--relay", required=True, help="the relay's moqt:// URL")
    p.add_argument("--blocks", type=int, default=BLOCKS)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--layer-kib", type=int, default=LAYER_KIB)
    p.add_argument("--backend", default="aioquic")
    p.add_argument("--datagram-size", type=int, default=16384)
    args = p.parse_args(argv)
    return serve_until_stdin_closes(lambda stop: _holder(args, stop))


if __name__ == "__main__":
    raise SystemExit(main())
