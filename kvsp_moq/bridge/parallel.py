"""Parallel block loads: one block's layers split into N contiguous layer ranges, each FETCHed
over its own QUIC connection (issue 9; docs/binding.md §5: "a layer range is an object range",
§12 implementation notes; docs/benchmarks.md "parallel loads" for when it pays).

Two kinds of workers:

* :class:`ConnectionWorkers` (``workers="connections"``): N QUIC connections (one
  :class:`MoqtPool` each) on the caller's event loop. One process, so the GIL serializes
  their per-packet Python work: this spreads a load over sources and connections, not cores.
* :class:`ProcessWorkers` (``workers="processes"``, :mod:`._workers`): N worker processes,
  each with its own event loop and connection, receiving straight into the caller's sink (a
  CPU :class:`~kvsp_moq.sinks.TorchSink` whose layers live in shared memory: no copy back).
  Each worker verifies its layers' digests as they land, exactly as a sequential load does
  (binding §4); the parent only checks the digest each reports against its own expected one
  (``LayerSink.accept_verified``).

Either way the caller's sink sees each layer become usable as soon as it is verified, so a
consumer that walks the layers in ascending order (:meth:`ParallelLoad.ascending`, or
``wait_for_layer`` l = first, first + 1, ...) starts on layer l when every layer <= l is in
(kvsp-draft §4.3). Layers are split into ranges by :func:`~.ranges.split_layers`; range i tries the
sources rotated by i (several replicas: ranges are striped across holders and relays, each
falling back to the others exactly as :class:`~.load.BlockLoad` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..kvsp.records import ReplicaRecord
from ..moqt.messages import Token
from ..sinks import LayerFailed, LayerState
from ..transport import TransportConfig
from ._workers import ProcessWorkers
from .load import BlockLoad, LoadResult, Sink, Source, sources_of
from .pool import MoqtPool
from .ranges import LoadWorkers, ParallelLoadError, WorkerKind, merge_results, rotated, split_layers

__all__ = [
    "ConnectionWorkers",
    "ParallelLoad",
    "load_block_parallel",
]

#: The reason a layer fails with when its load was cancelled.
CANCELLED = "the parallel load was cancelled"


class ConnectionWorkers:
    """``parallel`` QUIC connections on the caller's event loop, one :class:`MoqtPool`
    each (so ``parallel`` connections per holder URL). Reuse across loads keeps them open."""

    kind: WorkerKind = "connections"

    def __init__(self, parallel: int, config: TransportConfig | None = None, *,
                 connect_timeout: float = 5.0,
                 setup_tokens: Sequence[Token | bytes | str] = ()) -> None:
        if parallel < 1:
            raise ParallelLoadError(f"parallel must be >= 1, got {parallel}")
        self.parallel = parallel
        self.pools = [MoqtPool(config, connect_timeout=connect_timeout,
                                  setup_tokens=setup_tokens) for _ in range(parallel)]

    async def start(self) -> ConnectionWorkers:
        return self  # connections are opened on first use (or by warm)

    async def warm(self, urls: Sequence[str]) -> None:
        await asyncio.gather(*(pool.get(url) for pool in self.pools for url in urls))

    async def load_ranges(self, sink: Sink, sources: Sequence[Source],
                          ranges: Sequence[tuple[int, int]], timeout: float,
                          loads: list[BlockLoad | None]) -> list[LoadResult]:
        for i, rng in enumerate(ranges):
            loads[i] = BlockLoad(sink, rotated(sources, i), layers=rng, pool=self.pools[i],
                                 timeout=timeout)
        runs = [load.run() for load in loads if load is not None]
        return list(await asyncio.gather(*runs))

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools))

    async def __aenter__(self) -> ConnectionWorkers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ParallelLoad:
    """Loads ``layers`` (default: the sink's range) of one block into ``sink`` in up to
    ``workers.parallel`` contiguous ranges at once. ``await load.run()`` gives the merged
    :class:`LoadResult`; a consumer computing meanwhile awaits :meth:`wait_for_layer` (or
    iterates :meth:`ascending`). Cancelling ``run`` stops every range (worker processes are
    told to stop and acknowledged before it returns) and fails the layers not yet verified.
    """

    def __init__(self, sink: Sink, sources: Sequence[Source], workers: LoadWorkers, *,
                 layers: tuple[int, int] | None = None, parallel: int | None = None,
                 timeout: float = 30.0) -> None:
        first, last = layers or (sink.first_layer, sink.last_layer)
        if first < sink.first_layer or last > sink.last_layer or first > last:
            raise ValueError(f"layers {first}..{last} are not inside the sink's range")
        parallel = workers.parallel if parallel is None else parallel
        if not 1 <= parallel <= workers.parallel:
            raise ParallelLoadError(f"parallel={parallel}: the workers run "
                                    f"1..{workers.parallel} ranges at once")
        self.sink, self.sources, self.workers = sink, list(sources), workers
        self.first, self.last, self.timeout = first, last, timeout
        busy = [layer for layer in range(first, last + 1)
                if sink.delivering(layer)]
        if busy:
            raise ParallelLoadError(f"layers {busy} are being received by another load")
        missing = [layer for layer in range(first, last + 1)
                   if sink.state(layer) is not LayerState.READY]
        #: The ranges, ascending: range i is loaded by worker i.
        self.ranges = split_layers(missing, parallel)
        for layer in missing:  # failed by an earlier load: waiters now wait for this one
            if sink.state(layer) is LayerState.FAILED and sink.aborted is None:
                sink.retry(layer)
        self._loads: list[BlockLoad | None] = [None] * len(self.ranges)
        self._done = asyncio.Event()

    async def run(self) -> LoadResult:
        try:
            results = (await self.workers.load_ranges(self.sink, self.sources, self.ranges,
                                                      self.timeout, self._loads)
                       if self.ranges and self.sources else [])
        except asyncio.CancelledError:
            self._fail_unverified(CANCELLED)
            raise
        except BaseException as exc:
            self._fail_unverified(f"the parallel load failed: {exc}")
            raise
        finally:
            self._done.set()
        for (a, b), part in zip(self.ranges, results):
            # Processes report only final outcomes: a layer their worker could not deliver
            # fails here, with the range's last error (a dead worker, a digest mismatch...).
            errors = [x.error for x in part.attempts if x.error is not None]
            reason = errors[-1] if errors else "no source delivered the layer"
            for layer in range(a, b + 1):
                self.sink.abort(layer, reason)
        result = merge_results(results, self.first, self.last, self.sink)
        self._fail_unverified("no source delivered the layer")
        return result

    async def wait_for_layer(self, layer: int) -> Any:
        """``(K, V)`` of ``layer`` once verified; :class:`LayerFailed` once its range has no
        source left (a range's fallback to its next source does not raise here)."""
        while True:
            try:
                return await self.sink.wait_for_layer(layer)
            except LayerFailed:
                if self._done.is_set():
                    raise  # the load is over: the failure is final
                load = self._load_of(layer)
                if load is not None:  # in process: it waits out the fallback rounds
                    return await load.wait_for_layer(layer)
                await self._done.wait()  # then the loop reads the final state

    async def ascending(self) -> AsyncIterator[tuple[int, Any]]:
        """(layer, (K, V)) in ascending layer order, each as soon as it and every layer
        before it are verified; LayerFailed at the first layer no source delivered."""
        for layer in range(self.first, self.last + 1):
            yield layer, await self.wait_for_layer(layer)

    def _load_of(self, layer: int) -> BlockLoad | None:
        for (a, b), load in zip(self.ranges, self._loads):
            if a <= layer <= b:
                return load
        return None

    def _fail_unverified(self, reason: str) -> None:
        """Layers left expected or in flight fail (``abort`` keeps an earlier reason)."""
        for layer in range(self.first, self.last + 1):
            self.sink.abort(layer, reason)


def make_workers(kind: WorkerKind, parallel: int, config: TransportConfig | None = None, *,
                 connect_timeout: float = 5.0) -> LoadWorkers:
    """A new (not yet started) set of workers of ``kind``."""
    if kind == "connections":
        return ConnectionWorkers(parallel, config, connect_timeout=connect_timeout)
    if kind == "processes":
        return ProcessWorkers(parallel, config, connect_timeout=connect_timeout)
    raise ParallelLoadError(f"unknown workers {kind!r} (connections, processes)")


async def load_block_parallel(
        records: ReplicaRecord | Source | Sequence[ReplicaRecord | Source], sink: Sink, *,
        parallel: int | None = None, workers: WorkerKind | LoadWorkers = "connections",
        layers: tuple[int, int] | None = None, config: TransportConfig | None = None,
        timeout: float = 30.0, connect_timeout: float = 5.0) -> LoadResult:
    """:func:`~.instance.load_block`, in ``parallel`` contiguous layer ranges at once.

    ``workers``: ``"connections"`` or ``"processes"`` (a set is started for this load and
    closed after it: worker processes take ~1-2 s each to start, so engines keep one set,
    :class:`~._workers.ProcessWorkers`, and pass it), or such a set (``parallel`` defaults
    to its size). ``"processes"`` needs a CPU torch sink; it is moved to shared memory if it
    is not there yet (``TorchSink(shared_memory=True)`` avoids that copy).
    """
    sources, skipped = sources_of(records, sink)
    own = isinstance(workers, str)
    if isinstance(workers, str):
        if parallel is None:
            raise ParallelLoadError("parallel= is needed when workers is a kind")
        pool: LoadWorkers = make_workers(workers, parallel, config,
                                         connect_timeout=connect_timeout)
    else:
        pool = workers
    try:
        if own:
            await pool.start()
        result = await ParallelLoad(sink, sources, pool, layers=layers, parallel=parallel,
                                    timeout=timeout).run()
    finally:
        if own:
            await pool.close()
    result.attempts[:0] = skipped
    return result
