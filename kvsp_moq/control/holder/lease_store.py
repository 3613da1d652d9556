"""Where a holder keeps its leases (kvsp-draft §6.6; DESIGN.md §8): the interface and the
embedded, in-memory implementation. The Redis one is :mod:`.lease_redis`.

A store keeps each lease (id, owner, the replicas it names, its octets, its expiry) and each
owner's usage (leased octets, live leases). It does not pin anything: pins live in the
holder's :class:`~kvsp_moq.storage.BlockStore`, which :class:`~.leases.LeaseManager` keeps in
step with the store (and rebuilds from it after a restart).

Rules every implementation follows (the contract tests in ``tests/test_holder_lease_store.py``
run them over both):

- Time is the caller's: every call takes ``now_ms``, and a lease is expired once
  ``expires_ms <= now_ms``. An expired lease is never renewed, released or returned, even
  before :meth:`LeaseStore.purge` has removed it, and it no longer counts against its owner.
- :meth:`LeaseStore.grant` checks the owner's quota (§6.6 "MUST enforce a per-client quota on
  leased octets") and records the lease in one atomic step: two requests, or two holder
  processes over one store, never both pass the last bit of a quota.
- Renew, release and get see only the owner's own leases (another owner gets ``None``).
- :meth:`LeaseStore.grant` and :meth:`LeaseStore.usage` first drop the owner's expired leases;
  :meth:`LeaseStore.purge` returns the expired leases still there (their pins in the block
  store lapse on their own at the same expiry, so a lease dropped without being returned
  leaves nothing pinned).
- Safe to repeat after a 503 (a write applied but not acknowledged, docs/deploy.md "A 503 that
  was applied"): a grant whose lease carries a ``request`` fingerprint (the request came with
  an ``Idempotency-Key``; its id is derived from owner and key) and whose id the owner already
  holds live is answered with that lease (``GrantOutcome.existing``), not a second one, and
  counts once; a different request under the same id is ``GrantOutcome.conflict``. A release
  leaves a tombstone until the lease's expiry, so the owner's repeated release is answered
  released, with the lease (its replicas are unpinned then, if the first try's were not).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from ...kvsp.records import LeaseGrant
from ...storage import RecordKey

__all__ = ["GrantOutcome", "Lease", "LeaseLimits", "LeaseStore", "MemoryLeaseStore", "ReleaseOutcome", "Usage"]


@dataclass(frozen=True)
class LeaseLimits:
    """Per-client quotas (§6.6) and a bound on one request's size."""

    max_ttl_ms: int = 60_000
    max_octets: int = 4 << 30
    max_leases: int = 1024
    max_keys: int = 4096


@dataclass(frozen=True)
class Usage:
    """What one owner holds under its live leases."""

    octets: int = 0
    leases: int = 0


@dataclass(frozen=True)
class Lease:
    """A lease: the replicas it names (key -> replica id), their octets, its expiry (ms on the
    lease clock). Octets are fixed at the grant: a replica that later leaves the holder still
    counts (§6.6 quota is on what was leased)."""

    id: str
    owner: str  # principal name
    replicas: Mapping[RecordKey, bytes]
    octets: int
    expires_ms: int
    scope_id: bytes = b""
    #: The fingerprint of the request that created it when it came with an ``Idempotency-Key``
    #: (``leases.request_fingerprint``); "" otherwise.
    request: str = ""

    def grant(self, now_ms: int) -> LeaseGrant:
        return LeaseGrant(lease=self.id, ttl_ms=max(1, self.expires_ms - now_ms))

    def remaining_ms(self, now_ms: int) -> int:
        return self.expires_ms - now_ms


@dataclass(frozen=True)
class GrantOutcome:
    """The answer of :meth:`LeaseStore.grant`: granted, or refused (``usage`` is the owner's
    usage the quota was checked against; ``duplicate``: the id is taken, try another).
    ``existing``: granted before, by the same request (a repeat; nothing recorded now);
    ``conflict``: the id is the owner's lease of another request (an ``Idempotency-Key`` reused)."""

    granted: bool
    usage: Usage
    duplicate: bool = False
    existing: Lease | None = None
    conflict: bool = False


@dataclass(frozen=True)
class ReleaseOutcome:
    """The answer of :meth:`LeaseStore.release`: ``released``, now or before by the same owner
    (``lease``: the lease as it was), or not (unknown, expired or another's; ``lease`` None)."""

    released: bool
    lease: Lease | None = None


