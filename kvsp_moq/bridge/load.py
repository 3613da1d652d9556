"""One sequential block load of binding v1: a block's layers over MOQT into a layer sink
(docs/binding.md §8; DESIGN.md §1 "Inference Instance", §4; kvsp-draft §4.3, §6.1, §6.7).

:class:`BlockLoad` FETCHes a layer range (an object range of group 0) from the ``moqt://``
holder (an origin or a relay) of each :class:`Source` in turn. Every layer is verified by the
sink against the record's layer digests; a layer that fails (digest mismatch, DOES_NOT_EXIST
or another MoqtError, a dead or vanished source, a timeout: the whole request's, or the idle
timeout, ``idle_timeout`` seconds without an octet from a source that stalled or died without
closing) is retried from the next source, and only the layers still missing are asked for. When every source failed,
:attr:`LoadResult.recompute` lists what the engine recomputes (``sink.missing_layers()``): the
index is advisory (§6.1), a miss is not an error. :func:`fetch_into` is one FETCH of a layer
range into a sink; :func:`check_track` checks the Track Properties against the sink.

The entry points (:func:`~.instance.load_block`, :func:`~.instance.subscribe_block`, ...) are
in :mod:`.instance`; the parallel loads (:mod:`.parallel`) run one BlockLoad per layer range.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kvsp.layout import Geometry
from ..kvsp.naming import BlockName
from ..kvsp.records import ReplicaRecord
from ..moqt.messages import Message
from ..pubsub import MoqtError, MoqtSession
from ..sinks import LayerFailed, LayerSink, LayerState, make_sink
from ..transport import TransportConfig
from .binding import BLOCK_GROUP, BindingError, TrackInfo
from .pool import MoqtPool, refused_by_goaway
from .native_receive import native_fetch
from .receive import LayerReceiver

__all__ = [
    "Attempt",
    "BlockLoad",
    "LoadResult",
    "Sink",
    "Source",
    "check_track",
    "fetch_into",
    "fetch_layers",
    "layer_runs",
    "sink_for_record",
    "sources_of",
]

log = logging.getLogger(__name__)

Sink = LayerSink[Any]


@dataclass(frozen=True)
class Source:
    """Where one replica can be read: a ``moqt://`` URL (origin or relay) and its name."""

    url: str
    name: BlockName
    codec: str = "raw"
    #: Layer digests the record lists (layer l at index l), or None.
    layer_digests: tuple[bytes, ...] | None = None
    #: Layers the holder reports resident (None: all).
    resident: tuple[range, ...] | None = None

    @classmethod
    def from_record(cls, record: ReplicaRecord) -> Source:
        """``BindingError`` for a record not served over MOQT (kvsp-draft §4.4)."""
        name = record.block_name()
        if not record.is_moqt or name is None:
            raise BindingError(f"replica at {record.holder} is not served over MOQT")
        from ..kvsp.registries import codec_by_value
        return cls(record.holder, name, codec_by_value(record.codec).name,
                   record.layer_digests, record.resident_layers())

    def holds(self, layer: int) -> bool:
        return self.resident is None or any(layer in r for r in self.resident)


@dataclass(frozen=True)
class Attempt:
    """One request to one source."""

    url: str
    layers: tuple[int, int]
    verified: tuple[int, ...]
    error: str | None = None


@dataclass
class LoadResult:
    #: Layers of the requested range that are verified in the sink.
    verified: tuple[int, ...]
    #: Layers of the requested range no source delivered: recompute them.
    recompute: tuple[int, ...]
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.recompute


def sink_for_record(record: ReplicaRecord, geometry: Geometry, tokens: int,
                    layers: tuple[int, int] | None = None, **kw: Any) -> Sink:
    """A sink (``sinks.make_sink``) for ``layers`` of the record's block, expecting the
    record's layer digests (kvsp-draft §4.4: REQUIRED to serve layer ranges)."""
    if record.layer_digests is None:
        raise BindingError("the record lists no layer_digests: layer ranges cannot be verified")
    rng = layers or (0, len(record.layer_digests) - 1)
    return make_sink(geometry, tokens, rng, record.layer_digests, **kw)


