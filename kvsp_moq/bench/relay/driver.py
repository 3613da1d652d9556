"""``kvsp bench relay``: MOQT through the relay on loopback.

* Fan-out: 1 publisher → relay → N subscribers (N = 1, 4, 8): delivered MB/s = N × bytes /
  (first object written → last object received by every subscriber). Baseline, same run:
  the same publisher → 1 subscriber directly (no relay).
* FETCH latency through the relay: cold (cache miss: relay → publisher and back) as the
  baseline, warm (served from the relay's cache) as the value; both for the same range.
* FETCH rate through the relay against the same FETCH straight from the publisher (same run,
  issue #28 targets: cold ≥ 0.8x, warm ≥ 1.0x direct).

Every fan-out figure carries the CPU it cost per GiB delivered (``params``): the relay
process's (all its threads, from ``/proc``) and the bench process's (publisher and, unless
``--subscriber-processes``, the subscribers), so a figure bound by the cores of a small machine
says so.

The relay runs as its own process (``python -m relay``; kvsp_moq.bench may not import the
relay package, tests/test_layering.py), as it would be deployed. Default workload: 8 MiB as
32 objects of 256 KiB per run, max datagram size 16384 on every endpoint: ≈ 30 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...moqt.objects import ObjectBegin
from ...pubsub import Catalog, MoqtSession, Subscription, TrackPublisher, connect, serve
from ...transport import TransportConfig, new_event_loop
from ...transport.tls import make_self_signed
from ..report import Figure
from .subscriber import SubscriberProcesses

FANOUT = (1, 4, 8)
_NS = ("kvsp-bench", "relay")


class _RelayProcess:
    def __init__(self, datagram_size: int, cache_mib: int, workers: int = 1) -> None:
        self.args = ["--listen", "127.0.0.1:0", "--max-datagram-size", str(datagram_size),
                     "--cache-mib", str(cache_mib), "--subscriber-queue-mib", "256",
                     "--drain-timeout", "2", "--workers", str(workers)]
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def __aenter__(self) -> _RelayProcess:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", *self.args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 90)).decode().strip()
        if not line.startswith("relay listening on "):
            raise RuntimeError(f"relay did not start: {line!r}")
        self.url = line.rsplit(" ", 1)[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` (None: this one, to the
    nanosecond) so far; for another process from ``/proc`` (clock ticks: 10 ms), 0.0 where
    it cannot tell (the figure then has no relay CPU column)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class _Run:
    """One timed run: seconds, and the CPU seconds the relay and this process spent in it."""
    seconds: float
    relay_cpu: float | None = None  # None: no relay (the direct run)
    bench_cpu: float = 0.0

    def cpu_params(self, delivered_bytes: int) -> dict[str, object]:
        gib = delivered_bytes / (1 << 30)
        doc: dict[str, object] = {"bench_process_cpu_s_per_gib": round(self.bench_cpu / gib, 3)}
        if self.relay_cpu is not None:
            doc["relay_cpu_s_per_gib"] = round(self.relay_cpu / gib, 3)
        return doc


def _into(view: memoryview, object_size: int) -> Callable[[ObjectBegin], memoryview]:
    """An ``on_object_begin``: object ``i`` lands in ``view[i * object_size:][:object_size]``."""
    return lambda info: view[info.object_id * object_size:(info.object_id + 1) * object_size]


async def _fanout_once(data: bytes, object_size: int, n_subs: int, datagram_size: int,
                       via_relay: bool, processes: bool = False, workers: int = 1) -> _Run:
    """Seconds from the first object written to the last one received by every subscriber
    (``processes``: each subscriber in its own process, ``.subscriber``), with the CPU the
    relay process and this one spent meanwhile."""
    cert = make_self_signed()
    client_cfg = TransportConfig(insecure=True, max_datagram_size=datagram_size, use_uvloop=True)
    count = len(data) // object_size
    catalog = Catalog()
    track = catalog.add(TrackPublisher(_NS, "block", keep=False))
    server = None
    relay: _RelayProcess | None = None
    sessions = []
    try:
        if via_relay:
            relay = await _RelayProcess(datagram_size, 64, workers).__aenter__()
            pub = await connect(relay.url, client_cfg, catalog=catalog)
            sessions.append(pub)
            await pub.publish_namespace(_NS)
            url = relay.url
        else:
            server = await serve("127.0.0.1", 0, TransportConfig(
                certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
                max_datagram_size=datagram_size, use_uvloop=True),
                catalog=catalog)
            url = f"moqt://127.0.0.1:{server.port}/bench"
        relay_pid = relay.proc.pid if relay is not None and relay.proc is not None else None
        if processes:
            return await _fanout_processes(data, object_size, n_subs, datagram_size, url, track,
                                           relay_pid)
        bufs = [bytearray(len(data)) for _ in range(n_subs)]
        subs = []
        for buf in bufs:
            s = await connect(url, client_cfg)
            sessions.append(s)
            view = memoryview(buf)
            subs.append(await s.subscribe(_NS, "block",
                                          on_object_begin=_into(view, object_size)))
        await track.subscribed.wait()

        async def drain(sub: Subscription) -> None:
            got = 0
            async for _obj in sub:
                got += 1
                if got == count:
                    return

        cpu0 = (_cpu_seconds(relay_pid) if relay_pid else 0.0, _cpu_seconds())
        start = time.perf_counter()
        readers = [asyncio.ensure_future(drain(sub)) for sub in subs]
        for i in range(count):
            await track.write_object(0, i, memoryview(data)[i * object_size:(i + 1) * object_size])
        await asyncio.gather(*readers)
        elapsed = time.perf_counter() - start
        run = _Run(elapsed, _cpu_seconds(relay_pid) - cpu0[0] if relay_pid else None,
                   _cpu_seconds() - cpu0[1])
        for buf in bufs:
            if buf != data:
                raise AssertionError("relay fan-out corrupted the data")
        return run
    finally:
        for s in sessions:
            await s.close()
        if server is not None:
            server.close()
            await server.wait_closed()
        if relay is not None:
            await relay.__aexit__()


async def _fanout_processes(data: bytes, object_size: int, n_subs: int, datagram_size: int,
                            url: str, track: TrackPublisher, relay_pid: int | None) -> _Run:
    """:func:`_fanout_once` with the subscribers in their own processes: from the first object
    written to the latest ``last`` they report (one CLOCK_MONOTONIC for the host)."""
    count = len(data) // object_size
    procs = SubscriberProcesses(n_subs, url, object_size, count, datagram_size)
    try:
        await procs.start()
        await track.subscribed.wait()
        cpu0 = (_cpu_seconds(relay_pid) if relay_pid else 0.0, _cpu_seconds())
        start = time.monotonic()
        for i in range(count):
            await track.write_object(0, i, memoryview(data)[i * object_size:(i + 1) * object_size])
        results = await procs.results()
        cpu1 = (_cpu_seconds(relay_pid) if relay_pid else 0.0, _cpu_seconds())
    finally:
        await procs.close()
    digest = hashlib.sha256(data).hexdigest()
    if any(sha != digest for _, sha in results):
        raise AssertionError("relay fan-out corrupted the data")
    return _Run(max(last for last, _ in results) - start,
                cpu1[0] - cpu0[0] if relay_pid else None, cpu1[1] - cpu0[1])


async def _timed_fetch(session: MoqtSession, name: str, data: bytes, count: int, where: str) -> float:
    """Seconds for one FETCH of all ``count`` objects of track ``name``, its bytes checked."""
    t0 = time.perf_counter()
    f = await session.fetch(_NS, name, start=(0, 0), end=(0, count - 1))
    objs = await f.collect()
    seconds = time.perf_counter() - t0
    if len(objs) != count or b"".join(bytes(o.payload) for o in objs) != data:
        raise AssertionError(f"FETCH {where} returned other bytes")
    return seconds


async def _fetch_latency(data: bytes, object_size: int, datagram_size: int,
                         repeat: int) -> tuple[float, float]:
    """(cold, warm) seconds for FETCH of the whole range through the relay: cold = the
    first FETCH of a new track (relay → publisher), warm = the same range again (cache)."""
    client_cfg = TransportConfig(insecure=True, max_datagram_size=datagram_size, use_uvloop=True)
    count = len(data) // object_size
    colds: list[float] = []
    warms: list[float] = []
    async with _RelayProcess(datagram_size, 256) as relay:
        catalog = Catalog()
        pub = await connect(relay.url, client_cfg, catalog=catalog)
        await pub.publish_namespace(_NS)
        sub = await connect(relay.url, client_cfg)
        try:
            for r in range(repeat):
                name = f"stored-{r}"
                track = catalog.create(_NS, name, keep=True)
                for i in range(count):
                    await track.write_object(0, i, data[i * object_size:(i + 1) * object_size])
                for bucket in (colds, warms):
                    bucket.append(await _timed_fetch(sub, name, data, count, "through the relay"))
        finally:
            await sub.close()
            await pub.close()
    return min(colds), min(warms)


async def _fetch_direct(data: bytes, object_size: int, datagram_size: int, repeat: int) -> float:
    """Seconds for the same FETCH straight from the publisher (no relay): the baseline of the
    relay's cold and warm FETCH rates."""
    cert = make_self_signed()
    client_cfg = TransportConfig(insecure=True, max_datagram_size=datagram_size, use_uvloop=True)
    count = len(data) // object_size
    catalog = Catalog()
    track = catalog.create(_NS, "stored", keep=True)
    for i in range(count):
        await track.write_object(0, i, data[i * object_size:(i + 1) * object_size])
    server = await serve("127.0.0.1", 0, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
        max_datagram_size=datagram_size, use_uvloop=True), catalog=catalog)
    sub = await connect(f"moqt://127.0.0.1:{server.port}/bench", client_cfg)
    times: list[float] = []
    try:
        for _ in range(repeat):
            times.append(await _timed_fetch(sub, "stored", data, count, "from the publisher"))
    finally:
        await sub.close()
        server.close()
        await server.wait_closed()
    return min(times)


