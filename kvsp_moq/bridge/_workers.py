"""Worker processes of a parallel block load, the parent side (issue 9; docs/binding.md §12).

Python's GIL serializes the per-packet work of every QUIC connection of one process (the
receive side is the bottleneck, docs/perf/README.md), so :class:`ProcessWorkers` runs each
layer range in its own process (:mod:`._worker_main`). The caller's sink must be a CPU
:class:`~kvsp_moq.sinks.TorchSink` in shared memory: its storage is handed to the workers by
file descriptor (``torch.multiprocessing``, strategy ``file_descriptor``: the shared segment
has no name in ``/dev/shm`` and is freed when the last process drops its mapping), each worker
receives its range straight into it and verifies each layer there; the parent marks a layer
usable when the worker reports it (``LayerSink.accept_verified``, which checks the reported
digest against the parent's own).

Lifecycle: ``await ProcessWorkers(n, config).start()`` spawns the processes (``spawn`` start
method: the caller's event loop, threads and QUIC sockets are not inherited) and waits until
each is ready; ``close()`` stops them (SIGKILL after ``stop_timeout``); they are daemonic, so
they also go when the parent exits. A worker that dies fails the layers of its range (the
result lists them to recompute, the attempt says why); the set then refuses further loads
(``ParallelLoadError``): start a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ..moqt.messages import Token
from ..sinks import LayerSink, LayerState, SinkError, TorchSink
from ..transport import TransportConfig
from ._worker_main import JobSpec, worker_main
from .load import Attempt, BlockLoad, LoadResult, Source
from .ranges import ParallelLoadError, WorkerKind, rotated

__all__ = ["ProcessWorkers"]

Sink = LayerSink[Any]


@dataclass
class _Job:
    id: int
    sink: Sink
    first: int
    last: int
    done: asyncio.Future[LoadResult]
    problems: list[str] = field(default_factory=list)


@dataclass
class _Proc:
    index: int
    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[int]
    jobs: dict[int, _Job] = field(default_factory=dict)
    warms: dict[int, asyncio.Future[str | None]] = field(default_factory=dict)
    dead: str | None = None
    reading: bool = False


class ProcessWorkers:
    """``parallel`` worker processes, each with its own event loop and QUIC connections
    (kept across loads: ``warm`` connects them before a timed load)."""

    kind: WorkerKind = "processes"

    def __init__(self, parallel: int, config: TransportConfig | None = None, *,
                 connect_timeout: float = 5.0, setup_tokens: Sequence[Token | bytes | str] = (),
                 start_timeout: float = 120.0, cancel_timeout: float = 10.0,
                 stop_timeout: float = 10.0) -> None:
        if parallel < 1:
            raise ParallelLoadError(f"parallel must be >= 1, got {parallel}")
        self.parallel = parallel
        self.config = config or TransportConfig()  # verifies the server (docs/security.md)
        self.connect_timeout = connect_timeout
        self.setup_tokens = tuple(setup_tokens)
        self.start_timeout = start_timeout
        self.cancel_timeout = cancel_timeout
        self.stop_timeout = stop_timeout
        self._procs: list[_Proc] = []
        self._ids = itertools.count(1)
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> ProcessWorkers:
        """Spawn the processes and wait until each is ready; ParallelLoadError (after
        stopping those that did start) when one does not start within ``start_timeout``."""
        if self._procs:
            return self
        try:
            import torch.multiprocessing  # noqa: F401  (fd passing of shared tensors)
        except ImportError as exc:
            raise ParallelLoadError("workers='processes' needs torch") from exc
        ctx = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        try:
            for i in range(self.parallel):
                mine, theirs = ctx.Pipe(duplex=True)
                process = ctx.Process(target=worker_main, name=f"kvsp-load-worker-{i}",
                                      args=(theirs, self.config, self.connect_timeout,
                                            self.setup_tokens), daemon=True)
                process.start()
                theirs.close()  # ours gone: EOF on `mine` when the worker dies
                proc = _Proc(i, process, mine, loop.create_future())
                self._procs.append(proc)
                loop.add_reader(mine.fileno(), self._readable, proc)
                proc.reading = True
            async with asyncio.timeout(self.start_timeout):
                await asyncio.gather(*(p.ready for p in self._procs))
        except BaseException as exc:
            await self.close()
            if isinstance(exc, (TimeoutError, ParallelLoadError, OSError)):
                raise ParallelLoadError(f"worker processes did not start: {exc!r}") from exc
            raise
        return self

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the workers (for inspection and tests)."""
        return tuple(p.process.pid or 0 for p in self._procs)

    @property
    def processes(self) -> tuple[BaseProcess, ...]:
        return tuple(p.process for p in self._procs)

    async def close(self) -> None:
        """Stop every worker (asked, then SIGKILL after ``stop_timeout``) and reap it."""
        self._closed = True
        procs, self._procs = self._procs, []
        for p in procs:
            if p.dead is None:
                try:
                    p.conn.send(("stop",))
                except OSError:
                    pass
        for p in procs:
            await asyncio.to_thread(p.process.join, self.stop_timeout)
            if p.process.is_alive():
                p.process.kill()
                await asyncio.to_thread(p.process.join)
            self._died(p, f"worker process {p.process.pid} stopped")
            p.conn.close()
            p.process.close()

    async def __aenter__(self) -> ProcessWorkers:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- LoadWorkers ----------------------------------------------------------------------------
    async def warm(self, urls: Sequence[str]) -> None:
        """Every worker connects to each URL now; ParallelLoadError naming the first failure."""
        loop = asyncio.get_running_loop()
        waits: list[asyncio.Future[str | None]] = []
        for p in self._live():
            for url in urls:
                req = next(self._ids)
                fut: asyncio.Future[str | None] = loop.create_future()
                p.warms[req] = fut
                self._send(p, ("warm", req, url))
                waits.append(fut)
        errors = [e for e in await asyncio.gather(*waits) if e is not None]
        if errors:
            raise ParallelLoadError(errors[0])

    async def load_ranges(self, sink: Sink, sources: Sequence[Source],
                          ranges: Sequence[tuple[int, int]], timeout: float,
                          loads: list[BlockLoad | None]) -> list[LoadResult]:
        self._check_sink(sink)
        procs = self._live()
        if len(ranges) > len(procs):
            raise ParallelLoadError(f"{len(ranges)} ranges for {len(procs)} workers")
        assert isinstance(sink, TorchSink)
        storage = self._shared_storage(sink)
        payload = sink.payload_bytes
        loop = asyncio.get_running_loop()
        jobs: list[_Job] = []
        for i, (a, b) in enumerate(ranges):
            digests: dict[int, bytes] = {}
            for layer in range(a, b + 1):
                digest = sink.expected_digest(layer)
                if digest is None:
                    raise ParallelLoadError(f"layer {layer} has no expected digest (a block "
                                            "still being computed: subscribe_block)")
                digests[layer] = digest
            ready = tuple(layer for layer in range(a, b + 1)
                          if sink.state(layer) is LayerState.READY)
            lo, hi = (a - sink.first_layer) * payload, (b - sink.first_layer + 1) * payload
            spec = JobSpec(rotated(sources, i), a, b, sink.geometry, sink.tokens, digests,
                           ready, storage[lo:hi], timeout)
            job = _Job(next(self._ids), sink, a, b, loop.create_future())
            jobs.append(job)
            procs[i].jobs[job.id] = job
            self._send(procs[i], ("load", job.id, spec))
        futures = [job.done for job in jobs]
        try:
            results = await asyncio.shield(asyncio.gather(*futures))
        except asyncio.CancelledError:
            await self._cancel(procs, jobs)
            raise
        for job, result in zip(jobs, results):
            if job.problems:  # a reported digest the parent did not expect (a worker bug)
                result.attempts.append(Attempt("", (job.first, job.last), (), job.problems[0]))
        return list(results)

    # -- internals ------------------------------------------------------------------------------
    def _live(self) -> list[_Proc]:
        if self._closed or not self._procs:
            raise ParallelLoadError("the worker processes are not started (start()) or closed")
        for p in self._procs:
            code = p.process.exitcode  # polls: a worker that died since the last load
            if p.dead is None and code is not None:
                self._died(p, f"worker process {p.process.pid} exited (exit code {code})")
        dead = [p.dead for p in self._procs if p.dead is not None]
        if dead:
            raise ParallelLoadError(f"{dead[0]}: start a new ProcessWorkers")
        return list(self._procs)

    @staticmethod
    def _check_sink(sink: Sink) -> None:
        if not isinstance(sink, TorchSink) or sink.staged:
            raise ParallelLoadError("workers='processes' needs a CPU TorchSink (make_sink("
                                    "..., backend='torch', shared_memory=True)), got "
                                    f"{type(sink).__name__}"
                                    + (" staging to a device" if isinstance(sink, TorchSink)
                                       else ""))

    @staticmethod
    def _shared_storage(sink: TorchSink) -> Any:
        if not sink.is_shared:
            try:
                sink.share_memory()  # one copy, in place; shared_memory=True avoids it
            except SinkError as exc:
                raise ParallelLoadError(str(exc)) from exc
        return sink.storage

    async def _cancel(self, procs: list[_Proc], jobs: list[_Job]) -> None:
        """Tell the workers to stop the jobs, and wait for each acknowledgement (after which
        no worker writes into the sink); a worker that does not answer is killed."""
        for p in procs:
            for job in jobs:
                if job.id in p.jobs:
                    self._send(p, ("cancel", job.id))
        pending = [job.done for job in jobs if not job.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.cancel_timeout)
        for p in procs:
            if any(not job.done.done() for job in p.jobs.values()):
                p.process.kill()
                await asyncio.to_thread(p.process.join)
                self._died(p, f"worker process {p.process.pid} did not stop its load: killed")

    def _send(self, p: _Proc, msg: tuple[Any, ...]) -> None:
        if p.dead is not None:
            self._died(p, p.dead)
            return
        try:
            p.conn.send(msg)
        except OSError as exc:
            self._died(p, f"worker process {p.process.pid} is gone ({exc!r})")

    def _readable(self, p: _Proc) -> None:
        try:
            while p.conn.poll():
                self._dispatch(p, p.conn.recv())
        except (EOFError, OSError):
            code = p.process.exitcode
            self._died(p, f"worker process {p.process.pid} exited"
                          + (f" (exit code {code})" if code is not None else ""))

    def _dispatch(self, p: _Proc, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "layer":
            job = p.jobs.get(msg[1])
            if job is not None:
                try:
                    job.sink.accept_verified(msg[2], msg[3])
                except SinkError as exc:
                    job.problems.append(str(exc))
        elif kind == "done":
            job = p.jobs.pop(msg[1], None)
            if job is not None and not job.done.done():
                job.done.set_result(msg[2])
        elif kind == "ready":
            if not p.ready.done():
                p.ready.set_result(msg[1])
        elif kind == "warmed":
            fut = p.warms.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])

    def _died(self, p: _Proc, reason: str) -> None:
        """The worker is gone: its jobs end with their range to recompute, waiters learn it."""
        if p.reading:
            asyncio.get_running_loop().remove_reader(p.conn.fileno())
            p.reading = False
        if p.dead is None:
            p.dead = reason
        for job in p.jobs.values():
            if not job.done.done():
                job.done.set_result(LoadResult((), (), [
                    Attempt("", (job.first, job.last), (), p.dead)]))
        p.jobs.clear()
        for fut in p.warms.values():
            if not fut.done():
                fut.set_result(p.dead)
        p.warms.clear()
        if not p.ready.done():
            p.ready.set_exception(ParallelLoadError(p.dead))
