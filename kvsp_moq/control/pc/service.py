"""The Placement Controller (kvsp-draft §6.3, §6.4, §6.5, §6.8, §6.9): instance status and
lifecycle, placement by cost, prefetch directives, sessions and resharding.

A plain class: callers pass an authenticated :class:`~.common.auth.Principal` and typed records;
:mod:`.routes` maps ``instance-status``, ``instance-state``, ``instances`` and
``placements`` onto it (docs/http-api.md "Placement Controller"). Collaborators, one job each:

- :class:`~.pc.registry.InstanceRegistry` — records, TTLs (failure on expiry), epochs, states;
- :mod:`.pc.placement` — the §6.4 cost;
- :class:`PcIndex` — the IS: lookups with targets (§6.2) and the statuses the PC feeds it, so
  that the IS has the links its estimates need (in process :class:`LocalPcIndex`, over HTTP
  ``client.http.HttpIndexClient``);
- :class:`InstanceClient` — calls to instances: ``PUT state`` and ``POST prefetch``;
- :data:`StartInstance` — the deployment's hook that starts a new instance (§6.4 MAY);
- :class:`~.pc.sessions.SessionManager` (``sessions``) — §6.8 checkpoints, session epochs and
  migration, placing with :meth:`PlacementController.rank`;
- :class:`~.pc.reshard.ReshardCoordinator` (``reshard``) — §6.9 Shard Maps and reshard plans
  (a reshard in flight is stored, and finished by the PC that takes over);
- :class:`~.pc.directives.DirectiveBook` (``directives``) — the §6.5 directives sent that still
  matter: a placement of their request goes where they load, and none is sent twice;
- :class:`~.pc.leader.Leadership` (``leader``) — the store (``pc/store``, DESIGN.md §8) and the
  leader lock: the three collaborators above are the active PC's cache of the store, written
  through ``leader.write`` (fenced), loaded by :meth:`PlacementController.elected` when this PC
  becomes the active one and dropped by :meth:`PlacementController.deposed`.

The §6.3 MUSTs: a record with a lower epoch is discarded (``StaleEpoch``, 409); an expired
record makes the instance failed; requests are assigned, and directives sent, only to active
instances (:meth:`PlacementController.place` and :meth:`PlacementController.send_prefetch`
check it right before acting).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ...kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    MatchedBlock,
    PrefetchBlock,
    PrefetchDirective,
)
from ...kvsp.records.instance import ACTIVE, DRAINING, SLEEPING
from ..common import estimates
from ..common.auth import Principal, require_instance, require_scope
from ..common.clock import Clock, Timer
from ..common.config import PcConfig
from ..common.errors import InstanceUnreachable, NotActive, NotFound, NotLeader, StoreUnavailable
from ..common.records import Candidate, InstanceList, InstanceView, Placement, PlacementRequest, StatusAnswer
from . import placement
from .directives import DirectiveBook
from .leader import Leadership
from .metrics import PcMetrics
from .registry import InstanceRegistry
from .reshard import ReshardClient, ReshardCoordinator
from .sessions import FrontEndNotifier, SessionInstanceClient, SessionManager
from .store import IssuedDirective, MemoryPcStore, PcSnapshot

__all__ = [
    "InstanceClient",
    "LocalIndexService",
    "LocalPcIndex",
    "PcIndex",
    "PlacementController",
    "SleepPolicy",
    "StartInstance",
    "StartRequest",
    "sleep_policy",
]

log = logging.getLogger(__name__)


class PcIndex(Protocol):
    """What the PC needs of the Index Service."""

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        ...

    async def report_status(self, record: InstanceStatusRecord) -> None:
        """Give the IS an instance's status and links (for the §6.4 estimates)."""
        ...


class LocalIndexService(Protocol):
    """What :class:`LocalPcIndex` calls of an in-process ``index.service.IndexService``."""

    async def lookup(self, principal: Principal, request: LookupRequest) -> LookupResponse:
        ...

    def update_instance_status(self, record: InstanceStatusRecord) -> InstanceStatusRecord:
        ...


class LocalPcIndex:
    """:class:`PcIndex` on an in-process Index Service (:class:`LocalIndexService`), acting as
    ``principal``."""

    def __init__(self, service: LocalIndexService, principal: Principal) -> None:
        self.service = service
        self.principal = principal

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        return await self.service.lookup(self.principal, request)

    async def report_status(self, record: InstanceStatusRecord) -> None:
        self.service.update_instance_status(record)


