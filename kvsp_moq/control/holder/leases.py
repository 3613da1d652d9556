"""Leases on a holder's replicas (kvsp-draft §6.6).

``POST leases`` creates a lease on the replicas of some block keys for ``ttl_ms``; ``PUT`` on
the lease renews it; ``DELETE`` releases it. While a lease is valid the holder MUST NOT evict
the leased replicas: each leased replica is pinned in the :class:`~kvsp_moq.storage.BlockStore`
with the lease id as owner and the lease's TTL, so the store's evictor never picks it (storage
``pins.py``). The holder MUST enforce a per-client quota on leased octets and lease TTL and
answer ``kvsp-lease-quota`` when a request exceeds it (§6.6).

The leases themselves live in a :class:`~.lease_store.LeaseStore` (in memory, or Redis so that
they outlive the process); this manager keeps the store's pins in step with it.

Decisions (docs/http-api.md "Holder"):

- A "client" is the authenticated principal (by name). Quotas: ``max_lease_ttl_ms`` per lease
  (a request or renewal above it is refused, not reduced), ``max_leased_octets`` summed over
  the principal's live leases (a replica in two leases counts twice: each lease holds it on
  its own), ``max_leases`` live leases.
- All or nothing: a request naming a key the holder does not hold is refused (404) and pins
  nothing; the client must be authorized for the request's scope (403).
- Atomicity: the quota check and the recording of the lease are one step of the lease store
  (no await inside for memory, one Lua script for Redis), so concurrent requests, or two holder
  processes over one Redis, never overshoot a quota. The replicas are pinned *before* that
  step, in the same event-loop turn as their lookup, so nothing can evict them while the store
  answers; a refusal unpins them again.
- Time: lease expiry is on ``lease_clock`` (milliseconds; the holder's clock for the memory
  store, the wall clock for Redis, so an expiry means the same after a restart or on another
  host). Pins run on the block store's clock with the lease's *remaining* TTL, so a lease and
  its pins end together whichever clocks they read.
- A restart (Redis): :meth:`LeaseManager.reload` re-pins the replicas of every unexpired
  lease. A lease naming a replica the holder no longer has (its disk file gone, or a forced
  eviction, §6.6) stays valid and keeps its quota, but pins nothing for that replica; a new
  replica of the same key is not covered (a lease is on replicas, not keys).
- A lease belongs to its creator: another principal gets 404 for it (its existence is not
  revealed).
"""

from __future__ import annotations

import secrets

from ...kvsp.records import LeaseGrant, LeaseRequest
from ...storage import BlockStore, RecordKey, ReplicaNotFound
from ..common.auth import Principal, require_scope
from ..common.clock import Clock
from ..common.errors import LeaseQuotaExceeded, NotFound, StoreUnavailable
from .lease_store import Lease, LeaseLimits, LeaseStore, MemoryLeaseStore, Usage

__all__ = ["Lease", "LeaseLimits", "LeaseManager"]