class LeaseStore(Protocol):
    """A holder's leases. Implementations: :class:`MemoryLeaseStore`, ``RedisLeaseStore``."""

    #: Whether leases outlive the holder process (a restart reloads them: :meth:`live`).
    durable: bool

    def grant(self, lease: Lease, limits: LeaseLimits, now_ms: int) -> Awaitable[GrantOutcome]:
        """Record ``lease`` unless the owner's live leases plus it exceed ``limits.max_leases``
        or ``limits.max_octets`` (one atomic step)."""
        ...

    def renew(self, owner: str, lease_id: str, expires_ms: int, now_ms: int) -> Awaitable[Lease | None]:
        """The lease, now ending at ``expires_ms``; None when unknown, expired or another's."""
        ...

    def release(self, owner: str, lease_id: str, now_ms: int) -> Awaitable[ReleaseOutcome]:
        """Remove the lease and free its quota, leaving a tombstone until its expiry (a
        repeated release by its owner is answered as released)."""
        ...

    def get(self, owner: str, lease_id: str, now_ms: int) -> Awaitable[Lease | None]:
        ...

    def usage(self, owner: str, now_ms: int) -> Awaitable[Usage]:
        ...

    def purge(self, now_ms: int) -> Awaitable[list[Lease]]:
        """Remove expired leases (freeing their quota); the removed ones."""
        ...

    def live(self, now_ms: int) -> Awaitable[list[Lease]]:
        """Every unexpired lease (a restarted holder re-pins their replicas)."""
        ...

    def close(self) -> Awaitable[None]:
        ...


class MemoryLeaseStore:
    """Leases in this process's memory (the embedded default): they end with the process.

    No method awaits before it is done, so on one event loop each call is atomic."""

    durable = False

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._by_owner: dict[str, dict[str, Lease]] = {}  # a grant looks at its owner's only
        #: Released leases until their expiry, by id. Bounded by the releases of one maximum
        #: lease TTL; :meth:`purge` drops the expired.
        self._released: dict[str, Lease] = {}

    def _add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        self._by_owner.setdefault(lease.owner, {})[lease.id] = lease

    def _remove(self, lease: Lease) -> None:
        del self._leases[lease.id]
        mine = self._by_owner[lease.owner]
        del mine[lease.id]
        if not mine:
            del self._by_owner[lease.owner]

    def _usage(self, owner: str, now_ms: int) -> Usage:
        """The owner's usage, after dropping its expired leases."""
        mine = list(self._by_owner.get(owner, {}).values())
        live = [lease for lease in mine if lease.expires_ms > now_ms]
        for lease in mine:
            if lease.expires_ms <= now_ms:
                self._remove(lease)
        return Usage(sum(lease.octets for lease in live), len(live))

    def _live(self, owner: str, lease_id: str, now_ms: int) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner or lease.expires_ms <= now_ms:
            return None
        return lease

    async def grant(self, lease: Lease, limits: LeaseLimits, now_ms: int) -> GrantOutcome:
        usage = self._usage(lease.owner, now_ms)
        held = self._leases.get(lease.id)
        if held is not None:
            if not lease.request or held.owner != lease.owner:
                return GrantOutcome(False, usage, duplicate=True)
            if held.request == lease.request:
                return GrantOutcome(True, usage, existing=held)
            return GrantOutcome(False, usage, conflict=True)
        if usage.leases + 1 > limits.max_leases or usage.octets + lease.octets > limits.max_octets:
            return GrantOutcome(False, usage)
        self._add(replace(lease, replicas=dict(lease.replicas)))
        return GrantOutcome(True, usage)

    async def renew(self, owner: str, lease_id: str, expires_ms: int, now_ms: int) -> Lease | None:
        lease = self._live(owner, lease_id, now_ms)
        if lease is None:
            return None
        self._add(lease := replace(lease, expires_ms=expires_ms))
        return lease

    async def release(self, owner: str, lease_id: str, now_ms: int) -> ReleaseOutcome:
        lease = self._live(owner, lease_id, now_ms)
        if lease is not None:
            self._remove(lease)
            self._released[lease_id] = lease
            return ReleaseOutcome(True, lease)
        gone = self._released.get(lease_id)
        if gone is None or gone.owner != owner or gone.expires_ms <= now_ms:
            return ReleaseOutcome(False)
        return ReleaseOutcome(True, gone)

    async def get(self, owner: str, lease_id: str, now_ms: int) -> Lease | None:
        return self._live(owner, lease_id, now_ms)

    async def usage(self, owner: str, now_ms: int) -> Usage:
        return self._usage(owner, now_ms)

    async def purge(self, now_ms: int) -> list[Lease]:
        expired = [lease for lease in self._leases.values() if lease.expires_ms <= now_ms]
        for lease in expired:
            self._remove(lease)
        for lease_id in [i for i, gone in self._released.items() if gone.expires_ms <= now_ms]:
            del self._released[lease_id]
        return expired

    async def live(self, now_ms: int) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.expires_ms > now_ms]

    async def close(self) -> None:
        return None
