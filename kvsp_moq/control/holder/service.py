"""The holder service (kvsp-draft §6.6, §6.7): block retrieval and storage, leases, eviction.

A plain class over a :class:`~kvsp_moq.storage.BlockStore`; :mod:`.routes` maps
``blocks/{compat}/{scope}/{key}`` and ``leases`` onto it (docs/http-api.md "Holder").
Collaborators, one job each: :class:`~.holder.leases.LeaseManager` (§6.6),
:class:`~.client.publisher.ReplicaPublisher` (§6.1 publication, refresh and withdrawal) and,
with ``[holder] moqt_relays``, :class:`~.holder.moqt.HolderMoqt` (the replicas as MOQT tracks
through relays, and their ``moqt://`` records).

Authorization (§6.7 "MUST reject the request if the client is not authorized for the scope";
likewise for reading and leasing): every operation first checks the principal's ``scopes``,
before it looks at the store, so a 404 never tells an unauthorized client what is held.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from ...kvsp.container import decode_container
from ...kvsp.errors import ContainerError, RecordError
from ...kvsp.records import LeaseGrant, LeaseRequest, ReplicaRecord
from ...kvsp.registries import CODEC_RAW
from ...storage import (
    BlockReader,
    BlockStore,
    LayersUnavailable,
    RecordKey,
    ReplicaExists,
    ReplicaNotFound,
    ReplicaPinned,
)
from ..client.publisher import ReplicaPublisher
from ..common.auth import Principal, require_scope
from ..common.clock import Clock
from ..common.errors import LayersNotHeld, NotFound, PreconditionFailed
from .leases import LeaseManager
from .metrics import HolderMetrics, lease_result
from .moqt import HolderMoqt
from .transcode import Transcoded, Transcoder

__all__ = ["BlockRead", "HolderService"]

#: Codecs this holder serves without a transcoder (§6.7 "a holder MAY transcode"; with one,
#: every registered codec for the compats of ``[holder] descriptors``: ``holder/transcode.py``).
SERVED_CODECS = frozenset({CODEC_RAW.value})
#: Octets hashed between two yields to the event loop while computing a range's digest.
_HASH_SLICE = 8 << 20


@dataclass(frozen=True)
class BlockRead:
    """What a GET returns: the container stream and the replica's remaining TTL."""

    reader: BlockReader
    full: bool  # all layers of the replica (its digest is cached by the store)
    remaining_ms: int  # the replica's remaining TTL: max-age is at most this (§6.7)
    #: The codec asked for when it is not the replica's (``codec=n``, §6.7): the answer is the
    #: transcoded container (:meth:`HolderService.transcoded`), not the reader's octets.
    transcode_to: int | None = None
    source_codec: int = CODEC_RAW.value

    @property
    def max_age_s(self) -> int:
        return self.remaining_ms // 1000  # floor: never longer than the TTL