class InstanceClient(Protocol):
    """The PC's calls to instances (§6.3 ``PUT state``, §6.5 ``POST prefetch``)."""

    async def put_state(self, instance: str, state: str) -> str:
        """Set the state; returns the state the instance reports it is in."""
        ...

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> str:
        """Send a directive; returns the absolute URL of its status resource (``Location``)."""
        ...


@dataclass(frozen=True)
class StartRequest:
    """What the start hook learns: the request to place and the lookup's answer."""

    request: PlacementRequest
    lookup: LookupResponse
    candidates: tuple[Candidate, ...]


#: Starts a new instance (§6.4 "the PC MAY start a new instance") and returns its URL once it
#: accepts requests; ``None`` when it cannot start one. Provided by the deployment.
StartInstance = Callable[[StartRequest], Awaitable[str | None]]

#: Decides a request to sleep (§6.3): ``(record, active instances) -> accept``.
SleepPolicy = Callable[[InstanceStatusRecord, Sequence[str]], bool]


def sleep_policy(name: str, *, min_active: int = 1) -> SleepPolicy:
    """``always``, ``never``, or ``min-active``: accept while at least ``min_active`` other
    instances stay active."""
    if name == "always":
        return lambda record, active: True
    if name == "never":
        return lambda record, active: False
    if name == "min-active":
        return lambda record, active: sum(1 for i in active if i != record.instance) >= min_active
    raise ValueError(f"unknown sleep policy {name!r}")


