"""The parallel figures of ``kvsp bench kv --parallel 1,2,4 [--workers connections,processes]``
(issue 9): one block split into N contiguous layer ranges, each FETCHed over its own QUIC
connection (``kvsp_moq.bridge.parallel``; binding §5: a layer range is an object range), into
a fresh torch sink (CPU; in shared memory for worker processes) with every layer verified.

One set of workers of each kind, as large as the largest N, is started and connected before
the clock (``warm``); a load with N uses the first N. The N values are measured round-robin
(warm-up round first), so drift on a shared machine hits every N alike; per N the best and
the median of ``repeat`` runs are kept.

With several replicas (``--holders H``: H holder processes serving the same block, as a
block replicated on H holders, or one holder host running H serving processes), range i is
read from replica i mod H, so the sending side scales with cores as the receiving side does.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence

from ....bridge import ConnectionWorkers, ParallelLoad, ProcessWorkers, Source, sink_for_record
from ....bridge.ranges import LoadWorkers, WorkerKind
from ....kvsp.layout import Geometry
from ....kvsp.records import ReplicaRecord
from ....transport import TransportConfig

__all__ = ["KINDS", "ParallelTiming", "measure_parallel", "timed_parallel_load"]

KINDS: tuple[WorkerKind, ...] = ("connections", "processes")

#: (best first-layer s, best block s, median block s) per (N, kind).
ParallelTiming = tuple[float, float, float]


async def timed_parallel_load(records: Sequence[ReplicaRecord], geo: Geometry, tokens: int,
                              workers: LoadWorkers, parallel: int) -> tuple[float, float]:
    """One verified load of the block in ``parallel`` ranges from the replicas ``records``
    (range i from replica i mod len first: ``bridge.ranges.rotated``); (first layer s,
    block s)."""
    sink = sink_for_record(records[0], geo, tokens, backend="torch",
                           shared_memory=workers.kind == "processes")
    load = ParallelLoad(sink, [Source.from_record(r) for r in records], workers,
                        parallel=parallel, timeout=600.0)
    start = time.perf_counter()
    first: list[float] = []

    def first_layer(_fut: object) -> None:
        first.append(time.perf_counter())

    task = asyncio.ensure_future(sink.wait_for_layer(sink.first_layer))
    task.add_done_callback(first_layer)
    result = await load.run()
    end = time.perf_counter()
    await task
    if not result.complete:
        raise AssertionError(f"parallel load incomplete: {result.attempts}")
    return first[0] - start, end - start


async def measure_parallel(records: Sequence[ReplicaRecord], geo: Geometry, tokens: int,
                           config: TransportConfig, parallel: Sequence[int],
                           kinds: Sequence[WorkerKind], repeat: int
                           ) -> dict[tuple[int, WorkerKind], ParallelTiming]:
    out: dict[tuple[int, WorkerKind], ParallelTiming] = {}
    top = max(parallel)
    for kind in kinds:
        workers: LoadWorkers = (ConnectionWorkers(top, config, connect_timeout=30.0)
                                if kind == "connections"
                                else ProcessWorkers(top, config, connect_timeout=30.0))
        try:
            await workers.start()
            await workers.warm([r.holder for r in records])
            runs: dict[int, list[tuple[float, float]]] = {n: [] for n in parallel}
            for round_ in range(repeat + 1):
                for n in parallel:
                    timing = await timed_parallel_load(records, geo, tokens, workers, n)
                    if round_:  # round 0 warms every N up
                        runs[n].append(timing)
            for n, timings in runs.items():
                best = min(timings, key=lambda t: t[1])
                out[(n, kind)] = (best[0], best[1], statistics.median(t[1] for t in timings))
        finally:
            await workers.close()
    return out