def layer_runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous inclusive runs of an ascending list of layers."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


class BlockLoad:
    """Loads layers ``layers`` of one block into ``sink`` from ``sources`` (in order).

    ``await load.run()`` returns the :class:`LoadResult`. A consumer that computes while the
    load runs awaits :meth:`wait_for_layer`: unlike ``sink.wait_for_layer`` it does not give
    up on a layer that failed at one source while another source is still to be tried.
    """

    def __init__(self, sink: Sink, sources: Sequence[Source], *,
                 layers: tuple[int, int] | None = None, pool: MoqtPool | None = None,
                 config: TransportConfig | None = None, timeout: float = 30.0,
                 connect_timeout: float = 5.0, idle_timeout: float | None = None) -> None:
        self.sink = sink
        self.sources = list(sources)
        first, last = layers or (sink.first_layer, sink.last_layer)
        if first < sink.first_layer or last > sink.last_layer or first > last:
            raise ValueError(f"layers {first}..{last} are not inside the sink's range")
        self.first, self.last = first, last
        self._own_pool = pool is None
        self.pool = pool or MoqtPool(config, connect_timeout=connect_timeout)
        self.timeout = timeout
        #: Seconds a FETCH may go without an octet before this source is abandoned (None:
        #: only ``timeout`` bounds it): a stalled or silently dead source (docs/reliability.md).
        self.idle_timeout = idle_timeout
        self.attempts: list[Attempt] = []
        self._round = asyncio.Event()
        self._done = False

    def missing(self) -> list[int]:
        return [layer for layer in range(self.first, self.last + 1)
                if self.sink.state(layer) is not LayerState.READY]

    async def run(self) -> LoadResult:
        try:
            for source in self.sources:
                wanted = [layer for layer in self.missing() if source.holds(layer)]
                if not wanted:
                    continue
                reason = self._incompatible(source, wanted)
                if reason is not None:
                    self.attempts.append(Attempt(source.url, (wanted[0], wanted[-1]), (), reason))
                    continue
                self._next_round(wanted)
                await self._from_source(source, wanted)
            return self.result()
        finally:
            self._done = True
            self._round.set()
            if self._own_pool:
                await self.pool.close()

    def result(self) -> LoadResult:
        missing = tuple(self.missing())
        verified = tuple(layer for layer in range(self.first, self.last + 1)
                         if layer not in missing)
        return LoadResult(verified, missing, list(self.attempts))

    async def wait_for_layer(self, layer: int) -> Any:
        """``(K, V)`` of ``layer`` once verified; ``LayerFailed`` once no source is left."""
        while True:
            try:
                return await self.sink.wait_for_layer(layer)
            except LayerFailed:
                while self.sink.state(layer) is LayerState.FAILED and not self._done:
                    await self._round.wait()  # the next source retries it, or the load ends
                if self.sink.state(layer) is LayerState.FAILED:
                    raise

    # -- internals ------------------------------------------------------------------------------
    def _incompatible(self, source: Source, wanted: list[int]) -> str | None:
        """A record whose layer digests differ from the sink's cannot be verified by it."""
        if source.layer_digests is None:
            return None  # the Track Properties are checked when FETCH_OK arrives
        for layer in wanted:
            if layer >= len(source.layer_digests):
                return f"the record lists no digest for layer {layer}"
            if source.layer_digests[layer] != self.sink.expected_digest(layer):
                return f"the record's digest of layer {layer} differs from the sink's"
        return None

    def _next_round(self, wanted: list[int]) -> None:
        """A new source is tried: failed layers are expected again (so waiters wait)."""
        for layer in wanted:
            if self.sink.state(layer) is LayerState.FAILED:
                self.sink.retry(layer)
        old, self._round = self._round, asyncio.Event()
        old.set()

    async def _from_source(self, source: Source, wanted: list[int]) -> None:
        try:
            session = await self.pool.get(source.url)
        except (OSError, TimeoutError, MoqtError, ConnectionError) as exc:
            self._fail(wanted, f"{source.url}: cannot connect ({exc!r})")
            self.attempts.append(Attempt(source.url, (wanted[0], wanted[-1]), (),
                                         f"connect: {exc!r}"))
            return
        retried = False
        for a, b in layer_runs(wanted):
            verified, error, refused = await fetch_layers(
                session, source.name, source.codec, self.sink, a, b, timeout=self.timeout,
                idle_timeout=self.idle_timeout)
            if refused and not retried:
                # Refused because of a GOAWAY: once more on the pool's new session (the New
                # Session URI if the GOAWAY named one; bridge/pool.py).
                retried = True
                self.attempts.append(Attempt(source.url, (a, b), verified, error))
                try:
                    session = await self.pool.get(source.url)
                except (OSError, TimeoutError, MoqtError, ConnectionError) as exc:
                    error = f"reconnect after GOAWAY: {exc!r}"
                else:
                    verified, error, _ = await fetch_layers(
                        session, source.name, source.codec, self.sink, a, b,
                        timeout=self.timeout, idle_timeout=self.idle_timeout)
            self.attempts.append(Attempt(source.url, (a, b), verified, error))
            if error is not None:
                # The rest of this source's layers stay missing: the next source gets them.
                self._fail([layer for layer in wanted if layer >= a], f"{source.url}: {error}")
                return

    def _fail(self, layers: list[int], reason: str) -> None:
        for layer in layers:
            if self.sink.state(layer) is LayerState.EXPECTED and not self.sink.delivering(layer):
                self.sink.abort(layer, reason)


