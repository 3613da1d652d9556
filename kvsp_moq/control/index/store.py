"""Storage of the Index Service: replica records with TTLs (kvsp-draft §6.1, §6.2).

:class:`IndexStore` is the interface a distributed store implements; :class:`MemoryIndexStore`
is the embedded one (the default, ``store = "memory"``) and ``redis_store.RedisIndexStore``
keeps the records in Redis (``store = "redis://..."``, DESIGN.md §8).

Records are filed under their :class:`BlockRef` (compat_id, scope_id, block_key) and, within
a block, under their :class:`ReplicaId`: the holder URL and, for a replica served over MOQT,
its ``moqt_namespace``, whose last field is the replica id (binding v1), so two replicas of one
block published through the same relay stay apart. Publishing a record with the id of an
existing one replaces it and restarts its TTL (the refresh of §6.1).

The store owns time: :meth:`IndexStore.put` takes a lifetime from now, and reads return the
remaining lifetime, which is what a store with native TTLs provides. A record whose lifetime
has run out is never returned.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ...kvsp.records import ReplicaRecord
from ..common.clock import Clock, MonotonicClock


@dataclass(frozen=True, slots=True)
class BlockRef:
    """The identity of a block in the index: the three path segments of §6.7."""

    compat_id: bytes
    scope_id: bytes
    block_key: bytes

    @classmethod
    def of(cls, record: ReplicaRecord) -> BlockRef:
        return cls(record.compat_id, record.scope_id, record.block_key)


@dataclass(frozen=True, slots=True)
class ReplicaId:
    """The identity of one replica of a block: its holder, and its MOQT namespace if any."""

    holder: str
    moqt_namespace: str | None = None

    @classmethod
    def of(cls, record: ReplicaRecord) -> ReplicaId:
        return cls(record.holder, record.moqt_namespace)

    def sort_key(self) -> tuple[str, str]:
        return (self.holder, self.moqt_namespace or "")


@dataclass(frozen=True, slots=True)
class StoredReplica:
    """A record as stored (``ttl_ms`` is the lifetime it was granted) and the milliseconds it
    has left (> 0)."""

    record: ReplicaRecord
    remaining_ms: int


class IndexStore(ABC):
    """What the Index Service needs from its storage. All methods are coroutines so that a
    networked store can implement them; each must be atomic with respect to the others."""

    @abstractmethod
    async def put(self, record: ReplicaRecord, ttl_ms: int) -> bool:
        """Store ``record`` (replacing the one with the same block and replica id) to expire
        ``ttl_ms`` (> 0) from now. True if no unexpired record had that id (a new replica),
        False for a refresh."""

    async def put_many(self, records: Sequence[tuple[ReplicaRecord, int]]) -> list[bool]:
        """:meth:`put` of each ``(record, ttl_ms)`` in order (a holder's batched refresh,
        §6.1); one result per record. A networked store overrides it to batch its writes."""
        return [await self.put(record, ttl_ms) for record, ttl_ms in records]

    @abstractmethod
    async def delete(self, block: BlockRef, replica: ReplicaId) -> bool:
        """Remove one replica; True if an unexpired one was there."""

    @abstractmethod
    async def get(self, block: BlockRef) -> list[StoredReplica]:
        """The unexpired replicas of a block, ordered by replica id (holder, then namespace)."""

    async def get_prefix(self, compat_id: bytes, scope_id: bytes, block_keys: Sequence[bytes]) -> list[list[StoredReplica]]:
        """The replicas of the leading keys of ``block_keys`` that have any, stopping at the
        first key without one (§6.2: "the IS MUST stop at the first key without a replica").

        The default reads key by key; a networked store overrides it to batch its reads and
        must keep the same result: a list whose every element is non-empty.
        """
        out: list[list[StoredReplica]] = []
        for key in block_keys:
            replicas = await self.get(BlockRef(compat_id, scope_id, key))
            if not replicas:
                break
            out.append(replicas)
        return out

    @abstractmethod
    async def purge(self) -> int:
        """Drop every expired record now; the number dropped. Reads never return expired
        records whether or not this runs; it reclaims their memory."""

    async def count(self) -> int:
        """The number of unexpired records (for monitoring). Optional."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release resources (connections). The default does nothing."""


@dataclass(slots=True)
class _Entry:
    record: ReplicaRecord
    expires_ms: int


class MemoryIndexStore(IndexStore):
    """The embedded store: a dict of block → {replica id → record, expiry}.

    Expired records are dropped lazily when their block is read, and in bulk by :meth:`purge`
    (and on every :meth:`put`, so memory stays bounded without a background task): a heap of
    expiry times finds them without scanning. A refresh leaves its old heap entry behind; it
    is discarded when it comes due, so the heap holds at most the records put within the
    longest TTL.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._blocks: dict[BlockRef, dict[ReplicaId, _Entry]] = {}
        self._expiries: list[tuple[int, int, BlockRef, ReplicaId]] = []
        self._seq = itertools.count()  # heap tie-breaker: refs are not ordered

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> bool:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be > 0")
        now = self._clock.now_ms()
        self._purge_due(now)
        block, replica = BlockRef.of(record), ReplicaId.of(record)
        replicas = self._blocks.setdefault(block, {})
        old = replicas.get(replica)
        created = old is None or old.expires_ms <= now
        expires = now + ttl_ms
        replicas[replica] = _Entry(record, expires)
        heapq.heappush(self._expiries, (expires, next(self._seq), block, replica))
        return created

    async def delete(self, block: BlockRef, replica: ReplicaId) -> bool:
        replicas = self._blocks.get(block)
        if replicas is None:
            return False
        entry = replicas.pop(replica, None)
        if not replicas:
            del self._blocks[block]
        return entry is not None and entry.expires_ms > self._clock.now_ms()

    async def get(self, block: BlockRef) -> list[StoredReplica]:
        replicas = self._blocks.get(block)
        if not replicas:
            return []
        now = self._clock.now_ms()
        expired = [rid for rid, e in replicas.items() if e.expires_ms <= now]
        for rid in expired:  # lazy purge of the block being read
            del replicas[rid]
        if not replicas:
            del self._blocks[block]
            return []
        return [
            StoredReplica(replicas[rid].record, replicas[rid].expires_ms - now)
            for rid in sorted(replicas, key=ReplicaId.sort_key)
        ]

    async def purge(self) -> int:
        return self._purge_due(self._clock.now_ms())

    async def count(self) -> int:
        now = self._clock.now_ms()
        return sum(1 for replicas in self._blocks.values() for e in replicas.values() if e.expires_ms > now)

    def _purge_due(self, now: int) -> int:
        dropped = 0
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, _, block, replica = heapq.heappop(heap)
            replicas = self._blocks.get(block)
            entry = replicas.get(replica) if replicas else None
            if entry is None or entry.expires_ms > now:
                continue  # withdrawn, or refreshed since this heap entry was pushed
            assert replicas is not None
            del replicas[replica]
            if not replicas:
                del self._blocks[block]
            dropped += 1
        return dropped
