"""Eviction: LRU within a tier, demotion before dropping, and never a pinned replica.

Rules (kvsp-draft §6.1, §6.6; the policy itself is ours):

1. Room is made in one tier at a time. Victims are taken in least-recently-used order (the
   store's logical clock, advanced by every access) among the replicas that have octets in
   that tier.
2. A replica that is pinned (an unexpired pin: a lease, §6.6 "MUST NOT evict the leased
   replicas") or still being written is never a victim, nor is any replica the current
   operation protects (the one being inserted or moved).
3. A victim's layers in the tier are *demoted* to the first slower tier that has room for them,
   where room is free space plus what can be reclaimed there from replicas *less recently
   used than the victim* (recursively, by the same rules). A victim is thus never pushed down
   at the cost of a more recently used replica. If no slower tier has room, the whole replica
   is *dropped*: the store calls its evict listeners first (so the holder withdraws the Replica
   Record before or at the eviction, §6.1), then releases the octets.
4. Feasibility is decided before anything changes: if free space plus every reclaimable octet
   is not enough, :class:`StoreFull` is raised and nothing was evicted.

Dropping is always whole-replica: a replica never silently loses some of its layers.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

from .errors import StoreFull
from .pins import Clock
from .replica import StoredReplica
from .tiers import Tier

__all__ = ["Evictor", "EvictionHost"]

log = logging.getLogger(__name__)


class EvictionHost(Protocol):
    """The mechanics the evictor drives (implemented by the store)."""

    def _demote_for_room(self, victim: StoredReplica, source: Tier, target: Tier) -> None:
        """Move every layer ``victim`` has in ``source`` to ``target`` (room is guaranteed)."""

    def _drop_for_room(self, victim: StoredReplica) -> None:
        """Notify the evict listeners, then release every octet of ``victim``."""


class Evictor:
    """The LRU order of a store's replicas and the make-room algorithm."""

    def __init__(self, tiers: Sequence[Tier], host: EvictionHost, clock: Clock) -> None:
        self._tiers = tuple(tiers)
        self._host = host
        self._clock = clock
        self._lru: OrderedDict[bytes, StoredReplica] = OrderedDict()  # oldest first
        # Per tier, (tick, replica id) of the replicas with octets there, ascending: the LRU
        # order within the tier, so that finding a victim does not scan other tiers' replicas.
        self._in_tier: dict[Tier, list[tuple[int, bytes]]] = {tier: [] for tier in self._tiers}
        self._indexed: dict[bytes, set[Tier]] = {}
        self._ticks = 0

    # -- the LRU order -----------------------------------------------------------------------

    def add(self, replica: StoredReplica) -> None:
        """Register ``replica`` as the most recently used."""
        self._lru[replica.replica_id] = replica
        self._indexed[replica.replica_id] = set()
        self.touch(replica)

    def remove(self, replica: StoredReplica) -> None:
        rid = replica.replica_id
        if self._lru.pop(rid, None) is None:
            return
        for tier in self._indexed.pop(rid):
            self._unindex(tier, replica)

    def touch(self, replica: StoredReplica) -> None:
        rid = replica.replica_id
        tiers = self._indexed[rid]
        for tier in tiers:
            self._unindex(tier, replica)
        self._ticks += 1
        replica.tick = self._ticks
        self._lru.move_to_end(rid)
        for tier in tiers:
            self._in_tier[tier].append((replica.tick, rid))  # the newest: at the end

    def sync(self, replica: StoredReplica) -> None:
        """Update the per-tier order after ``replica``'s layers changed tiers."""
        tiers = self._indexed.get(replica.replica_id)
        if tiers is None:
            return
        for tier in self._tiers:
            present = replica.bytes_in(tier) > 0
            if present and tier not in tiers:
                tiers.add(tier)
                bisect.insort(self._in_tier[tier], (replica.tick, replica.replica_id))
            elif not present and tier in tiers:
                tiers.discard(tier)
                self._unindex(tier, replica)

    def _unindex(self, tier: Tier, replica: StoredReplica) -> None:
        entries = self._in_tier[tier]
        entry = (replica.tick, replica.replica_id)
        i = bisect.bisect_left(entries, entry)
        assert entries[i] == entry
        del entries[i]

    def __contains__(self, replica_id: bytes) -> bool:
        return replica_id in self._lru

    def __iter__(self) -> Iterator[StoredReplica]:
        """Replicas, least recently used first."""
        return iter(list(self._lru.values()))

    def __len__(self) -> int:
        return len(self._lru)

    # -- policy ------------------------------------------------------------------------------

    def evictable(self, replica: StoredReplica) -> bool:
        """Neither pinned (rule 2) nor being written."""
        return not replica.writing and not replica.dead and not replica.pins.active(self._clock())

    def _candidates(
        self, tier: Tier, protect: frozenset[StoredReplica], older_than: int | None
    ) -> Iterator[StoredReplica]:
        for tick, rid in list(self._in_tier[tier]):
            if older_than is not None and tick >= older_than:
                return  # the order is by tick: nothing later qualifies
            replica = self._lru.get(rid)
            if replica is None or replica in protect or replica.bytes_in(tier) == 0:
                continue  # gone, or moved out by a nested eviction
            if self.evictable(replica):
                yield replica

    def room(
        self,
        tier: Tier,
        protect: frozenset[StoredReplica] = frozenset(),
        older_than: int | None = None,
        enough: int | None = None,
    ) -> int:
        """Octets ``tier`` can offer: free space plus what eviction could reclaim there. With
        ``enough``, counting stops once that many are found (the result is then a lower bound
        that is at least ``enough``)."""
        total = tier.free
        if enough is not None and total >= enough:
            return total
        for replica in self._candidates(tier, protect, older_than):
            total += replica.bytes_in(tier)
            if enough is not None and total >= enough:
                break
        return total

    def make_room(
        self,
        tier: Tier,
        nbytes: int,
        protect: frozenset[StoredReplica] = frozenset(),
        older_than: int | None = None,
    ) -> None:
        """Evict until ``tier`` has ``nbytes`` free; :class:`StoreFull` (nothing changed) when
        even evicting every candidate would not be enough (rule 4)."""
        if tier.free >= nbytes:
            return
        available = self.room(tier, protect, older_than, enough=nbytes)  # exact when short
        if available < nbytes:
            raise StoreFull(
                nbytes,
                f"tier {tier.name!r} cannot make room for {nbytes} octets: {tier.free} free, "
                f"{available - tier.free} evictable, the rest pinned or being written",
            )
        for victim in self._candidates(tier, protect, older_than):
            if tier.free >= nbytes:
                break
            if victim.dead or victim.bytes_in(tier) == 0:
                continue  # dropped or moved by a nested eviction
            self._evict_from(victim, tier, protect)
        assert tier.free >= nbytes, (tier, nbytes)

    def _evict_from(self, victim: StoredReplica, tier: Tier, protect: frozenset[StoredReplica]) -> None:
        """Demote ``victim``'s layers out of ``tier`` (rule 3), or drop the whole replica."""
        size = victim.bytes_in(tier)
        guard = protect | {victim}
        below = self._tiers[self._tiers.index(tier) + 1 :]
        for target in below:
            if self.room(target, guard, older_than=victim.tick, enough=size) < size:
                continue
            self.make_room(target, size, guard, older_than=victim.tick)
            try:
                self._host._demote_for_room(victim, tier, target)
            except OSError as exc:  # a disk that fails to take it: drop rather than lose silently
                log.warning("demoting %r to %s failed (%s); dropping it", victim, target.name, exc)
                break
            return
        self._host._drop_for_room(victim)
