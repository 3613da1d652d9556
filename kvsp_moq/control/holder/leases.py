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
- A 503 that was applied (docs/deploy.md "A 503 that was applied"): a store write may be
  applied although too few replicas acknowledged it (``store_wait_replicas``). So every lease
  call is safe to repeat:

  - a grant answered 503 is withdrawn at once, as far as the store answers (so a client that
    gives up leaves no lease holding its quota or pinning replicas until the TTL);
  - a grant with an ``Idempotency-Key`` (draft-ietf-httpapi-idempotency-key-header; §6.6 leaves
    the request's form to us) gets a lease id derived from the principal and the key, so a
    repeat finds the lease the first try stored, if it is still there, and answers it (same id,
    remaining TTL) instead of a second lease; the key reused for another request is
    :class:`IdempotencyKeyReused` (422);
  - a renewal sets an expiry, so its repeat is harmless; a renewal answered 503 still extends
    the pins to the expiry the store holds (read back, if it answers), so no replica the store
    counts as leased is evicted meanwhile (§6.6 MUST NOT);
  - a release of the principal's lease already released (its tombstone lasts until the
    lease's expiry) succeeds again (204): §6.6 DELETE releases, and the lease is released.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import secrets
from collections.abc import Hashable

from ...kvsp.records import LeaseGrant, LeaseRequest
from ...storage import BlockStore, RecordKey, ReplicaNotFound
from ..common.auth import Principal, require_scope
from ..common.clock import Clock
from ..common.errors import LeaseQuotaExceeded, NotFound, StoreUnavailable
from .lease_store import Lease, LeaseLimits, LeaseStore, MemoryLeaseStore, Usage

__all__ = ["IdempotencyKeyReused", "Lease", "LeaseLimits", "LeaseManager", "lease_id_for", "request_fingerprint"]

log = logging.getLogger(__name__)


class IdempotencyKeyReused(Exception):
    """An ``Idempotency-Key`` the principal used for another lease request (422 in
    draft-ietf-httpapi-idempotency-key-header §2.7)."""


def lease_id_for(owner: str, idempotency_key: str) -> str:
    """The lease id of ``owner``'s grant under ``idempotency_key``: 144 bits of SHA-256,
    URL-safe base64 (the form of a random id, so an id tells nothing)."""
    digest = hashlib.sha256(f"kvsp lease\0{owner}\0{idempotency_key}".encode()).digest()
    return base64.urlsafe_b64encode(digest[:18]).decode()


def request_fingerprint(request: LeaseRequest) -> str:
    """What makes two lease requests the same request (the block keys as a set, compat,
    scope, TTL): a repeat under one ``Idempotency-Key`` must match it."""
    keys = ",".join(sorted(k.hex() for k in set(request.block_keys)))
    text = f"{request.compat_id.hex()}/{request.scope_id.hex()}/{request.ttl_ms}/{keys}"
    return hashlib.sha256(text.encode()).hexdigest()


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

    async def grant(self, principal: Principal, request: LeaseRequest, *,
                    idempotency_key: str | None = None) -> LeaseGrant:
        """Create a lease (§6.6 ``POST leases``); with ``idempotency_key``, answer the lease an
        earlier try of the same request created, if live (module notes). Raises ``Forbidden``
        (scope), ``NotFound`` (a key not held; nothing pinned), ``LeaseQuotaExceeded``,
        :class:`IdempotencyKeyReused`, ``StoreUnavailable`` (the lease withdrawn if it answers)."""
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
        fingerprint = request_fingerprint(request) if idempotency_key is not None else ""
        while True:
            lease_id = (secrets.token_urlsafe(18) if idempotency_key is None  # 144 bits, URI-unreserved
                        else lease_id_for(principal.name, idempotency_key))
            lease = Lease(lease_id, principal.name, replicas, octets, now + request.ttl_ms, request.scope_id,
                          fingerprint)
            # Pinned before any await, so nothing evicts them meanwhile; under an owner of this
            # try alone, as the id may be a live lease's (a repeat) whose pins are not ours to drop.
            trying = object()
            self._pin(lease, request.ttl_ms, owner=trying)
            try:
                outcome = await self.leases.grant(lease, self.limits, now)
            except StoreUnavailable:
                self._unpin(lease, owner=trying)
                await self._withdraw(lease)
                raise
            except BaseException:
                self._unpin(lease, owner=trying)
                raise
            if outcome.existing is not None:  # a repeat: the lease an earlier try stored
                self._pin(outcome.existing, outcome.existing.remaining_ms(now))
                self._unpin(lease, owner=trying)
                return outcome.existing.grant(now)
            if outcome.granted:
                self._pin(lease, request.ttl_ms)
                self._unpin(lease, owner=trying)
                return lease.grant(now)
            self._unpin(lease, owner=trying)
            if outcome.conflict or (outcome.duplicate and idempotency_key is not None):
                raise IdempotencyKeyReused(f"Idempotency-Key {idempotency_key!r} was used for another lease request")
            if not outcome.duplicate:
                raise self._refusal(principal, octets, outcome.usage)

    async def _withdraw(self, lease: Lease) -> None:
        """Release a lease whose grant was answered 503: it may be stored all the same (module
        notes). As far as the store answers (a write it applies but does not acknowledge is
        as good here)."""
        try:
            await self.leases.release(lease.owner, lease.id, self.clock.now_ms())
        except StoreUnavailable as exc:
            log.warning("lease %s (not acknowledged): withdrawing it failed: %s", lease.id, exc)

    async def renew(self, principal: Principal, lease_id: str, ttl_ms: int) -> LeaseGrant:
        """Extend a live lease to ``ttl_ms`` from now (§6.6 ``PUT leases/{id}``). ``NotFound``
        when unknown, expired or another principal's; ``LeaseQuotaExceeded`` above the TTL
        quota. Replicas that have left the store meanwhile (a fault) stay unpinned."""
        self._check_ttl(ttl_ms)
        now = self.clock.now_ms()
        try:
            lease = await self.leases.renew(principal.name, lease_id, now + ttl_ms, now)
        except StoreUnavailable:
            await self._pin_stored(principal, lease_id)
            raise
        if lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        self._pin(lease, ttl_ms)
        return lease.grant(now)

    async def _pin_stored(self, principal: Principal, lease_id: str) -> None:
        """After a renewal answered 503: pin the lease's replicas to the expiry the store
        holds, which the renewal may have extended (module notes); as far as the store answers."""
        try:
            lease = await self.leases.get(principal.name, lease_id, self.clock.now_ms())
        except StoreUnavailable:
            return  # the old pins last the old TTL; the store cannot be read either
        if lease is not None:
            self._pin(lease, lease.remaining_ms(self.clock.now_ms()))

    async def release(self, principal: Principal, lease_id: str) -> None:
        """End a lease (§6.6 ``DELETE leases/{id}``) and unpin its replicas; a lease the
        principal released already is released (a repeat after a 503, module notes)."""
        outcome = await self.leases.release(principal.name, lease_id, self.clock.now_ms())
        if outcome.lease is None:
            raise NotFound(f"no live lease {lease_id!r}")
        self._unpin(outcome.lease)  # a repeat: in case the first try's were left (a 503)

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

    def _pin(self, lease: Lease, ttl_ms: int, *, owner: Hashable | None = None) -> None:
        """Pin the lease's replicas for ``ttl_ms`` under its id (or ``owner``)."""
        if ttl_ms < 1:
            return
        for key, replica_id in lease.replicas.items():
            try:
                self.store.pin(key, lease.id if owner is None else owner, ttl_ms, replica_id=replica_id)
            except ReplicaNotFound:
                pass  # gone (a fault, or lost across a restart): the lease pins nothing there

    def _unpin(self, lease: Lease, *, owner: Hashable | None = None) -> None:
        for key in lease.replicas:
            self.store.unpin(key, lease.id if owner is None else owner)