async def fetch_into(session: MoqtSession, name: BlockName, codec: str, sink: Sink, first: int,
                     last: int, *, timeout: float = 30.0,
                     accept_announced_digests: bool = False,
                     on_response: Callable[[Message], None] | None = None,
                     check: Callable[[object], str | None] | None = None,
                     ) -> tuple[tuple[int, ...], str | None]:
    """FETCH layers ``first..last`` (objects ``{0, first}..{0, last}``) into ``sink``.
    Returns the layers verified and the first error (None when the source delivered all).
    ``on_response(FETCH_OK)`` runs before any object is received; ``check(response)`` replaces
    :func:`check_track` (a :class:`~.landing.StoreLanding` judges the Track Properties itself).
    :func:`fetch_layers` also says whether the FETCH was refused because of a GOAWAY."""
    verified, error, _ = await fetch_layers(session, name, codec, sink, first, last,
                                            timeout=timeout,
                                            accept_announced_digests=accept_announced_digests,
                                            on_response=on_response, check=check)
    return verified, error


async def fetch_layers(session: MoqtSession, name: BlockName, codec: str, sink: Sink,
                        first: int, last: int, *, timeout: float = 30.0,
                        accept_announced_digests: bool = False, idle_timeout: float | None = None,
                        on_response: Callable[[Message], None] | None = None,
                        check: Callable[[object], str | None] | None = None,
                        ) -> tuple[tuple[int, ...], str | None, bool]:
    """:func:`fetch_into`, and whether the FETCH was refused because of a GOAWAY.
    ``on_response`` sees FETCH_OK before any object (``MoqtSession.fetch``); ``check`` judges
    it once the request is answered (default: :func:`check_track` against the sink).
    ``idle_timeout``: seconds without an octet of the answer (FETCH_OK or object payload)
    after which the FETCH is abandoned, like one that took longer than ``timeout``."""
    refused = False
    recv = LayerReceiver(sink, first, last, accept_announced_digests=accept_announced_digests)
    idle = _IdleTimer(idle_timeout)
    verified: list[int] = []
    error: str | None = None
    stream = None
    # The native backend lands the layers itself (native_receive.py); others: the Python path.
    native = None if accept_announced_digests else native_fetch(session, sink, first, last)
    try:
        async with asyncio.timeout(timeout), idle:
            if native is not None:
                native.on_progress = idle.touch
            stream = await session.fetch(
                name.namespace_fields(), codec, start=(BLOCK_GROUP, first),
                end=(BLOCK_GROUP, last), on_object_begin=idle.wrap(recv.on_object_begin),
                on_object_progress=idle.wrap(recv.on_object_progress), on_response=on_response,
                on_request=None if native is None else native.register)
            idle.touch()
            error = (check(stream.response) if check is not None else
                     check_track(stream.response, sink, first, last, accept_announced_digests))
            if error is None and native is not None and native.active:
                error = await native.run(stream)
            elif error is None:
                async for obj in stream:
                    with idle.paused():  # verifying is our work, not the source's silence
                        ok = await recv.object_done(obj.object_id)
                    if ok:
                        verified.append(obj.object_id)
                    elif ok is False:
                        error = f"layer {obj.object_id}: {sink.failure_reason(obj.object_id)}"
                        break
                    if recv.problems:
                        error = recv.problems[0]
                        break
    except MoqtError as exc:
        error = f"{type(exc).__name__} {exc.code:#x}: {exc}"
        refused = stream is None and refused_by_goaway(exc)
    except TimeoutError:
        error = (f"no octet for {idle_timeout} s (idle timeout)" if idle.expired()
                 else f"no complete answer within {timeout} s")
    finally:
        if native is not None:
            verified.extend(native.verified)
            native.close(error or "fetch ended mid-object")
        if stream is not None and not stream.done:
            await stream.cancel()
        recv.abort_pending(error or "fetch ended mid-object")
    if error is None:
        missing = [layer for layer in range(first, last + 1)
                   if sink.state(layer) is not LayerState.READY]
        if missing:
            error = f"the source ended without layers {missing[0]}..{missing[-1]}"
    return tuple(verified), error, refused


