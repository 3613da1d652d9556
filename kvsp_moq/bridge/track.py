"""One replica of a BlockStore as a MOQT track (binding v1, docs/binding.md §3–§6).

:class:`BlockTrack` is a :class:`~kvsp_moq.pubsub.TrackPublisher` whose objects live in the
store, not in the publisher: FETCH reads each layer's K || V straight from its tier
(``BlockStore.layer_payload``: a memoryview of the tier buffer, never a copy of the block)
when the fetch stream reaches it; SUBSCRIBE gets each layer of a block still being computed
the moment the store has it (``BlockWriter`` layer events, DESIGN.md §4 "prefill streaming").
Both send the tier's view as a *stable* payload: the native backend sends from it, no copy
(docs/transport.md "Sending from the store (no copy)").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from ..kvsp.naming import BlockName, track_name
from ..kvsp.registries import codec_by_value
from ..moqt.errors import PublishDoneCode
from ..pubsub import StoredObject, TrackPublisher
from ..storage import BlockStore, LayerWritten, RecordKey, ReplicaNotFound
from ..wire.buffer import Buffer
from .binding import BLOCK_GROUP, LAYER_DIGEST, track_properties

__all__ = ["BlockTrack"]

log = logging.getLogger(__name__)

Loc = tuple[int, int]


class BlockTrack(TrackPublisher):
    """The track ``(namespace of the replica, codec name)`` served from ``store``."""

    # A complete replica accepts SUBSCRIBE (SUBSCRIBE_OK with LARGEST_OBJECT, then
    # PUBLISH_DONE TRACK_ENDED): its layers are read with FETCH (binding §6).
    subscribe_after_finish = True

    def __init__(self, store: BlockStore, key: RecordKey, *,
                 remaining_ttl_ms: Callable[[], int | None] = lambda: None,
                 priority: int = 128) -> None:
        info = store.info(key)
        self.block_name: BlockName = key.block_name(info.replica_id)
        super().__init__(self.block_name.namespace_fields(),
                         track_name(codec_by_value(info.codec).name), keep=False,
                         priority=priority)
        self.block_store = store  # (TrackPublisher.store is the in-memory object store)
        self.key = key
        self.replica_id = info.replica_id
        self.first_layer = info.first_layer
        self.layer_count = info.last_layer - info.first_layer + 1
        self.token_count = info.token_count
        self._digests: list[bytes | None] = list(info.layer_digests)
        self._remaining_ttl_ms = remaining_ttl_ms
        self._queue: asyncio.Queue[int | None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._gone = False
        written = [i for i, d in enumerate(self._digests) if d is not None]
        if written:
            self.largest = (BLOCK_GROUP, self.first_layer + written[-1])
        if info.complete:
            self.finished = True  # nothing more will be published: FETCH only

    # -- Track Properties (binding §5) ----------------------------------------------------------
    @property
    def complete(self) -> bool:
        return all(d is not None for d in self._digests)

    def response_properties(self) -> tuple[tuple[int, int | bytes], ...]:
        digests = [d for d in self._digests if d is not None] if self.complete else None
        return track_properties(token_count=self.token_count, first_layer=self.first_layer,
                                layer_count=self.layer_count, layer_digests=digests,
                                max_cache_duration_ms=self._remaining_ttl_ms())

    # -- FETCH from the store (binding §6) --------------------------------------------------------
    def objects_in(self, start: Loc, end: tuple[int, int | None] | None
                   ) -> list[tuple[Loc, StoredObject]]:
        out: list[tuple[Loc, StoredObject]] = []
        for i, digest in enumerate(self._digests):
            layer = self.first_layer + i
            loc = (BLOCK_GROUP, layer)
            if digest is None or loc < tuple(start):
                continue
            if end is not None:
                eg, eo = end
                if BLOCK_GROUP > eg or (BLOCK_GROUP == eg and eo is not None and layer > eo):
                    break
            # The payload is read when the fetch stream reaches it: a view of the tier, whose
            # bytes never change (a layer is written once; a released extent is never reused
            # and views keep it alive): sent from without a copy (stable).
            out.append((loc, StoredObject(partial(self._payload, layer),
                                          ((LAYER_DIGEST, digest),), self.priority,
                                          stable=True)))
        return out

    def _payload(self, layer: int) -> Buffer:
        info = self.block_store.get(self.key)
        if info is None or info.replica_id != self.replica_id:
            raise ReplicaNotFound(self.key, self.replica_id)
        return self.block_store.layer_payload(self.key, layer)

    # -- live layers of a block being computed (binding §6, prefill streaming) -----------------
    def layer_written(self, event: LayerWritten) -> None:
        """``BlockWriter`` listener: layer ``event.layer`` is in the store. Runs inside
        ``write_layer``; the object is sent by this track's sender task right away."""
        if event.replica_id != self.replica_id:
            return
        self._digests[event.layer - self.first_layer] = event.digest
        # Largest Object moves now, while the layer is already readable from the store: a
        # SUBSCRIBE accepted from here on (NEXT_OBJECT) starts after it and FETCHes it,
        # one accepted before receives it live. No gap, no duplicate.
        loc = (BLOCK_GROUP, event.layer)
        if self.largest is None or loc > self.largest:
            self.largest = loc
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._sender = asyncio.ensure_future(self._send_layers(self._queue))
        self._queue.put_nowait(event.layer)
        if event.remaining == 0:
            self._queue.put_nowait(None)

    async def _send_layers(self, queue: asyncio.Queue[int | None]) -> None:
        while True:
            layer = await queue.get()
            if self._gone:
                return
            if layer is None:
                await self.finish()  # PUBLISH_DONE TRACK_ENDED; later SUBSCRIBEs FETCH
                return
            digest = self._digests[layer - self.first_layer]
            assert digest is not None
            try:
                payload = self._payload(layer)
            except LookupError:
                log.info("%s: replica gone while streaming layer %d", self.key, layer)
                return
            # A view of the tier, never rewritten (as for FETCH): sent without a copy (stable).
            await self.write_object(BLOCK_GROUP, layer, payload,
                                    properties=((LAYER_DIGEST, digest),), stable=True)
            del payload

    async def withdraw(self, reason: str) -> None:
        """The replica left the store: stop streaming and end every subscription
        (PUBLISH_DONE EXPIRED). The sender is not cancelled mid-object (that would cut an
        object and keep the track's lock): it stops before its next layer."""
        self._gone = True
        if not self.finished:
            await self.finish(PublishDoneCode.EXPIRED, reason)