class PlacementController:
    """Tracks instances and places requests on them."""

    def __init__(
        self,
        *,
        clock: Clock,
        index: PcIndex | None,
        instances: InstanceClient | None,
        config: PcConfig | None = None,
        policy: SleepPolicy | None = None,
        start_instance: StartInstance | None = None,
        service_time_us: placement.ServiceTime | None = None,
        session_client: SessionInstanceClient | None = None,
        reshard_client: ReshardClient | None = None,
        timer: Timer | None = None,
        front_ends: FrontEndNotifier | None = None,
        leader: Leadership | None = None,
    ) -> None:
        self.config = config if config is not None else PcConfig()
        self.clock = clock
        self.index = index
        self.instances = instances
        #: The store and the leader lock (default: the memory store, held for good).
        self.leader = leader if leader is not None else Leadership(MemoryPcStore(), lease_ms=None)
        self.leader.on_elected = self.elected
        self.leader.on_deposed = self.deposed
        self.registry = InstanceRegistry(clock, max_ttl_ms=self.config.max_status_ttl_ms, leader=self.leader)
        self.policy = policy if policy is not None else sleep_policy(self.config.sleep_policy, min_active=self.config.min_active)
        self.start_instance = start_instance
        mean = float(self.config.mean_service_us)
        self.service_time_us = service_time_us if service_time_us is not None else (lambda status: mean)
        self.limits = placement.Limits(
            max_cost_us=self.config.max_cost_us or math.inf,
            max_queued=self.config.max_queued,
            max_kv_utilization=self.config.max_kv_utilization,
        )
        #: §6.8 sessions, checkpoints and migration (``pc/sessions.py``).
        self.sessions = SessionManager(registry=self.registry, client=session_client, rank=self.rank,
                                       prefetch=self.prefetch_to, max_sessions=self.config.max_sessions,
                                       front_ends=front_ends)
        #: §6.9 Shard Maps and resharding (``pc/reshard.py``); deadlines on ``timer``.
        self.reshard = ReshardCoordinator(client=reshard_client, timer=timer, deadline_ms=self.config.reshard_deadline_ms,
                                          leader=self.leader)
        #: §6.5 directives sent that still matter (``pc/directives.py``).
        self.directives = DirectiveBook()
        self._background: set[asyncio.Task[object]] = set()
        #: ``GET {pc}metrics`` (``pc/metrics.py``, docs/metrics.md).
        self.metrics = PcMetrics()
        self.metrics.watch(
            instances=lambda: [self.registry.state(i) or "unknown" for i in self.registry.instances()],
            sessions=lambda: [("failed" if e.failed is not None else "pending" if e.instance is None else "serving", e.epoch)
                              for e in self.sessions.entries()],
            leading=lambda: self.leader.leading)

    # -- active/standby (pc/leader.py) -------------------------------------------------------------

    async def elected(self, snapshot: PcSnapshot) -> None:
        """This PC became the active one: the stored state becomes its own. The duties start
        at once, in the background: sessions of instances that failed meanwhile, and pending
        ones, are placed (§6.8); reshards in flight are finished (§6.9); the directives sent
        are honoured (§6.5)."""
        self.registry.load(snapshot)
        self.sessions.load(snapshot)
        self.directives.load(snapshot.directives.values())
        self.reshard.load(snapshot)  # starts the stored reshards: they run once ``leader.leading`` is set
        if self.sessions.tracking():
            self.spawn(self.sessions.check_failures())  # runs once ``leader.leading`` is set

    def deposed(self) -> None:
        """Another PC is the active one: forget the cache; background work stops."""
        for task in list(self._background):
            task.cancel()
        self.registry.clear()
        self.sessions.clear()
        self.directives.clear()
        self.reshard.clear()

    # -- §6.3 status and lifecycle --------------------------------------------------------------

    async def report_status(self, principal: Principal, record: InstanceStatusRecord) -> StatusAnswer:
        """An instance's status PUT. ``Forbidden`` unless the principal may report for it;
        ``StaleEpoch`` (409) for an epoch lower than the highest seen (§6.3 MUST discard).

        The answer is the state the PC holds the instance in; for ``requested_state:
        "sleeping"`` of an active instance the policy decides: ``draining`` accepts (the PC
        assigns draining at once: no new request reaches it), ``active`` refuses (§6.3).
        The record is then passed on to the IS (its links feed the §6.4 estimates).
        """
        require_instance(principal, record.instance)
        previous = self.registry.highest_epoch(record.instance)
        record = await self.registry.report(record)
        state = self.registry.state(record.instance)
        if previous is not None and record.epoch > previous:
            # §6.3 the instance restarted: the sessions its earlier incarnation ran are gone (§6.8).
            self.spawn(self.sessions.instance_failed(record.instance, before_epoch=record.epoch))
        elif state == ACTIVE and self.sessions.tracking():
            # §6.3/§6.8: a live instance reporting is when expired ones are looked for (and
            # the moment a migration target exists); pending sessions are retried too.
            self.spawn(self.sessions.check_failures())
        if record.requested_state == SLEEPING and state == ACTIVE:
            active = [r.instance for r in self.registry.active_records()]
            if self.policy(record, active):
                await self.registry.assign(record.instance, DRAINING)
                state = DRAINING
        if self.index is not None:
            try:
                await self.index.report_status(record)
            except Exception as exc:  # the IS is advisory for the PC's own view
                log.warning("passing the status of %s to the index failed: %s", record.instance, exc)
        assert state is not None
        return StatusAnswer(state=state)

    async def set_state(self, principal: Principal, instance: str, state: str) -> StatusAnswer:
        """Change an instance's state (§6.3 "PUT state on the instance"). The assignment takes
        effect in the PC before the call, so nothing new is placed on a draining instance even
        while the call is in flight. ``NotFound`` for an instance the PC does not know."""
        require_instance(principal, instance)
        if not self.registry.known(instance):
            raise NotFound(f"the PC knows no instance {instance!r}")
        if self.instances is None:
            raise NotActive("this PC has no client to reach instances")
        await self.registry.assign(instance, state)
        try:
            reported = await self.instances.put_state(instance, state)
        except InstanceUnreachable as exc:
            raise NotActive(f"instance {instance} did not take the state change: {exc}") from None
        await self.registry.assign(instance, reported)  # e.g. draining for "sleeping" with sessions in flight
        return StatusAnswer(state=reported)

    def views(self, principal: Principal) -> InstanceList:
        """The instances the principal may report for, as the PC sees them."""
        out = []
        for instance in self.registry.instances():
            if not principal.may_report_for(instance):
                continue
            entry = self.registry.entry(instance)
            state = self.registry.state(instance)
            assert state is not None
            out.append(InstanceView(
                instance=instance,
                epoch=entry.record.epoch if entry else None,
                state=state,
                reported=entry.record.state if entry else None,
                assigned=entry.assigned if entry else None,
                running=entry.record.running if entry else None,
                queued=entry.record.queued if entry else None,
                kv_utilization=entry.record.kv_utilization if entry else None,
            ))
        return InstanceList(instances=tuple(out))

    # -- §6.4 placement ------------------------------------------------------------------------

    def candidates(self, request: PlacementRequest, statuses: Sequence[InstanceStatusRecord], lookup: LookupResponse) -> tuple[Candidate, ...]:
        estimates_by_instance = {t.instance: t for t in (lookup.targets or ())}
        return tuple(
            placement.candidate(
                status,
                estimates_by_instance.get(status.instance),
                tokens=request.tokens,
                service_time_us=self.service_time_us,
                limits=self.limits,
            )
            for status in statuses
        )

    async def place(self, principal: Principal, request: PlacementRequest) -> Placement:
        """Choose an active instance with the lowest §6.4 cost; when none is acceptable, start
        one through the hook (if any) and send it a prefetch directive at once (§6.4). A
        directive is also sent to a chosen running instance when loading beats recomputing
        and some matched block is not resident there (§6.5). ``NotActive`` (409) when there is
        no active instance and none could be started."""
        require_scope(principal, request.scope_id)
        statuses = self.registry.active_records()
        lookup = await self._lookup(request, [s.instance for s in statuses])
        candidates = self.candidates(request, statuses, lookup)
        honoured = self._directive_of(request)
        if honoured is not None:  # §6.5: the request goes where its directive loads
            cost = next((c.cost_us for c in candidates if c.instance == honoured.instance), None)
            return Placement(instance=honoured.instance, cost_us=cost, matched=lookup.matched, started=False,
                             directive=honoured.directive.directive, directive_status=honoured.location,
                             candidates=candidates)
        chosen = placement.best(candidates)
        started = False
        if chosen is None and self.start_instance is not None:
            url = await self.start_instance(StartRequest(request, lookup, candidates))
            if url is not None:
                self.registry.started(url)
                started = True
                placement_ = Placement(instance=url, cost_us=None, matched=lookup.matched, started=True, candidates=candidates)
                return await self._with_prefetch(placement_, request, lookup, None)
        if chosen is None:
            chosen = placement.best(candidates, acceptable_only=False)  # best effort: over its limits
        if chosen is None:
            raise NotActive("no active instance to place the request on")
        result = Placement(instance=chosen.instance, cost_us=chosen.cost_us, matched=lookup.matched, started=started, candidates=candidates)
        if not placement.loads_cache(chosen):
            return result
        return await self._with_prefetch(result, request, lookup, self.registry.record(chosen.instance))

    def _directive_of(self, request: PlacementRequest, instance: str | None = None) -> IssuedDirective | None:
        """A live directive this PC or its predecessor sent for ``request`` (by its request_ref,
        to ``instance`` if given) whose instance is still active (§6.3), or None."""
        issued = self.directives.for_request(request.scope_id, request.compat_id, request.request_ref, instance)
        if issued is None or not self.registry.is_active(issued.instance):
            return None
        return issued

    async def _lookup(self, request: PlacementRequest, targets: list[str]) -> LookupResponse:
        if self.index is None or not request.block_keys:
            return LookupResponse(matched=0, blocks=())
        lookup = LookupRequest(scope_id=request.scope_id, compat_id=request.compat_id, block_keys=request.block_keys, targets=tuple(targets))
        return await self.index.lookup(lookup)

    async def _with_prefetch(
        self, result: Placement, request: PlacementRequest, lookup: LookupResponse, status: InstanceStatusRecord | None
    ) -> Placement:
        if not request.prefetch:
            return result
        directive = self.directive_for(result.instance, request, lookup.blocks, status)
        if directive is None:
            return result
        try:
            location = await self.send_prefetch(directive, result.instance)
        except (InstanceUnreachable, NotActive) as exc:
            log.warning("prefetch directive to %s failed: %s", result.instance, exc)
            return result
        return Placement(
            instance=result.instance, cost_us=result.cost_us, matched=result.matched, started=result.started,
            directive=directive.directive, directive_status=location, candidates=result.candidates,
        )

    async def rank(self, request: PlacementRequest, exclude: Collection[str] = ()) -> list[str]:
        """The active instances for ``request``, best first: acceptable ones by §6.4 cost, then
        the others by cost (ties to the smaller URL); ``exclude`` left out. Used to place and
        resume sessions (§6.8 "selects a new instance as in Section 6.4")."""
        statuses = [s for s in self.registry.active_records() if s.instance not in exclude]
        if not statuses:
            return []
        try:
            lookup = await self._lookup(request, [s.instance for s in statuses])
        except Exception as exc:  # the IS is advisory here: without it every candidate recomputes
            log.warning("lookup for ranking failed: %s", exc)
            lookup = LookupResponse(matched=0, blocks=())
        ranked = sorted(self.candidates(request, statuses, lookup), key=lambda c: (not c.acceptable, c.cost_us, c.instance))
        return [c.instance for c in ranked]

    # -- background work ---------------------------------------------------------------------

    def spawn(self, work: Coroutine[object, object, object]) -> None:
        """Run ``work`` in the background (a migration triggered by a status report)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[object]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work of the PC failed", exc_info=task.exception())

    async def settle(self) -> None:
        """Wait for the background work started so far (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.reshard.close()  # undecided: the PC that takes over finishes them
        await self.leader.close()

    # -- §6.5 prefetch directives --------------------------------------------------------------

    def directive_for(
        self, instance: str, request: PlacementRequest, blocks: Sequence[MatchedBlock], status: InstanceStatusRecord | None
    ) -> PrefetchDirective | None:
        """A directive loading the matched blocks that are not resident at ``instance``; each
        block's sources are its holders, the one the §6.4 fetch plan chose first (then by URL).
        ``None`` when there is nothing to load."""
        preferred: dict[bytes, str] = {}
        if status is not None:
            plan = estimates.plan_fetch(instance, status.links, [b.replicas for b in blocks])
            if plan is not None:
                for a in plan.assignments:
                    preferred.setdefault(a.block_key, a.holder)
        out: list[PrefetchBlock] = []
        for block in blocks:
            holders = sorted({r.holder for r in block.replicas})
            if instance in holders:
                continue  # resident at the instance (it published it, §6.5)
            first = preferred.get(block.block_key)
            sources = ([first] if first else []) + [h for h in holders if h != first]
            out.append(PrefetchBlock(block_key=block.block_key, sources=tuple(sources)))
        if not out:
            return None
        return PrefetchDirective(
            directive=uuid.uuid4(),
            request_ref=request.request_ref,
            scope_id=request.scope_id,
            compat_id=request.compat_id,
            blocks=tuple(out),
            deadline_ms=self.config.prefetch_deadline_ms,
            lease_ms=self.config.prefetch_lease_ms,
        )

    async def prefetch_to(self, request: PlacementRequest, instance: str) -> uuid.UUID | None:
        """A §6.5 directive to ``instance`` for the matched blocks of ``request`` not resident
        there (sessions: ``pc/sessions.py``, request_ref = the session id). The instance was
        chosen already, so no cost comparison: a session's prompt blocks cannot be recomputed
        (their tokens are not in its checkpoint). None when nothing was sent (nothing to load,
        no prefetch asked). ``InstanceUnreachable``/``NotActive`` when the instance refused."""
        if not request.prefetch or not request.block_keys:
            return None
        sent = self._directive_of(request, instance)
        if sent is not None:  # sent already (e.g. by the PC before a takeover): not twice
            return sent.directive.directive
        lookup = await self._lookup(request, [instance])
        directive = self.directive_for(instance, request, lookup.blocks, self.registry.record(instance))
        if directive is None:
            return None
        await self.send_prefetch(directive, instance)
        return directive.directive

    async def send_prefetch(self, directive: PrefetchDirective, instance: str) -> str:
        """Send ``directive`` to ``instance``: only to an active one (§6.3 MUST NOT), else
        ``NotActive``. Returns the URL of the directive's status resource."""
        if not self.registry.is_active(instance):
            raise NotActive(f"instance {instance} is {self.registry.state(instance) or 'unknown'}, not active")
        if self.instances is None:
            raise NotActive("this PC has no client to reach instances")
        issued = IssuedDirective(instance, directive, int(time.time() * 1000) + directive.deadline_ms + directive.lease_ms)
        try:  # a record of what was sent: a store that cannot take it does not stop the directive
            await self.leader.write(lambda token: self.leader.store.put_directive(token, issued))
        except StoreUnavailable as exc:
            log.warning("recording directive %s failed: %s", directive.directive, exc)
        try:
            location = await self.instances.prefetch(instance, directive)
        except Exception:
            self.metrics.directives.labels("refused").inc()
            raise
        self.metrics.directives.labels("sent").inc()
        if directive.request_ref is not None:  # what a placement of its request is answered with (§6.5)
            issued = replace(issued, location=location)
            self.directives.add(issued)
            try:
                await self.leader.write(lambda token: self.leader.store.put_directive(token, issued))
            except (StoreUnavailable, NotLeader) as exc:  # sent: the placement stands
                log.warning("recording the status resource of directive %s failed: %s", directive.directive, exc)
        return location