class _IdleTimer:
    """An ``asyncio.timeout`` pushed back each time the source delivers something: expires
    once ``seconds`` pass without an octet (never, with ``seconds`` None)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._cm: asyncio.Timeout | None = None

    async def __aenter__(self) -> _IdleTimer:
        if self.seconds is not None:
            self._cm = asyncio.timeout(self.seconds)
            await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._cm is not None:
            await self._cm.__aexit__(*exc)  # turns its own expiry into TimeoutError

    def touch(self) -> None:
        if self._cm is not None and self.seconds is not None:
            self._cm.reschedule(asyncio.get_running_loop().time() + self.seconds)

    def expired(self) -> bool:
        return self._cm is not None and self._cm.expired()

    def wrap(self, callback: Any) -> Any:
        """``callback`` that first pushes the deadline back (a pubsub receive callback)."""
        if self._cm is None:
            return callback

        def touched(*args: Any) -> Any:
            self.touch()
            return callback(*args)
        return touched

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        if self._cm is not None:
            self._cm.reschedule(None)
        try:
            yield
        finally:
            self.touch()


def check_track(response: object, sink: Sink, first: int, last: int,
                 accept_announced: bool) -> str | None:
    """Track Properties of FETCH_OK / SUBSCRIBE_OK against the sink: another replica's
    digests or token count mean this source cannot deliver what the sink verifies."""
    props = getattr(response, "track_properties", ())
    try:
        info = TrackInfo.parse(props)
    except BindingError:
        return None  # not a binding-v1 publisher's properties (e.g. stripped): the digests decide
    if info.token_count != sink.tokens:
        return f"the track has {info.token_count} tokens, the sink expects {sink.tokens}"
    if info.layer_digests is None:
        return None
    for layer in range(first, last + 1):
        announced = info.layer_digests.get(layer)
        expected = sink.expected_digest(layer)
        if announced is None:
            return f"the track does not hold layer {layer}"
        if expected is None and accept_announced:
            sink.set_expected_digest(layer, announced)
        elif expected is not None and announced != expected:
            return f"the track's digest of layer {layer} differs from the expected one"
    return None


def sources_of(records: ReplicaRecord | Source | Sequence[ReplicaRecord | Source],
               sink: Sink) -> tuple[list[Source], list[Attempt]]:
    """The MOQT sources of ``records`` in order, and an Attempt for each record skipped (not
    served over MOQT)."""
    items = [records] if isinstance(records, ReplicaRecord | Source) else list(records)
    sources: list[Source] = []
    skipped: list[Attempt] = []
    for item in items:
        if isinstance(item, Source):
            sources.append(item)
            continue
        try:
            sources.append(Source.from_record(item))
        except BindingError as exc:
            skipped.append(Attempt(item.holder, (sink.first_layer, sink.last_layer), (), str(exc)))
    return sources, skipped
