"""The child side of :class:`~._workers.ProcessWorkers`: one worker process of a parallel
block load (issue 9; docs/binding.md §12).

A worker runs its own event loop and :class:`MoqtPool` (its own QUIC connections, kept
across loads) and serves jobs sent by the parent over a ``multiprocessing`` pipe. A job is
one layer range ``first..last`` of one block (binding §5: an object range FETCH): the worker
builds a :class:`TorchSink` over its slice of the parent's shared buffer (the tensor arrives
through ``torch.multiprocessing``'s file-descriptor passing: no copy), runs a
:class:`BlockLoad` on it (every layer verified against the parent's expected digests, with the
same source fallback as a sequential load) and reports each verified layer the moment its
digest matched. Messages (tuples, first item the kind):

parent -> worker: ``("load", job, JobSpec)``, ``("cancel", job)``, ``("warm", req, url)``,
``("stop",)``. worker -> parent: ``("ready", pid)``, ``("layer", job, layer, digest)``,
``("done", job, LoadResult)`` (also after a cancel: the parent waits for it before it lets
the caller reuse the buffer), ``("warmed", req, error | None)``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ..kvsp.layout import Geometry
from ..moqt.messages import Token
from ..sinks import TorchSink
from ..transport import TransportConfig, new_event_loop
from .load import Attempt, BlockLoad, LoadResult, Source
from .pool import MoqtPool

__all__ = ["JobSpec", "worker_main"]


@dataclass
class JobSpec:
    """One range of one block for one worker."""

    sources: list[Source]
    first: int
    last: int
    geometry: Geometry
    tokens: int
    #: Expected digest of every layer first..last (the parent sink's).
    digests: dict[int, bytes]
    #: Layers of the range the parent already holds verified (not asked for).
    ready: tuple[int, ...]
    #: The parent's shared flat uint8 storage of layers first..last (fd-passed).
    storage: Any
    timeout: float


class _ReportingSink(TorchSink):
    """A TorchSink over the parent's buffer that reports each layer once it is verified."""

    def __init__(self, spec: JobSpec, report: Callable[[int, bytes], None]) -> None:
        super().__init__(spec.geometry, spec.tokens, (spec.first, spec.last), spec.digests,
                         storage=spec.storage)
        self._report = report

    def _publish(self, position: int) -> None:
        super()._publish(position)
        layer = self.first_layer + position
        digest = self.expected_digest(layer)
        assert digest is not None  # end_layer publishes only a layer whose digest matched
        self._report(layer, digest)


class _Worker:
    def __init__(self, conn: Connection, config: TransportConfig | None,
                 connect_timeout: float, setup_tokens: Sequence[Token | bytes | str]) -> None:
        self.conn = conn
        self.pool = MoqtPool(config, connect_timeout=connect_timeout,
                                setup_tokens=setup_tokens)
        self.jobs: dict[int, asyncio.Task[None]] = {}
        self.others: set[asyncio.Task[None]] = set()
        self.stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._readable)
        self.conn.send(("ready", os.getpid()))
        try:
            await self.stop
        finally:
            loop.remove_reader(self.conn.fileno())
            tasks = [*self.jobs.values(), *self.others]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.pool.close()

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop
            if not self.stop.done():
                self.stop.set_result(None)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "load":
            job, spec = msg[1], msg[2]
            task = asyncio.ensure_future(self._run(job, spec))
            self.jobs[job] = task
            task.add_done_callback(lambda _t: self.jobs.pop(job, None))
        elif kind == "cancel":
            running = self.jobs.get(msg[1])
            if running is not None:
                running.cancel()
        elif kind == "warm":
            other = asyncio.ensure_future(self._warm(msg[1], msg[2]))
            self.others.add(other)
            other.add_done_callback(self.others.discard)
        elif kind == "stop" and not self.stop.done():
            self.stop.set_result(None)

    async def _warm(self, req: int, url: str) -> None:
        error: str | None = None
        try:
            await self.pool.get(url)
        except Exception as exc:  # reported to the parent, which raises it
            error = f"{url}: cannot connect ({exc!r})"
        self.conn.send(("warmed", req, error))

    async def _run(self, job: int, spec: JobSpec) -> None:
        sink = _ReportingSink(spec, lambda layer, digest: self.conn.send(
            ("layer", job, layer, digest)))
        spec.storage = None  # the sink holds the only reference: released below
        rng = (spec.first, spec.last)
        load: BlockLoad | None = None
        try:
            for layer in spec.ready:
                sink.accept_verified(layer, spec.digests[layer])
            load = BlockLoad(sink, spec.sources, pool=self.pool, timeout=spec.timeout)
            result = await load.run()
        except asyncio.CancelledError:
            result = load.result() if load is not None else LoadResult((), (), [])
            result.attempts.append(Attempt("", rng, (), "cancelled"))
        except Exception as exc:  # a bug or a broken sink: the parent recomputes the range
            result = load.result() if load is not None else LoadResult((), (), [])
            result.attempts.append(Attempt("", rng, (), f"worker error: {exc!r}"))
        finally:
            # No write into the parent's buffer after "done": every fetch of the load has
            # ended (BlockLoad cancels its streams on the way out) and the mapping goes now.
            sink.release_storage()
            del sink
        self.conn.send(("done", job, result))


def worker_main(conn: Connection, config: TransportConfig | None, connect_timeout: float,
                setup_tokens: Sequence[Token | bytes | str]) -> None:
    """The worker process's entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    import torch.multiprocessing  # noqa: F401  (rebuilds fd-passed shared tensors)

    gc.collect()
    gc.freeze()  # the imports' objects out of the cyclic GC's reach (docs/perf/README.md)
    loop = new_event_loop(use_uvloop=True)

    async def main() -> None:
        await _Worker(conn, config, connect_timeout, setup_tokens).serve()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        conn.close()
