"""Leases on a holder's replicas (kvsp-draft §6.6).

``POST leases`` creates a lease on the replicas of some block keys for ``ttl_ms``; ``PUT`` on
the lease renews it; ``DELETE`` releases it. While a lease is valid the holder MUST NOT evict
the leased replicas: each leased replica is pinned in the :class:`~kvsp_moq.storage.BlockStore`
with the lease id as owner and the lease's TTL, so the store's evictor never picks it (storage
``pins.py``). The holder MUST enforce a per-client quota on leased octets and lease TTL and
answer ``kvsp-lease-quota`` when a request exceeds it (§6.6).

Decisions (docs/http-api.md "Holder"):

- A "client" is the authenticated principal (by name). Quotas: ``max_lease_ttl_ms`` per lease
  (a request or renewal above it is refused, not reduced), ``max_leased_octets`` summed over
  the principal's live leases (a replica in two leases counts twice: each lease holds it on
  its own), ``max_leases`` live leases.
- All or nothing: a request naming a key the holder does not hold is refused (404) and pins
  nothing; the client must be authorized for the request's scope (403).
- Atomicity: :meth:`LeaseManager.grant` checks the quota and reserves (pins) without awaiting,
  so on one event loop concurrent requests at the quota edge never overshoot it.
- Time: expiry is on the injected :class:`~.common.clock.Clock` (milliseconds). The store's pins run
  on the store's own clock (seconds), which the holder builds from the same source
  (``serve_holder``); expired leases are also dropped and unpinned here, lazily.
- A lease belongs to its creator: another principal gets 404 for it (its existence is not
  revealed).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

from ...kvsp.records import LeaseGrant, LeaseRequest
from ...storage import BlockStore, RecordKey, ReplicaNotFound
from ..common.auth import Principal, require_scope
from ..common.clock import Clock
from ..common.errors import LeaseQuotaExceeded, NotFound

__all__ = ["Lease", "LeaseLimits", "LeaseManager"]


@dataclass(frozen=True)
class LeaseLimits:
    """Per-client quotas (§6.6) and a bound on one request's size."""

    max_ttl_ms: int = 60_000
    max_octets: int = 4 << 30
    max_leases: int = 1024
    max_keys: int = 4096


@dataclass
class Lease:
    """A live lease: the replicas it pins (key -> replica id), their octets, its expiry."""

    id: str
    owner: str  # principal name
    replicas: dict[RecordKey, bytes]
    octets: int
    expires_ms: int
    scope_id: bytes = field(default=b"")

    def grant(self, now_ms: int) -> LeaseGrant:
        return LeaseGrant(lease=self.id, ttl_ms=max(1, self.expires_ms - now_ms))