def run(run_bytes: int = 8 << 20, object_size: int = 256 << 10, datagram_size: int = 16384,
        fanout: tuple[int, ...] = FANOUT, repeat: int = 1,
        subscriber_processes: bool = False, relay_workers: int = 1) -> list[Figure]:
    data = os.urandom(run_bytes)
    loop = new_event_loop(use_uvloop=True)
    figures: list[Figure] = []
    try:
        procs = subscriber_processes
        direct = min((loop.run_until_complete(_fanout_once(data, object_size, 1, datagram_size,
                                                           False, procs)) for _ in range(repeat)),
                     key=lambda r: r.seconds)
        direct_mbps = run_bytes / direct.seconds / 1e6
        params = {"run_bytes": run_bytes, "object_size": object_size,
                  "max_datagram_size": datagram_size, "backend": TransportConfig().backend,
                  "subscribers_in": "own processes" if procs else "the bench process",
                  "relay_workers": relay_workers}
        tag = f"_workers{relay_workers}" if relay_workers > 1 else ""
        delivered: dict[int, float] = {}
        for n in fanout:
            t = min((loop.run_until_complete(_fanout_once(data, object_size, n, datagram_size,
                                                          True, procs, relay_workers))
                     for _ in range(repeat)), key=lambda r: r.seconds)
            delivered[n] = n * run_bytes / t.seconds / 1e6
            figures.append(Figure(f"relay_fanout_{n}{tag}_delivered", "MB/s", delivered[n],
                                  "direct_1_subscriber", direct_mbps,
                                  params={**params, "subscribers": n,
                                          **t.cpu_params(n * run_bytes),
                                          "direct_bench_process_cpu_s_per_gib":
                                              direct.cpu_params(run_bytes)["bench_process_cpu_s_per_gib"]}))
        most = max(delivered)
        if 1 in delivered and most > 1:
            # How fan-out scales through the relay: N subscribers' delivered bytes/s against
            # one subscriber's through the same relay (issue #9 target: >= 4x at N = 8).
            figures.append(Figure(f"relay_fanout_{most}{tag}_vs_1", "MB/s", delivered[most],
                                  f"relay_fanout_1{tag}_delivered", delivered[1],
                                  params={**params, "subscribers": most}))
        cold, warm = loop.run_until_complete(
            _fetch_latency(data, object_size, datagram_size, max(repeat, 2)))
        figures.append(Figure("relay_fetch_warm_cache", "ms", warm * 1e3,
                              "relay_fetch_cold_cache", cold * 1e3, params=params))
        fetched = loop.run_until_complete(_fetch_direct(data, object_size, datagram_size,
                                                        max(repeat, 2)))
        fetch_mbps = run_bytes / fetched / 1e6
        for kind, seconds in (("cold", cold), ("warm", warm)):
            figures.append(Figure(f"relay_fetch_{kind}_rate", "MB/s", run_bytes / seconds / 1e6,
                                  "direct_fetch_rate", fetch_mbps, params=params))
    finally:
        loop.close()
    return figures
