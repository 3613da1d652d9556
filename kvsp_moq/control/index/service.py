"""The Index Service (kvsp-draft §6.1, §6.2): replica records, TTLs, lookup and estimates.

A plain class: callers pass an authenticated :class:`~.common.auth.Principal` and typed records;
refusals are :class:`~.common.errors.ServiceError`\\ s (and :class:`RecordError` for a record that
contradicts its request). :mod:`.routes` maps HTTP onto it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...kvsp.errors import RecordError
from ...kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    MatchedBlock,
    ReplicaRecord,
    TargetEstimate,
)
from ..common import estimates
from ..common.auth import Principal, require_holder, require_instance, require_scope
from ..common.clock import Clock, MonotonicClock
from ..common.config import IndexConfig
from ..common.descriptors import DescriptorTable
from ..common.errors import NotFound
from .metrics import IndexMetrics
from .status_table import InstanceStatusTable
from .store import BlockRef, IndexStore, MemoryIndexStore, ReplicaId, StoredReplica


@dataclass(frozen=True)
class Published:
    """The outcome of a PUT: the record as stored (``ttl_ms`` = the granted TTL, capped at
    the configured maximum) and whether it was a new replica rather than a refresh."""

    record: ReplicaRecord
    created: bool


@dataclass(frozen=True)
class LookupFound:
    """A lookup's matched prefix as stored (:meth:`IndexService.lookup_stored`): one non-empty
    list of replicas per matched key, in prefix order, and the estimates (§6.2)."""

    stored: list[list[StoredReplica]]
    targets: tuple[TargetEstimate, ...] | None


class IndexService:
    """Records replicas and answers lookups."""

    def __init__(
        self,
        store: IndexStore,
        *,
        config: IndexConfig | None = None,
        statuses: InstanceStatusTable | None = None,
        descriptors: DescriptorTable | None = None,
    ) -> None:
        self.config = config if config is not None else IndexConfig()
        self.store = store
        self.statuses = statuses if statuses is not None else InstanceStatusTable(max_ttl_ms=self.config.max_status_ttl_ms)
        self.descriptors = descriptors if descriptors is not None else DescriptorTable(max_descriptors=self.config.max_descriptors)
        for document in self.config.descriptors:
            self.descriptors.register(document)
        #: ``GET {is}metrics`` (``index/metrics.py``, docs/metrics.md).
        self.metrics = IndexMetrics()
        self.metrics.count_records_with(store.count)

    @classmethod
    def in_memory(cls, config: IndexConfig | None = None, *, clock: Clock | None = None) -> IndexService:
        """A service on the embedded store, every TTL on ``clock`` (monotonic by default)."""
        config = config if config is not None else IndexConfig()
        clock = clock if clock is not None else MonotonicClock()
        return cls(
            MemoryIndexStore(clock),
            config=config,
            statuses=InstanceStatusTable(clock, max_ttl_ms=config.max_status_ttl_ms),
        )

    # -- §6.1 publishing and withdrawing ------------------------------------------------------

    async def publish(self, principal: Principal, record: ReplicaRecord, *, at: BlockRef | None = None) -> Published:
        """Store or refresh a replica record (§6.1).

        ``at`` is the block the request addressed (the PUT's path); the record must name it.
        The principal must be authorized for the record's scope and be its holder or a
        delegate of it. ``ttl_ms`` is capped at ``config.max_ttl_ms``. The same record again
        is an idempotent refresh: one replica, its TTL restarted.
        """
        if at is not None:
            _check_names(record, at)
        require_scope(principal, record.scope_id)
        require_holder(principal, record.holder)
        ttl = min(record.ttl_ms, self.config.max_ttl_ms)
        if ttl != record.ttl_ms:
            record = dataclasses.replace(record, ttl_ms=ttl)
        created = await self.store.put(record, ttl)
        self.metrics.put(created)
        return Published(record, created)

    async def publish_many(self, principal: Principal, records: Sequence[ReplicaRecord]) -> list[Published]:
        """Store or refresh several replica records at once (ours: a holder's batched refresh
        of §6.1, ``POST {is}replicas:batch``). Each record is authorized exactly as
        :meth:`publish` authorizes it, all of them before any is stored: one refusal refuses
        the batch and stores nothing. At most ``config.max_batch_records`` records."""
        if len(records) > self.config.max_batch_records:
            raise RecordError("records", f"{len(records)} records exceed the limit of {self.config.max_batch_records}")
        granted: list[ReplicaRecord] = []
        for record in records:
            require_scope(principal, record.scope_id)
            require_holder(principal, record.holder)
            ttl = min(record.ttl_ms, self.config.max_ttl_ms)
            granted.append(record if ttl == record.ttl_ms else dataclasses.replace(record, ttl_ms=ttl))
        created = await self.store.put_many([(record, record.ttl_ms) for record in granted])
        self.metrics.put_many(created)
        return [Published(record, new) for record, new in zip(granted, created)]

    async def withdraw(self, principal: Principal, block: BlockRef, replica: ReplicaId) -> None:
        """Remove a replica record (§6.1 DELETE), under the same authorization as publishing.
        :class:`NotFound` if there is no unexpired record of that replica."""
        require_scope(principal, block.scope_id)
        require_holder(principal, replica.holder)
        if not await self.store.delete(block, replica):
            raise NotFound(f"no replica of block {block.block_key.hex()} at {replica.holder!r}")
        self.metrics.withdrawals.inc()

    async def replicas(self, principal: Principal, block: BlockRef) -> MatchedBlock:
        """The unexpired replicas of one block (ours: GET on the block's replicas).
        :class:`NotFound` if it has none."""
        require_scope(principal, block.scope_id)
        stored = await self.store.get(block)
        if not stored:
            raise NotFound(f"no replica of block {block.block_key.hex()}")
        return MatchedBlock(block_key=block.block_key, replicas=tuple(_as_returned(s) for s in stored))

    # -- §6.2 lookup --------------------------------------------------------------------------

    async def lookup(self, principal: Principal, request: LookupRequest) -> LookupResponse:
        """The matched prefix of ``request.block_keys`` and its replicas (§6.2).

        The principal must be authorized for ``request.scope_id``; only records of that scope
        and compat are ever read ("MUST NOT return replicas of a scope for which the client is
        not authorized"). Matching stops at the first key without an unexpired replica
        ("MUST stop at the first key without a replica"). Each returned record's ``ttl_ms``
        is its remaining lifetime. With ``targets``, each target the IS can estimate gets
        ``fetch_us`` and ``recompute_us`` (§6.4, :mod:`.common.estimates`); the others are left out.
        """
        found = await self.lookup_stored(principal, request)
        blocks = tuple(
            MatchedBlock(block_key=key, replicas=tuple(_as_returned(s) for s in stored))
            for key, stored in zip(request.block_keys, found.stored)
        )
        return LookupResponse(matched=len(blocks), blocks=blocks, targets=found.targets)

    async def lookup_stored(self, principal: Principal, request: LookupRequest) -> LookupFound:
        """:meth:`lookup` with the replicas as the store keeps them (each record with its
        remaining lifetime beside it), for an encoder that writes them without building the
        returned records (the compact answer, ``routes.py``). Same rules, same metrics."""
        require_scope(principal, request.scope_id)
        started = time.perf_counter()
        found = await self.store.get_prefix(request.compat_id, request.scope_id, request.block_keys)
        stored: list[list[StoredReplica]] = []
        for _, replicas in zip(request.block_keys, found):
            if not replicas:  # a store that overrides get_prefix must stop here; be sure
                break
            stored.append(replicas)
        targets = None
        if request.targets is not None:
            # the estimates read residency, size and holder, never ttl_ms: the stored records do
            blocks = [MatchedBlock(block_key=key, replicas=tuple(s.record for s in replicas))
                      for key, replicas in zip(request.block_keys, stored)]
            targets = self.estimate(request.compat_id, blocks, request.targets)
        self.metrics.lookup(len(request.block_keys), len(stored), time.perf_counter() - started)
        return LookupFound(stored=stored, targets=targets)

    def estimate(self, compat_id: bytes, blocks: list[MatchedBlock], targets: tuple[str, ...]) -> tuple[TargetEstimate, ...]:
        """Estimates for the targets that have an unexpired status, when the compat's
        descriptor is known (``block_tokens``); targets are listed once, in request order."""
        descriptor = self.descriptors.get(compat_id)
        if descriptor is None:
            return ()
        replicas = [block.replicas for block in blocks]
        out: list[TargetEstimate] = []
        for instance in dict.fromkeys(targets):
            status = self.statuses.get(instance)
            if status is None:
                continue
            estimate = estimates.estimate_target(
                status, replicas, block_tokens=descriptor.block_tokens, layers=descriptor.layers
            )
            if estimate is not None:
                out.append(estimate)
        return tuple(out)

    # -- inputs of the estimates (ours) ------------------------------------------------------

    def update_instance_status(self, record: InstanceStatusRecord) -> InstanceStatusRecord:
        """Learn an instance's status and links (§6.3) from a trusted in-process caller (the
        PC). Raises ``StaleEpoch`` for an epoch lower than one already seen."""
        return self.statuses.update(record)

    def report_instance_status(self, principal: Principal, record: InstanceStatusRecord) -> InstanceStatusRecord:
        """The same for a remote reporter, which must be allowed to report for the instance."""
        require_instance(principal, record.instance)
        return self.statuses.update(record)

    def register_descriptor(self, document: Mapping[str, Any], *, expect: bytes | None = None) -> tuple[bytes, bool]:
        """Learn a Compatibility Descriptor (for ``block_tokens`` and ``layers``); its ID is
        computed, never trusted (§4.1). Returns the compat_id and whether it was new."""
        return self.descriptors.register(document, expect=expect)

    async def purge(self) -> int:
        """Reclaim expired replica and status records; the number of replica records dropped."""
        self.statuses.purge()
        return await self.store.purge()


def _check_names(record: ReplicaRecord, at: BlockRef) -> None:
    for name in ("compat_id", "scope_id", "block_key"):
        if getattr(record, name) != getattr(at, name):
            raise RecordError(name, "does not match the block named by the request path")


def _as_returned(stored: StoredReplica) -> ReplicaRecord:
    """A record as a lookup returns it: ``ttl_ms`` is the remaining lifetime (docs/records.md)."""
    if stored.record.ttl_ms == stored.remaining_ms:
        return stored.record
    return dataclasses.replace(stored.record, ttl_ms=stored.remaining_ms)