class LeaseManager:
    """Grants, renews and releases leases; pins and unpins the leased replicas."""

    def __init__(self, store: BlockStore, clock: Clock, limits: LeaseLimits | None = None) -> None:
        self.store = store
        self.clock = clock
        self.limits = limits if limits is not None else LeaseLimits()
        self._leases: dict[str, Lease] = {}

    # -- queries -------------------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        self.purge()
        return self._leases.get(lease_id)

    def leases_of(self, principal: Principal) -> list[Lease]:
        self.purge()
        return [lease for lease in self._leases.values() if lease.owner == principal.name]

    def usage(self, principal: Principal) -> tuple[int, int]:
        """(leased octets, live leases) of ``principal``."""
        mine = self.leases_of(principal)
        return sum(lease.octets for lease in mine), len(mine)

    # -- §6.6 operations -----------------------------------------------------------------------

    def grant(self, principal: Principal, request: LeaseRequest) -> LeaseGrant:
        """Create a lease (§6.6 ``POST leases``). Raises ``Forbidden`` (scope), ``NotFound``
        (a key not held; nothing pinned), ``LeaseQuotaExceeded``. No await inside: the quota
        check and the reservation are one atomic step on the event loop."""
        require_scope(principal, request.scope_id)
        keys = list(dict.fromkeys(request.block_keys))
        if len(keys) > self.limits.max_keys:
            raise LeaseQuotaExceeded(f"a lease may name at most {self.limits.max_keys} block keys")
        self._check_ttl(request.ttl_ms)
        replicas: dict[RecordKey, bytes] = {}
        octets = 0
        missing: list[str] = []
        for block_key in keys:
            key = RecordKey(request.compat_id, request.scope_id, block_key)
            info = self.store.get(key)
            if info is None or not info.complete:
                missing.append(block_key.hex())
                continue
            replicas[key] = info.replica_id
            octets += info.size
        if missing:
            raise NotFound(f"the holder has no replica of block(s) {', '.join(missing)}")
        used, count = self.usage(principal)
        if count + 1 > self.limits.max_leases:
            raise LeaseQuotaExceeded(f"{principal.name!r} already holds {count} leases (quota {self.limits.max_leases})")
        if used + octets > self.limits.max_octets:
            raise LeaseQuotaExceeded(
                f"{octets} more leased octets would exceed the quota of {self.limits.max_octets} "
                f"({used} already leased by {principal.name!r})"
            )
        now = self.clock.now_ms()
        lease = Lease(self._new_id(), principal.name, replicas, octets, now + request.ttl_ms, request.scope_id)
        self._pin(lease, request.ttl_ms)
        self._leases[lease.id] = lease
        return lease.grant(now)

    def renew(self, principal: Principal, lease_id: str, ttl_ms: int) -> LeaseGrant:
        """Extend a live lease to ``ttl_ms`` from now (§6.6 ``PUT leases/{id}``). ``NotFound``
        when unknown, expired or another principal's; ``LeaseQuotaExceeded`` above the TTL
        quota. Replicas that have left the store meanwhile (a fault) stay unpinned."""
        lease = self._owned(principal, lease_id)
        self._check_ttl(ttl_ms)
        now = self.clock.now_ms()
        lease.expires_ms = now + ttl_ms
        self._pin(lease, ttl_ms)
        return lease.grant(now)

    def release(self, principal: Principal, lease_id: str) -> None:
        """End a lease (§6.6 ``DELETE leases/{id}``) and unpin its replicas."""
        lease = self._owned(principal, lease_id)
        self._drop(lease)

    def purge(self) -> int:
        """Drop expired leases (unpinning their replicas); how many."""
        now = self.clock.now_ms()
        expired = [lease for lease in self._leases.values() if lease.expires_ms <= now]
        for lease in expired:
            self._drop(lease)
        return len(expired)

    def forget_replica(self, key: RecordKey, replica_id: bytes) -> None:
        """A leased replica left the store (forced eviction): it no longer counts."""
        for lease in self._leases.values():
            if lease.replicas.get(key) == replica_id:
                del lease.replicas[key]

    # -- internals -----------------------------------------------------------------------------

    def _check_ttl(self, ttl_ms: int) -> None:
        if ttl_ms > self.limits.max_ttl_ms:
            raise LeaseQuotaExceeded(f"ttl_ms {ttl_ms} exceeds the lease TTL quota of {self.limits.max_ttl_ms}")

    def _owned(self, principal: Principal, lease_id: str) -> Lease:
        self.purge()
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != principal.name:
            raise NotFound(f"no live lease {lease_id!r}")
        return lease

    def _pin(self, lease: Lease, ttl_ms: int) -> None:
        gone: list[RecordKey] = []
        for key, replica_id in lease.replicas.items():
            try:
                self.store.pin(key, lease.id, ttl_ms, replica_id=replica_id)
            except ReplicaNotFound:
                gone.append(key)
        for key in gone:
            del lease.replicas[key]

    def _drop(self, lease: Lease) -> None:
        self._leases.pop(lease.id, None)
        for key in lease.replicas:
            self.store.unpin(key, lease.id)

    def _new_id(self) -> str:
        while True:
            lease_id = secrets.token_urlsafe(18)  # 144 bits, URI-unreserved characters
            if lease_id not in self._leases:
                return lease_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))