class LeaseManager:
    """Grants, renews and releases leases in a :class:`LeaseStore`; pins and unpins the leased
    replicas in the block store."""

    def __init__(
        self,
        store: BlockStore,
        clock: Clock,
        limits: LeaseLimits | None = None,
        *,
        leases: LeaseStore | None = None,
        lease_clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.clock = lease_clock if lease_clock is not None else clock
        self.limits = limits if limits is not None else LeaseLimits()
        self.leases: LeaseStore = leases if leases is not None else MemoryLeaseStore()
        #: False until the leases of a durable store are re-pinned (:meth:`reload`): until
        #: then the holder must not make room by eviction (it does not know what is leased).
        self.loaded = not self.leases.durable

    # -- queries -------------------------------------------------------------------------------

    async def get(self, principal: Principal, lease_id: str) -> Lease | None:
        return await self.leases.get(principal.name, lease_id, self.clock.now_ms())

    async def usage(self, principal: Principal) -> tuple[int, int]:
        """(leased octets, live leases) of ``principal``."""
        usage = await self.leases.usage(principal.name, self.clock.now_ms())
        return usage.octets, usage.leases

    # -- §6.6 operations -----------------------------------------------------------------------

    async def grant(self, principal: Principal, request: LeaseRequest) -> LeaseGrant:
        """Create a lease (§6.6 ``POST leases``). Raises ``Forbidden`` (scope), ``NotFound``
        (a key not held; nothing pinned), ``LeaseQuotaExceeded``, ``StoreUnavailable``."""
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
        now = self.clock.now_ms()
        while True:
            lease = Lease(secrets.token_urlsafe(18), principal.name, replicas, octets,  # 144 bits, URI-unreserved
                          now + request.ttl_ms, request.scope_id)
            self._pin(lease, request.ttl_ms)  # before any await: nothing evicts them meanwhile
            try:
                outcome = await self.leases.grant(lease, self.limits, now)
            except BaseException:
                self._unpin(lease)
                raise
            if outcome.granted:
                return lease.grant(now)
            self._unpin(lease)
            if not outcome.duplicate:
                raise self._refusal(principal, octets, outcome.usage)

    async def renew(self, principal: Principal, lease_id: str, ttl_ms: int) -> LeaseGrant:
        """Extend a live lease to ``ttl_ms`` from now (§6.6 ``PUT leases/{id}``). ``NotFound``
        when unknown, expired or another principal's; ``LeaseQuotaExceeded`` above the TTL
        quota. Replicas that have left the store meanwhile (a fault) stay unpinned."""
        self._check_ttl(ttl_ms)
        now = self.clock.now_ms()
        lease = await self.leases.renew(principal.name, lease_id, now + ttl_ms, now)
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        self._pin(lease, ttl_ms)
        return lease.grant(now)

    async def release(self, principal: Principal, lease_id: str) -> None:
        """End a lease (§6.6 ``DELETE leases/{id}``) and unpin its replicas."""
        lease = await self.leases.release(principal.name, lease_id, self.clock.now_ms())
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        self._unpin(lease)

    async def purge(self) -> int:
        """Drop expired leases (unpinning their replicas); how many."""
        expired = await self.leases.purge(self.clock.now_ms())
        for lease in expired:
            self._unpin(lease)
        return len(expired)

    async def reload(self) -> int:
        """After a restart: pin the replicas of every unexpired lease of the store for the
        lease's remaining TTL (§6.6 MUST NOT evict a leased replica); how many leases."""
        now = self.clock.now_ms()
        live = await self.leases.live(now)
        for lease in live:
            self._pin(lease, lease.remaining_ms(now))
        self.loaded = True
        return len(live)

    def check_loaded(self) -> None:
        """``StoreUnavailable`` while the leases of a durable store are not yet reloaded."""
        if not self.loaded:
            raise StoreUnavailable("the holder has not yet reloaded its leases from the store; "
                                   "it stores no block until it knows which replicas are leased")

    async def close(self) -> None:
        await self.leases.close()

    # -- internals -----------------------------------------------------------------------------

    def _check_ttl(self, ttl_ms: int) -> None:
        if ttl_ms > self.limits.max_ttl_ms:
            raise LeaseQuotaExceeded(f"ttl_ms {ttl_ms} exceeds the lease TTL quota of {self.limits.max_ttl_ms}")

    def _refusal(self, principal: Principal, octets: int, usage: Usage) -> LeaseQuotaExceeded:
        if usage.leases + 1 > self.limits.max_leases:
            return LeaseQuotaExceeded(
                f"{principal.name!r} already holds {usage.leases} leases (quota {self.limits.max_leases})")
        return LeaseQuotaExceeded(
            f"{octets} more leased octets would exceed the quota of {self.limits.max_octets} "
            f"({usage.octets} already leased by {principal.name!r})")

    def _pin(self, lease: Lease, ttl_ms: int) -> None:
        if ttl_ms < 1:
            return
        for key, replica_id in lease.replicas.items():
            try:
                self.store.pin(key, lease.id, ttl_ms, replica_id=replica_id)
            except ReplicaNotFound:
                pass  # gone (a fault, or lost across a restart): the lease pins nothing there

    def _unpin(self, lease: Lease) -> None:
        for key in lease.replicas:
            self.store.unpin(key, lease.id)
