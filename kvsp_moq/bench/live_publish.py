"""The holder's CPU per GiB for a live (SUBSCRIBEd) block on the native backend, sent from the
store without a copy (issue 28, step 3; docs/transport.md "Sending from the store (no copy)").

``kvsp bench live [--layers 32] [--repeat 3]`` (or ``python -m kvsp_moq.bench.live_publish``): this process is the holder
(``MoqtHolder`` serving on 127.0.0.1, native backend); one subscriber runs in a process of its
own (native backend, payloads landed in one preallocated buffer), so that the CPU counted is the
holder's alone. For each run the holder begins a block of ``--layers`` layers of 1 MiB,
SUBSCRIBEd before its first layer, writes the layers one after another as a producer does
(``BlockWriter.write_layer``: each goes to the subscriber the moment it is stored), and counts
its CPU (``getrusage``: every thread, the extension's network thread included) from the first
layer until the subscriber has the whole block (its SHA-256 checked).

Baseline, same run, alternated with it run by run: the same publication with the layers sent
as any payload (``stable=False``: copied into the extension's send buffer, and frozen by a
backlog that must queue them) — the path every live layer took before. Figures (the best of
``--repeat`` runs each, per QUIC datagram size): ``live_publish_cpu_s_per_gib_dgramN``, the
holder's whole CPU, and ``live_publish_send_cpu_s_per_gib_dgramN``, the same less the CPU of
``write_layer`` itself (the copy into the store and the digest: the producer's, the same in
both); ``params`` carry that part and the best wall rates.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import resource
import sys
import time
from typing import Any

import numpy as np

from ..bridge import BlockTrack, MoqtHolder
from ..kvsp.layout import Geometry
from ..pubsub import connect
from ..storage import BlockStore, HostTier, RecordKey
from ..transport import TransportConfig
from ..transport.tls import make_self_signed
from .report import Figure, emit

MiB = 1 << 20
GiB = 1 << 30
GUARD = 60.0
DATAGRAM_SIZES = (1452, 16384)
#: A layer of 1 MiB: 256 tokens x 8 KV heads x 128 x bf16, K and V.
GEOMETRY = Geometry.from_descriptor_fields(8, 128, "bf16")
TOKENS = 256


class _CopyingTrack(BlockTrack):
    """The baseline: a block track whose live layers are sent as any payload (copied)."""

    async def write_object(self, group: int, object_id: int, payload: Any, *,
                           properties: Any = (), priority: int | None = None,
                           stable: bool = False) -> None:
        await super().write_object(group, object_id, payload, properties=properties,
                                   priority=priority, stable=False)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Subscriber:
    """This module with ``--subscribe URL``: a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str, datagram_size: int) -> _Subscriber:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq.bench.live_publish", "--subscribe", url, "--datagram-size",
            str(datagram_size), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return cls(proc)

    async def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self.answer()

    async def answer(self) -> str:
        assert self.proc.stdout is not None
        got = await asyncio.wait_for(self.proc.stdout.readline(), GUARD)
        if not got:
            raise RuntimeError("the subscriber process ended")
        return got.decode().strip()

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), GUARD)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _publish_once(holder: MoqtHolder, sub: _Subscriber, layers: int, stable: bool,
                        run: int) -> tuple[float, float, float]:
    """One live block: (holder CPU seconds, of which in write_layer, wall seconds)."""
    rng = np.random.default_rng(run)
    key = RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))
    shape = GEOMETRY.shape(TOKENS)
    kv = [tuple(rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
                .view(GEOMETRY.numpy_dtype).reshape(shape) for _ in range(2))
          for _ in range(layers)]
    track: BlockTrack | None
    if stable:
        writer = holder.begin(key, GEOMETRY, layers, TOKENS)
        track = holder.track(key)
        assert track is not None
    else:  # MoqtHolder.begin with the baseline's track
        writer = holder.store.begin(key, GEOMETRY, layers, TOKENS)
        track = _CopyingTrack(holder.store, key)
        holder.catalog.add(track)
        writer.add_listener(track.layer_written)
    namespace = ",".join(f.hex() for f in track.namespace)
    if await sub.ask(f"{namespace} {layers}") != "subscribed":
        raise RuntimeError("the subscriber did not subscribe")
    cpu, wall, in_write = _cpu(), time.perf_counter(), 0.0
    for layer, (k, v) in enumerate(kv):
        t = time.thread_time()
        writer.write_layer(layer, k, v)
        in_write += time.thread_time() - t
        await asyncio.sleep(0)  # the track's sender runs between layers, as with a producer
    writer.finish()
    got = await sub.answer()
    cpu, wall = _cpu() - cpu, time.perf_counter() - wall
    whole = hashlib.sha256(b"".join(holder.store.layer_payload(key, layer, touch=False)
                                    for layer in range(layers))).hexdigest()
    if got != f"done {whole}":
        raise AssertionError(f"the subscriber got another block: {got}")
    holder.catalog.remove(track.namespace, track.name)
    holder.store.remove(key)
    return cpu, in_write, wall


