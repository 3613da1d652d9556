"""Layer ranges of a parallel block load and what loads them (issue 9; docs/binding.md §5:
"a layer range is an object range", §12).

:func:`split_layers` cuts a block's missing layers into contiguous ranges, :func:`rotated`
gives range i its sources (replicas striped across holders and relays), :class:`LoadWorkers`
is what runs the ranges (:class:`~.parallel.ConnectionWorkers` on the caller's event loop,
:class:`~._workers.ProcessWorkers` in worker processes) and :func:`merge_results` makes one
:class:`~.load.LoadResult` of theirs. The loads themselves are in :mod:`.parallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from ..sinks import LayerState
from .load import Attempt, BlockLoad, LoadResult, Sink, Source

__all__ = [
    "LoadWorkers",
    "ParallelLoadError",
    "WorkerKind",
    "merge_results",
    "rotated",
    "split_layers",
]

WorkerKind = Literal["connections", "processes"]


class ParallelLoadError(RuntimeError):
    """A parallel load could not be set up (no worker, a sink workers cannot write into, a
    layer busy with another load, a worker process that does not start)."""


def split_layers(layers: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split the ascending ``layers`` into at most ``parts`` contiguous inclusive ranges
    ``(first, last)`` of as equal a count as possible (the first ranges get one more), in
    ascending order. A range may span layers that are not in ``layers`` (already verified):
    its load skips them."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    layers = list(layers)
    if not layers:
        return []
    parts = min(parts, len(layers))
    size, extra = divmod(len(layers), parts)
    out: list[tuple[int, int]] = []
    i = 0
    for k in range(parts):
        n = size + (1 if k < extra else 0)
        out.append((layers[i], layers[i + n - 1]))
        i += n
    return out


def merge_results(results: Sequence[LoadResult], first: int, last: int,
                  sink: Sink) -> LoadResult:
    """One :class:`LoadResult` for ``first..last`` from the ranges' results (attempts in
    range order; verified / recompute read from the sink, the final word)."""
    attempts: list[Attempt] = [a for r in results for a in r.attempts]
    missing = tuple(layer for layer in range(first, last + 1)
                    if sink.state(layer) is not LayerState.READY)
    verified = tuple(layer for layer in range(first, last + 1) if layer not in missing)
    return LoadResult(verified, missing, attempts)


class LoadWorkers(Protocol):
    """What :class:`ParallelLoad` runs the ranges on (:class:`ConnectionWorkers`,
    :class:`~._workers.ProcessWorkers`)."""

    kind: WorkerKind
    parallel: int

    async def start(self) -> LoadWorkers:
        """Make the workers ready (processes: spawn them and wait for them)."""

    async def warm(self, urls: Sequence[str]) -> None:
        """Connect every worker to each URL now (before a timed load)."""

    async def load_ranges(self, sink: Sink, sources: Sequence[Source],
                          ranges: Sequence[tuple[int, int]], timeout: float,
                          loads: list[BlockLoad | None]) -> list[LoadResult]:
        """Load range i with worker i; fill ``loads[i]`` with its in-process BlockLoad (or
        leave None). Returns one result per range."""

    async def close(self) -> None: ...


def rotated(sources: Sequence[Source], i: int) -> list[Source]:
    """Range ``i`` tries source ``i mod len`` first, then the others in order."""
    if not sources:
        return []
    k = i % len(sources)
    return [*sources[k:], *sources[:k]]