class HolderService:
    """Serves, stores and leases blocks of one store; publishes them to the IS."""

    def __init__(
        self,
        store: BlockStore,
        *,
        clock: Clock,
        leases: LeaseManager,
        publisher: ReplicaPublisher,
        chunk_octets: int = 256 * 1024,
        moqt: HolderMoqt | None = None,
        transcoder: Transcoder | None = None,
    ) -> None:
        self.store = store
        #: ``codec=n`` other than the replica's (§6.7 "MAY transcode"); None: 404 for those.
        self.transcoder = transcoder
        #: Publication over MOQT through ``[holder] moqt_relays`` (``holder/moqt.py``), if any.
        self.moqt = moqt
        self.clock = clock
        self.leases = leases
        self.publisher = publisher
        self.chunk_octets = chunk_octets
        #: ``GET {h}metrics`` (``holder/metrics.py``, docs/metrics.md).
        self.metrics = HolderMetrics(store)
        self.metrics.count_leases_with(self._live_leases)
        if transcoder is not None:
            transcoder.on_transcode = self._transcoded_once

    def _transcoded_once(self, codec: int, octets: int) -> None:
        self.metrics.transcodes.labels(str(codec)).inc()
        self.metrics.transcoded_octets.labels(str(codec)).inc(octets)

    async def _live_leases(self) -> tuple[int, int]:
        live = await self.leases.leases.live(self.leases.clock.now_ms())
        return len(live), sum(lease.octets for lease in live)

    async def grant_lease(self, principal: Principal, request: LeaseRequest, *,
                          idempotency_key: str | None = None) -> LeaseGrant:
        """§6.6 ``POST leases`` (:meth:`LeaseManager.grant`), counted by result."""
        try:
            grant = await self.leases.grant(principal, request, idempotency_key=idempotency_key)
        except Exception as exc:
            self.metrics.lease_requests.labels(lease_result(exc)).inc()
            raise
        self.metrics.lease_requests.labels("granted").inc()
        return grant

    # -- §6.7 GET -------------------------------------------------------------------------------

    def open_block(
        self,
        principal: Principal,
        key: RecordKey,
        layers: tuple[int, int] | None = None,
        codec: int | None = None,
    ) -> BlockRead:
        """Open the container of the replica of ``key`` (all layers, or the inclusive range
        ``layers``). ``Forbidden`` without the scope; ``NotFound`` (``kvsp-not-found``) when no
        replica is held; ``LayersNotHeld`` (``kvsp-layers-unavailable``) when a layer of the
        range is not held or ``codec`` is not the replica's and the holder has no transcoder
        (with one, :meth:`transcoded` makes the representation)."""
        require_scope(principal, key.scope_id)
        info = self.store.get(key)
        if info is None:
            raise NotFound(f"the holder has no replica of block {key.block_key.hex()}")
        transcode_to = codec if codec is not None and codec != info.codec else None
        if transcode_to is not None and self.transcoder is None:
            raise LayersNotHeld(f"codec {codec} is not available: the replica is in codec {info.codec} and this holder does not transcode")
        first, last = layers if layers is not None else (info.first_layer, info.last_layer)
        try:
            reader = self.store.open_reader(key, first, last, chunk_size=self.chunk_octets)
        except ReplicaNotFound:
            raise NotFound(f"the holder has no replica of block {key.block_key.hex()}") from None
        except LayersUnavailable as exc:
            held = ", ".join(f"{a}-{b}" for a, b in exc.available) or "none"
            raise LayersNotHeld(f"layers {first}-{last} are not all held (held: {held})") from None
        full = (first, last) == (info.first_layer, info.last_layer) and info.complete
        return BlockRead(reader, full, self.publisher.remaining_ms(key, reader.replica_id), transcode_to, info.codec)

    async def transcoded(self, read: BlockRead) -> Transcoded:
        """The container of ``read`` in ``read.transcode_to`` (§6.7 "a holder MAY transcode"),
        made once per replica, range and codec; ``LayersNotHeld`` when it cannot be made."""
        assert read.transcode_to is not None
        if self.transcoder is None:
            raise LayersNotHeld(f"codec {read.transcode_to} is not available: this holder does not transcode")
        return await self.transcoder.transcode(read.reader, read.source_codec, read.transcode_to)

    async def container_sha256(self, read: BlockRead) -> bytes:
        """SHA-256 of the container a GET returns (``Repr-Digest``, §6.7 MUST).

        Cost: for all layers it is cached by the store (computed when the block was PUT, or
        by the first GET). For a layer range it is one streaming pass over the range before
        the headers are sent (the octets are then read twice: hashed, then sent); the pass
        yields to the event loop every 8 MiB so other requests keep going.
        """
        reader = read.reader
        known = reader.known_sha256
        if known is not None:
            return known
        if read.full:
            return reader.sha256()  # one pass, cached by the store for every later GET
        h = hashlib.sha256()
        since_yield = 0
        for chunk in reader:
            h.update(chunk)
            since_yield += chunk.nbytes
            if since_yield >= _HASH_SLICE:
                since_yield = 0
                await asyncio.sleep(0)
        return h.digest()

    # -- §6.7 PUT -------------------------------------------------------------------------------

    def check_store(self, principal: Principal, key: RecordKey) -> None:
        """Before reading a PUT body: ``Forbidden`` without the scope (§6.7 MUST), and
        ``PreconditionFailed`` when a replica is already held (§6.7: 412, keep the copy);
        ``StoreUnavailable`` (503) while a restarted holder has not yet reloaded its leases:
        storing may evict, and it cannot yet tell a leased replica from another (§6.6)."""
        require_scope(principal, key.scope_id)
        self.leases.check_loaded()
        existing = self.store.get(key)
        if existing is not None:
            raise PreconditionFailed(f"the holder already has replica {existing.replica_id.hex()} of block {key.block_key.hex()}; it keeps it")

    async def store_block(self, principal: Principal, key: RecordKey, body: memoryview) -> ReplicaRecord:
        """Validate and store a container (§6.7 PUT with ``If-None-Match: *``), then publish it
        (§6.1). ``RecordError`` (member ``container.<field>``) for a bad container;
        ``PreconditionFailed`` when a replica appeared meanwhile; ``StoreFull`` when only
        leased or in-flight replicas could make room. The body is copied once, section by
        section, into its tier. Replicas evicted to make room are withdrawn at the IS before
        the new one is published (and before the caller answers)."""
        self.check_store(principal, key)
        try:
            container = decode_container(body)
            info = self.store.put(key, container)
        except ContainerError as exc:
            raise RecordError(f"container.{exc.field}", str(exc)) from None
        except ReplicaExists as exc:
            raise PreconditionFailed(f"the holder already has replica {exc.replica_id.hex()}; it keeps it") from None
        self.store.container_sha256(key)  # cache Repr-Digest of the full container now
        self.metrics.stored(len(body))
        await self.publisher.flush()  # withdrawals of the replicas evicted for room (§6.1)
        if self.moqt is not None:
            await self.moqt.flush()
        published = await self.publisher.publish(key)
        if self.moqt is not None:  # its track through the relays, then their moqt:// records
            await self.moqt.publish(key)
        return published if published is not None else self.publisher.record(info)

    # -- eviction on purpose (§6.1, §6.6) ---------------------------------------------------------

    async def evict(self, key: RecordKey, *, force: bool = False) -> bool:
        """Remove the replica of ``key``, withdrawing its record first (§6.1 "before ... evicting").

        Without ``force`` a leased replica is refused (``ReplicaPinned``: §6.6 "MUST NOT evict").
        With ``force`` (a fault: a failing disk, a device reset) the leased replica goes too, but
        only after its record is withdrawn (§6.6 "MUST first withdraw the affected replica
        records"): the withdrawal is awaited, retried until the IS acknowledges it or the record
        has expired there. Whether a replica was removed.
        """
        info = self.store.get(key)
        if info is None:
            return False
        if not force and self.store.is_pinned(key):
            raise ReplicaPinned(key, self.store.pin_owners(key))
        await self.publisher.withdraw(key, info.replica_id)
        if self.moqt is not None:
            await self.moqt.withdraw(key, info.replica_id)
        try:
            self.store.remove(key, replica_id=info.replica_id, force=force)
        except ReplicaNotFound:
            return False  # gone meanwhile (its own eviction withdrew it)
        return True  # a lease naming it stays valid and keeps its quota; it pins nothing here