async def _measure(layers: int, repeat: int) -> list[Figure]:
    cert = make_self_signed()
    figures: list[Figure] = []
    for size in DATAGRAM_SIZES:
        holder = MoqtHolder(BlockStore([HostTier(4 * layers * MiB)]))
        url = await holder.serve("127.0.0.1", 0, TransportConfig(
            certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, backend="native",
            max_datagram_size=size))
        sub = await _Subscriber.start(url, size)
        try:
            best: dict[bool, tuple[float, float, float]] = {}  # the least CPU
            fastest: dict[bool, float] = {}  # the shortest wall time
            for run in range(1 + repeat):  # the first pair warms up
                for stable in (False, True):
                    got = await _publish_once(holder, sub, layers, stable, run)
                    if run and (stable not in best or got[0] < best[stable][0]):
                        best[stable] = got
                    if run:
                        fastest[stable] = min(fastest.get(stable, got[2]), got[2])
        finally:
            await sub.close()
            await holder.close()
        gib = layers * MiB / GiB
        (cpu, write, _), (base_cpu, base_write, _) = best[True], best[False]
        params: dict[str, object] = {
            "layers": layers, "layer_bytes": MiB, "backend": "native",
            "best_mb_per_s": round(layers * MiB / fastest[True] / 1e6),
            "baseline_best_mb_per_s": round(layers * MiB / fastest[False] / 1e6)}
        figures.append(Figure(
            f"live_publish_cpu_s_per_gib_dgram{size}", "CPU s/GiB", cpu / gib,
            "copied (stable=False)", base_cpu / gib,
            params=params | {"write_layer_cpu_s_per_gib": round(write / gib, 3),
                             "baseline_write_layer_cpu_s_per_gib": round(base_write / gib, 3)}))
        figures.append(Figure(
            f"live_publish_send_cpu_s_per_gib_dgram{size}", "CPU s/GiB", (cpu - write) / gib,
            "copied (stable=False)", (base_cpu - base_write) / gib, params=params))
    return figures


async def _subscribe(url: str, datagram_size: int) -> None:
    """The subscriber: for each ``NAMESPACE LAYERS`` line on stdin, SUBSCRIBE to its ``raw``
    track, print ``subscribed``, land the layers in one buffer, print ``done SHA256``."""
    session = await connect(url, TransportConfig(insecure=True, backend="native",
                                                 max_datagram_size=datagram_size))
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            namespace, layers = line.split()
            buf = bytearray(int(layers) * MiB)
            view = memoryview(buf)
            sub = await session.subscribe(
                [bytes.fromhex(f) for f in namespace.split(",")], "raw",
                on_object_begin=lambda o: view[o.object_id * MiB:(o.object_id + 1) * MiB])
            print("subscribed", flush=True)
            async for _ in sub:
                pass
            print("done", hashlib.sha256(buf).hexdigest(), flush=True)
    finally:
        await session.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.bench.live_publish",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=32, help="layers of 1 MiB per block")
    p.add_argument("--repeat", type=int, default=3, help="runs of each kind (best kept)")
    p.add_argument("--subscribe", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--datagram-size", type=int, default=1452, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.subscribe:
        asyncio.run(_subscribe(args.subscribe, args.datagram_size))
        return
    emit(asyncio.run(_measure(args.layers, args.repeat)))


if __name__ == "__main__":
    main()
