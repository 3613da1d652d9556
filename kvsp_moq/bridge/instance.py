"""The instance side of binding v1: load a block's layers over MOQT into a layer sink
(docs/binding.md §8; DESIGN.md §1 "Inference Instance", §4; kvsp-draft §4.3, §6.1, §6.7).

* :func:`load_block`: FETCH a layer range (an object range of group 0) from the ``moqt://``
  holder (an origin or a relay) of each Replica Record in turn (:class:`~.load.BlockLoad`),
  or in N layer ranges at once (:mod:`.parallel`). Every layer is verified by the sink
  against the record's layer digests; what no source delivered is left to recompute.
* :func:`load_by_namespace`: a block found by namespace alone (SUBSCRIBE_NAMESPACE): its
  Track Properties (TRACK_STATUS) give the token count and the layer digests to verify with.
* :func:`subscribe_block`: prefill streaming. SUBSCRIBE (NEXT_OBJECT) to a block still being
  computed, FETCH the layers that already exist, receive the others as they are produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ..kvsp.layout import Geometry
from ..kvsp.naming import BlockName
from ..kvsp.records import ReplicaRecord
from ..moqt.messages import LocationFilter, LocationFilterType, MessageParameters, SubscribeOk
from ..pubsub import MoqtError, MoqtSession
from ..sinks import LayerState, make_sink
from ..transport import TransportConfig
from .binding import BindingError, TrackInfo
from .load import (
    Attempt,
    BlockLoad,
    LoadResult,
    Sink,
    Source,
    check_track,
    fetch_into,
    layer_runs,
    sources_of,
)
from .native_receive import NativeSubscribe, native_subscribe
from .parallel import load_block_parallel
from .pool import MoqtPool
from .receive import LayerReceiver

__all__ = [
    "block_info",
    "load_block",
    "load_by_namespace",
    "subscribe_block",
]


async def load_block(records: ReplicaRecord | Source | Sequence[ReplicaRecord | Source],
                     sink: Sink, *, layers: tuple[int, int] | None = None,
                     pool: MoqtPool | None = None, config: TransportConfig | None = None,
                     timeout: float = 30.0, connect_timeout: float = 5.0,
                     parallel: int = 1, workers: Any = None,
                     idle_timeout: float | None = None) -> LoadResult:
    """Load ``layers`` (default: the sink's range) from the replicas in ``records`` (tried
    in order; records not served over MOQT are skipped) into ``sink``. See :class:`~.load.BlockLoad`
    (``idle_timeout``: a source silent that long is abandoned; sequential loads only).

    ``parallel`` > 1 or ``workers`` (``"connections"``, ``"processes"`` or a started set of
    workers): the layers are split into ``parallel`` contiguous ranges loaded at once, each
    over its own connection (:func:`.parallel.load_block_parallel`; ``pool`` is not used)."""
    if parallel > 1 or workers is not None:
        return await load_block_parallel(
            records, sink, parallel=parallel if parallel > 1 or isinstance(workers, str)
            else None, workers=workers or "connections", layers=layers, config=config,
            timeout=timeout, connect_timeout=connect_timeout)
    sources, skipped = sources_of(records, sink)
    load = BlockLoad(sink, sources, layers=layers, pool=pool, config=config, timeout=timeout,
                     connect_timeout=connect_timeout, idle_timeout=idle_timeout)
    result = await load.run()
    result.attempts[:0] = skipped
    return result


async def block_info(session: MoqtSession, name: BlockName, codec: str = "raw") -> TrackInfo:
    """The Track Properties of a block track (TRACK_STATUS), e.g. for a block found by
    namespace alone (SUBSCRIBE_NAMESPACE on the scope prefix)."""
    msg = await session.track_status(name.namespace_fields(), codec)
    return TrackInfo.parse(getattr(msg, "track_properties", ()))


async def load_by_namespace(url: str, name: BlockName, geometry: Geometry, *,
                            layers: tuple[int, int] | None = None, codec: str = "raw",
                            pool: MoqtPool | None = None,
                            config: TransportConfig | None = None, timeout: float = 30.0,
                            **sink_options: Any) -> tuple[Sink, LoadResult]:
    """Load a block known only by its MOQT name: verify each layer against the layer
    digests of the Track Properties (binding §5). Returns the sink and the result."""
    own = pool is None
    pool = pool or MoqtPool(config)
    try:
        info = await block_info(await pool.get(url), name, codec)
        if info.layer_digests is None:
            raise BindingError("the replica is not complete (no LAYER_DIGESTS): subscribe_block")
        rng = layers or (info.first_layer, info.first_layer + info.layer_count - 1)
        sink = make_sink(geometry, info.token_count, rng, info.layer_digests, **sink_options)
        result = await load_block(Source(url, name, codec), sink, pool=pool, timeout=timeout)
        return sink, result
    finally:
        if own:
            await pool.close()


async def subscribe_block(url: str, name: BlockName, sink: Sink, *, codec: str = "raw",
                          pool: MoqtPool | None = None, config: TransportConfig | None = None,
                          timeout: float = 60.0, rendezvous_ms: int | None = None) -> LoadResult:
    """Prefill streaming (binding §6): receive a block still being computed layer by layer.

    ``rendezvous_ms``: the SUBSCRIBE carries RENDEZVOUS_TIMEOUT, so a relay that has no
    publisher of the namespace yet holds it (at most that long) until the producer's
    PUBLISH_NAMESPACE arrives (prefill→decode: the consumer may ask before the producer began).

    SUBSCRIBE with NEXT_OBJECT; the layers up to the Largest Object of SUBSCRIBE_OK are
    FETCHed, later ones arrive live, each verified when it lands (against the sink's digests,
    or, for layers the sink was built without (``None``), the producer's per-object
    LAYER_DIGEST). When the subscription ends, layers still missing are FETCHed once more.
    """
    own = pool is None
    pool = pool or MoqtPool(config)
    first, last = sink.first_layer, sink.last_layer
    recv = LayerReceiver(sink, first, last, accept_announced_digests=True)
    attempts: list[Attempt] = []
    error: str | None = None
    native: NativeSubscribe | None = None
    try:
        session = await pool.get(url)
        # The native backend lands the live layers itself (native_receive.py).
        native = native_subscribe(session, sink, first, last)
        if native is not None:
            native.announce()
        async with asyncio.timeout(timeout):
            sub = await session.subscribe(
                name.namespace_fields(), codec,
                parameters=MessageParameters(
                    location_filter=LocationFilter(LocationFilterType.NEXT_OBJECT),
                    rendezvous_timeout=rendezvous_ms),
                on_object_begin=(recv.on_object_begin if native is None
                                 else native.guard(recv.on_object_begin)),
                on_object_progress=recv.on_object_progress,
                on_response=None if native is None else native.on_answer)
            if native is not None:
                native.attach(sub)
            error = check_track(sub.response, sink, first, last, True)
            past: asyncio.Task[tuple[tuple[int, ...], str | None]] | None = None
            largest = (sub.response.parameters.largest_object
                       if isinstance(sub.response, SubscribeOk) else None)
            if error is None and largest is not None and largest.object >= first:
                # Layers produced before our SUBSCRIBE: FETCH them alongside the live ones.
                past = asyncio.ensure_future(fetch_into(
                    session, name, codec, sink, first, min(largest.object, last),
                    timeout=timeout, accept_announced_digests=True))
            verified: list[int] = []
            if error is None:
                async for obj in sub:
                    ok = await recv.object_done(obj.object_id)
                    if ok:
                        verified.append(obj.object_id)
                    elif ok is False:
                        error = f"layer {obj.object_id}: {sink.failure_reason(obj.object_id)}"
                        break
            if not sub.done:
                await sub.cancel()
            # A refused object (the Python path's or the extension's) fails this attempt.
            error = error or (recv.problems[0] if recv.problems else None)
            if native is not None:
                verified.extend(native.verified)
                error = error or (native.problems[0] if native.problems else None)
                native.close(error or "subscription ended mid-object")
            recv.abort_pending(error or "subscription ended mid-object")
            attempts.append(Attempt(url, (first, last), tuple(verified), error))
            if past is not None and largest is not None:
                done, past_error = await past
                attempts.append(Attempt(url, (first, min(largest.object, last)), done, past_error))
            missing = [layer for layer in range(first, last + 1)
                       if sink.state(layer) is not LayerState.READY]
            if missing and error is None:
                # A layer written while our SUBSCRIBE was being accepted, or a failed
                # delivery: the block is stored now, FETCH what is missing.
                for layer in missing:
                    if sink.state(layer) is LayerState.FAILED:
                        sink.retry(layer)
                for a, b in layer_runs(missing):
                    done, err = await fetch_into(session, name, codec, sink, a, b,
                                                 timeout=timeout, accept_announced_digests=True)
                    attempts.append(Attempt(url, (a, b), done, err))
    except (MoqtError, TimeoutError, OSError) as exc:
        if native is not None:
            native.close(repr(exc))
        recv.abort_pending(repr(exc))
        attempts.append(Attempt(url, (first, last), (), repr(exc)))
    finally:
        if native is not None:
            native.settle()
        if own:
            await pool.close()
    missing_t = tuple(layer for layer in range(first, last + 1)
                      if sink.state(layer) is not LayerState.READY)
    verified_t = tuple(layer for layer in range(first, last + 1) if layer not in missing_t)
    return LoadResult(verified_t, missing_t, attempts)
