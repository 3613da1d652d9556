"""The PC's sessions (kvsp-draft §6.8): checkpoints, session epochs, migration on failure.

For every session it started, the PC keeps the instance serving it, the current **session
epoch** and the **latest checkpoint**: the one with the highest ``output_offset`` for the
current epoch (§6.8). The rules:

- ``PUT sessions/{id}/checkpoint`` with a lower epoch than the session's is refused with
  ``kvsp-stale-epoch`` (§6.8 MUST); a higher one was never assigned (400). A checkpoint must
  extend the output the kept one covers (``generated`` starts with it); one that covers less
  (a retransmission) changes nothing. The answer, :class:`CheckpointAck`, names the offset
  covered by the checkpoint kept, so that an instance with a non-deterministic sampler knows
  which tokens it may release (§6.8 MUST NOT release before acknowledgement).
- When an instance fails — its status record expires (§6.3), a ``POST failures`` reports it,
  or it reports a higher instance epoch (it restarted, so what it ran is gone) — each of its
  sessions is placed again (the §6.4 cost, through the ``rank`` hook the PC provides) and
  resumed with ``POST sessions/{id}/resume`` carrying the latest checkpoint and a **new
  epoch** (§6.8). The epoch is raised when the failure is learnt, so that any message of the
  failed instance is refused from then on, and again before each further attempt: if an
  attempt timed out but the instance did start the session, its messages carry a lower epoch
  than the next attempt's and are refused too. Sessions that no instance took stay pending
  and are retried by :meth:`SessionManager.retry_pending`.

Placing a session (a start, a resume, a re-placement) goes like a request's placement: the
instances are ranked by the §6.4 cost with the IS lookup of the session's ``prompt_blocks``,
and, before the order, the chosen instance gets a §6.5 prefetch directive for the blocks that
are not resident there (the ``prefetch`` hook, :meth:`~.pc.service.PlacementController.prefetch_to`)
whose ``request_ref`` is the session id: the instance lets it finish before it loads the
context, exactly as ``generate`` waits for its request's directive. (The PC knows the Block
Keys of the prompt only; the generated blocks a resume needs are found by the instance.)

An instance that cannot serve a session it was sent (another model, prompt blocks no replica
delivers, an unknown sampler) reports it with ``POST sessions/{id}/failed``
(:meth:`SessionManager.failed`, the epoch it ran): the PC raises the epoch and places the
session on another instance, never again on one that refused it. When every instance the PC
knows has refused it, the session is **failed**: it is no longer placed, its view says why
(``failed``), and the PC tells the session's front end (``POST {fe}sessions/{id}/failed``,
:class:`FrontEndNotifier`), which ends the client's token stream with the reason (without it
the client would wait for an ``end`` that never comes). Otherwise, with no other instance
active now, it stays pending.

Expired instances are looked for (:meth:`SessionManager.check_failures`) whenever an active
instance reports its status — the moment a migration target is known to be alive — and, with
``failure_check_ms`` configured, periodically.

The PC's calls to instances go through :class:`SessionInstanceClient` (``client.http.HttpInstanceClient``
over HTTP), which raises :class:`~.common.errors.InstanceUnreachable` on any refusal.

The sessions are the active PC's cache of its store (``pc/store``, DESIGN.md §8). Every change
is written there before it takes effect here, and before anything is sent that depends on it:
a raised epoch is stored before the order carrying it goes out, so that a PC taking over
accepts that run's checkpoints and refuses the older run's. The store applies the epoch rules
itself, atomically (a compare-and-set on the session epoch; the highest ``output_offset`` per
epoch for checkpoints), so two PCs cannot both move a session, and a checkpoint is
acknowledged only once it is stored (§6.8: what an instance releases on the acknowledgement
survives the PC). A PC that becomes active loads them (:meth:`SessionManager.load`); sessions
it finds pending are placed by its next :meth:`SessionManager.check_failures`.

**A write not acknowledged.** A Redis store acknowledges a write once ``store_wait_replicas``
replicas have it (``WAIT``, docs/deploy.md "Durability"); fewer is ``StoreUnavailable`` (503),
yet the primary *applied* the write. The cache then lags the store, and its next
compare-and-set on the epoch would be refused (``StaleEpoch``) on every retry, leaving the
session where it was for good. So a session write that is not acknowledged, or is refused as
stale, marks the entry **unsure**, and it is re-read from the store (:meth:`PcStore.get_session`)
at once if the store answers, else before anything is decided with it (``_held``, ``_current``;
:meth:`SessionManager.retry_pending` visits unsure sessions too). Nothing is sent on a write
not acknowledged: the order that carries a new epoch waits for a raise that is acknowledged.
An ``open`` retried after its create was applied but not acknowledged finds its own session
stored (the same ``SessionOpen``) and carries on with it; a ``done`` retried after its delete
was applied finds nothing to delete and forgets the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...kvsp.errors import RecordError
from ...kvsp.records import SessionCheckpoint
from ...kvsp.records.instance import FAILED
from ..common.auth import Principal, require_instance, require_scope
from ..common.errors import FrontEndUnreachable, InstanceUnreachable, NotActive, NotFound, StaleEpoch, StoreUnavailable
from ..common.records import PlacementRequest
from ..common.session_records import (
    MAX_REASON_CHARS,
    CheckpointAck,
    FailureReport,
    SessionDone,
    SessionFailed,
    SessionList,
    SessionOpen,
    SessionOrder,
    SessionView,
)
from .registry import InstanceRegistry
from .store import PcSnapshot, StoredSession

__all__ = [
    "DirectiveObserver",
    "FrontEndNotifier",
    "Prefetch",
    "Rank",
    "SessionEntry",
    "SessionInstanceClient",
    "SessionManager",
]

log = logging.getLogger(__name__)


class FrontEndNotifier(Protocol):
    """The PC's call to a session's front end (``client.http.HttpFrontEndClient``)."""

    async def session_failed(self, front_end: str, session: uuid.UUID, notice: SessionFailed) -> None:
        """``POST {fe}sessions/{id}/failed`` (ours); raises :class:`FrontEndUnreachable` when
        the front end refuses or cannot be reached."""
        ...


class SessionInstanceClient(Protocol):
    """The PC's session calls to instances; both raise :class:`~.common.errors.InstanceUnreachable`
    when the instance refuses (any error answer) or cannot be reached."""

    async def start_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/start`` (ours)."""
        ...

    async def resume_session(self, instance: str, order: SessionOrder) -> None:
        """``POST {ii}sessions/{id}/resume`` (§6.8)."""
        ...


#: The instances to try for a placement request, best first (§6.4 cost), leaving out
#: ``exclude``. Provided by :class:`~.pc.service.PlacementController`.
Rank = Callable[[PlacementRequest, Collection[str]], Awaitable[Sequence[str]]]

#: Called for every §6.5 directive sent with a session's order: the session, the instance and
#: the directive's id (embedding and demos observe placements with it; ``kvsp demo`` does).
DirectiveObserver = Callable[[uuid.UUID, str, uuid.UUID], None]

#: Send the chosen instance a §6.5 prefetch directive for the request's blocks not resident
#: there (``request_ref`` is the session id); the directive's id, or None when none was sent.
#: Provided by :class:`~.pc.service.PlacementController` (``prefetch_to``).
Prefetch = Callable[[PlacementRequest, str], Awaitable["uuid.UUID | None"]]


@dataclass
class SessionEntry:
    """What the PC keeps of one session."""

    open: SessionOpen
    epoch: int  # the current session epoch
    checkpoint: SessionCheckpoint  # the latest: highest output_offset (§6.8)
    instance: str | None = None  # serving it; None while pending
    instance_epoch: int | None = None  # the instance's own epoch (§6.3) when it took the session
    fresh: bool = False  # no order was sent with ``epoch`` yet
    resumed: bool = False  # the last order sent was a resume (else a start)
    refused: set[str] = field(default_factory=set)  # instances that reported they cannot serve it
    failed: str | None = None  # why the PC gave it up (every instance refused it)
    directives: list[uuid.UUID] = field(default_factory=list)  # §6.5 directives sent with its orders
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: A write of it was not acknowledged (it may have been applied): re-read before the next
    #: decision (module notes, "A write not acknowledged").
    unsure: bool = False

    def view(self) -> SessionView:
        return SessionView(session=self.open.session, instance=self.instance, epoch=self.epoch,
                           output_offset=self.checkpoint.output_offset, failed=self.failed)

    def stored(self) -> StoredSession:
        """What the store keeps of it (the checkpoint is kept beside it)."""
        return StoredSession(open=self.open, epoch=self.epoch, instance=self.instance, instance_epoch=self.instance_epoch,
                             fresh=self.fresh, resumed=self.resumed, refused=frozenset(self.refused), failed=self.failed,
                             directives=tuple(self.directives))

    @classmethod
    def from_stored(cls, stored: StoredSession, checkpoint: SessionCheckpoint) -> SessionEntry:
        return cls(open=stored.open, epoch=stored.epoch, checkpoint=checkpoint, instance=stored.instance,
                   instance_epoch=stored.instance_epoch, fresh=stored.fresh, resumed=stored.resumed,
                   refused=set(stored.refused), failed=stored.failed, directives=list(stored.directives))

    def adopt(self, stored: StoredSession, checkpoint: SessionCheckpoint) -> None:
        """Take what the store holds as this entry's state (the store is the truth)."""
        self.epoch, self.checkpoint, self.instance = stored.epoch, checkpoint, stored.instance
        self.instance_epoch, self.fresh, self.resumed = stored.instance_epoch, stored.fresh, stored.resumed
        self.refused, self.failed, self.directives = set(stored.refused), stored.failed, list(stored.directives)
        self.unsure = False


class SessionManager:
    """Sessions, checkpoints and migration (§6.8)."""

    def __init__(self, *, registry: InstanceRegistry, client: SessionInstanceClient | None, rank: Rank,
                 prefetch: Prefetch | None = None, max_sessions: int = 65_536,
                 front_ends: FrontEndNotifier | None = None) -> None:
        self.registry = registry
        self.front_ends = front_ends
        self.client = client
        self.rank = rank
        self.prefetch = prefetch
        self.directive_observers: list[DirectiveObserver] = []
        self.max_sessions = max_sessions
        self.leader = registry.leader
        self._sessions: dict[uuid.UUID, SessionEntry] = {}

    # -- the store (module notes) -------------------------------------------------------------------

    def load(self, snapshot: PcSnapshot) -> None:
        """The stored sessions (this PC became the active one)."""
        self._sessions = {sid: SessionEntry.from_stored(stored, snapshot.checkpoints[sid])
                          for sid, stored in snapshot.sessions.items()}

    def clear(self) -> None:
        self._sessions = {}

    async def _commit(self, entry: SessionEntry, **changes: object) -> None:
        """Store ``changes`` of ``entry`` (a compare-and-set on its epoch), then apply them.
        A write not acknowledged (``StoreUnavailable``: it may have been applied all the same)
        or refused (``StaleEpoch``: this cache is behind the store) leaves ``entry`` unsure: it
        is re-read from the store at once if the store answers, else before its next use
        (:meth:`_sync`), so that the next attempt starts from what is stored (module notes)."""
        new = dataclasses.replace(entry.stored(), **changes)  # type: ignore[arg-type]
        expected = entry.epoch
        try:
            await self.leader.write(lambda token: self.leader.store.save_session(token, new, expected_epoch=expected))
        except (StoreUnavailable, StaleEpoch):
            entry.unsure = True
            await self._reread(entry)
            raise
        for name, value in changes.items():
            if name == "refused":
                value = set(value)  # type: ignore[call-overload]
            elif name == "directives":
                value = list(value)  # type: ignore[call-overload]
            setattr(entry, name, value)

    async def _forget(self, entry: SessionEntry) -> None:
        session, epoch = entry.open.session, entry.epoch
        try:
            await self.leader.write(lambda token: self.leader.store.delete_session(token, session, epoch))
        except NotFound:
            pass  # deleted already: an earlier delete was applied but not acknowledged
        except StoreUnavailable:
            entry.unsure = True
            raise
        self._drop(entry)

    def _drop(self, entry: SessionEntry) -> None:
        if self._sessions.get(entry.open.session) is entry:
            del self._sessions[entry.open.session]

    async def _reread(self, entry: SessionEntry) -> None:
        """Best effort: re-read an unsure entry now (a store that does not answer: later)."""
        try:
            await self._sync(entry)
        except StoreUnavailable as exc:
            log.warning("session %s: re-reading it from the store failed: %s", entry.open.session, exc)

    async def _sync(self, entry: SessionEntry) -> None:
        """Re-read an unsure ``entry`` from the store (``StoreUnavailable`` if it does not
        answer); a session the store no longer holds is forgotten here too."""
        if not entry.unsure:
            return
        stored = await self.leader.store.get_session(entry.open.session)
        if stored is None:
            entry.unsure = False
            self._drop(entry)
            return
        entry.adopt(*stored)

    @contextlib.asynccontextmanager
    async def _held(self, entry: SessionEntry) -> AsyncIterator[None]:
        """``entry.lock``, with ``entry`` re-read first if it is unsure."""
        async with entry.lock:
            await self._sync(entry)
            yield

    # -- queries ---------------------------------------------------------------------------------

    def entry(self, session: uuid.UUID) -> SessionEntry:
        entry = self._sessions.get(session)
        if entry is None:
            raise NotFound(f"the PC has no session {session}")
        return entry

    async def _current(self, session: uuid.UUID) -> SessionEntry:
        """:meth:`entry`, re-read from the store first if it is unsure (``_commit``)."""
        entry = self.entry(session)
        if entry.unsure:
            async with self._held(entry):
                pass
            entry = self.entry(session)  # NotFound if the store no longer holds it
        return entry

    def view(self, principal: Principal, session: uuid.UUID) -> SessionView:
        entry = self.entry(session)
        require_scope(principal, entry.open.scope_id)
        return entry.view()

    def sessions_of(self, instance: str) -> list[SessionEntry]:
        return [e for e in self._sessions.values() if e.instance == instance]

    def tracking(self) -> bool:
        return bool(self._sessions)

    def entries(self) -> list[SessionEntry]:
        """Every session tracked (metrics, ``pc/metrics.py``)."""
        return list(self._sessions.values())

    def pending(self) -> list[SessionEntry]:
        return [e for e in self._sessions.values() if e.instance is None and e.failed is None]

    # -- start (ours) ------------------------------------------------------------------------------

    async def open(self, principal: Principal, body: SessionOpen) -> SessionView:
        """Place a new session (§6.4) and start it at epoch 1 from its initial checkpoint.
        ``NotActive`` (409) when no instance took it; the same session again answers its view."""
        require_scope(principal, body.scope_id)
        existing = self._sessions.get(body.session)
        if existing is not None:
            if existing.open != body:
                raise RecordError("session", "names another session already")
            return existing.view()
        if len(self._sessions) >= self.max_sessions:
            raise NotActive(f"the PC tracks {self.max_sessions} sessions, its maximum")
        entry = SessionEntry(open=body, epoch=0, checkpoint=body.initial_checkpoint())
        self._sessions[body.session] = entry
        async with entry.lock:
            try:
                stored = entry.stored()
                created = await self.leader.write(
                    lambda token: self.leader.store.create_session(token, stored, entry.checkpoint))
                if not created:  # this open again, after a create applied but not acknowledged?
                    held = await self.leader.store.get_session(body.session)
                    if held is None or held[0].open != body:
                        raise RecordError("session", "names a session the store holds already")
                    entry.adopt(*held)
            except BaseException:
                self._drop(entry)
                raise
            if entry.instance is not None or entry.failed is not None:
                return entry.view()  # the earlier open got that far
            placed = await self._place(entry, exclude=entry.refused, resume=False)
            if not placed:
                await self._forget(entry)
                raise NotActive("no instance took the session")
        return entry.view()

    # -- checkpoints (§6.8) ----------------------------------------------------------------------

    async def checkpoint(self, principal: Principal, session: uuid.UUID, cp: SessionCheckpoint) -> CheckpointAck:
        """Keep ``cp`` if it covers more than the kept checkpoint (§6.8); see the module notes.
        Acknowledged once stored."""
        if cp.session != session:
            raise RecordError("session", f"must be the session of the path ({session})")
        entry = await self._current(session)
        require_scope(principal, entry.open.scope_id)
        if entry.instance is not None:
            require_instance(principal, entry.instance)
        if cp.epoch < entry.epoch:
            raise StaleEpoch(f"checkpoint epoch {cp.epoch} is lower than the session's epoch {entry.epoch}")
        if cp.epoch > entry.epoch:
            raise RecordError("epoch", f"the PC assigned epoch {entry.epoch} to this session, not {cp.epoch}")
        kept = entry.checkpoint
        for name in ("compat_id", "scope_id", "prompt_blocks", "prompt_tail"):
            if getattr(cp, name) != getattr(kept, name):
                raise RecordError(name, "differs from the session's")
        if cp.output_offset >= kept.output_offset:
            if cp.generated[: kept.output_offset] != kept.generated:
                raise RecordError("generated", f"does not extend the {kept.output_offset} tokens already checkpointed")
            # the store keeps the highest output_offset of the epoch, atomically (store/base.py)
            offset = await self.leader.write(lambda token: self.leader.store.put_checkpoint(token, cp))
            if offset == cp.output_offset and cp.output_offset >= entry.checkpoint.output_offset:
                entry.checkpoint = cp
        elif kept.generated[: cp.output_offset] != cp.generated:
            raise RecordError("generated", "differs from the tokens already checkpointed")
        return CheckpointAck(session=session, epoch=entry.epoch, output_offset=entry.checkpoint.output_offset)

    async def done(self, principal: Principal, session: uuid.UUID, body: SessionDone) -> None:
        """The serving instance completed the session: the PC forgets it."""
        entry = await self._current(session)
        require_scope(principal, entry.open.scope_id)
        if entry.instance is not None:
            require_instance(principal, entry.instance)
        if body.epoch != entry.epoch:
            raise StaleEpoch(f"epoch {body.epoch} is not the session's epoch {entry.epoch}")
        await self._forget(entry)

    async def failed(self, principal: Principal, session: uuid.UUID, body: SessionFailed) -> SessionView:
        """``POST sessions/{id}/failed``: the serving instance cannot serve the session (module
        notes). ``StaleEpoch`` for an epoch other than the session's (the session moved on
        already; a higher one was never assigned: 400). Answers the session's view after
        re-placing it."""
        entry = await self._current(session)
        require_scope(principal, entry.open.scope_id)
        if entry.instance is not None:
            require_instance(principal, entry.instance)
        if body.epoch > entry.epoch:
            raise RecordError("epoch", f"the PC assigned epoch {entry.epoch} to this session, not {body.epoch}")
        if body.epoch < entry.epoch:
            raise StaleEpoch(f"epoch {body.epoch} is lower than the session's epoch {entry.epoch}")
        async with self._held(entry):
            if entry.epoch != body.epoch or entry.instance is None:
                return entry.view()  # moved meanwhile
            refusing = entry.instance
            log.warning("session %s: %s cannot serve epoch %d: %s", session, refusing, body.epoch, body.reason)
            # the refusing run's messages are stale from now on (§6.8)
            await self._commit(entry, refused=frozenset(entry.refused | {refusing}), epoch=entry.epoch + 1,
                               fresh=True, instance=None, instance_epoch=None)
            if await self._place(entry, exclude=entry.refused, resume=entry.resumed):
                return entry.view()
            others = [i for i in self.registry.instances() if i not in entry.refused and self.registry.state(i) != FAILED]
            if others:
                return entry.view()
            await self._commit(entry, failed=f"every instance refused it; the last, {refusing}: {body.reason}"[:MAX_REASON_CHARS])
            log.warning("session %s failed: %s", session, entry.failed)
            view = entry.view()
        await self._tell_front_end(entry)  # outside the lock: the front end may be slow
        return view

    async def _tell_front_end(self, entry: SessionEntry) -> None:
        """A failed session's front end ends its client's stream (module notes). A notice that
        does not get through is logged; the failure stays visible in ``GET sessions/{id}``."""
        if self.front_ends is None or entry.failed is None:
            return
        notice = SessionFailed(epoch=entry.epoch, reason=entry.failed)
        try:
            await self.front_ends.session_failed(entry.open.front_end, entry.open.session, notice)
        except FrontEndUnreachable as exc:
            log.warning("session %s: telling its front end %s of the failure failed: %s",
                        entry.open.session, entry.open.front_end, exc)

    # -- failures and migration (§6.8) -------------------------------------------------------------

    async def report_failure(self, principal: Principal, report: FailureReport) -> SessionList:
        """``POST failures``: the instance failed. ``StaleEpoch`` when the report names an older
        incarnation than the PC knows. Answers the sessions it moved."""
        require_instance(principal, report.instance)
        highest = self.registry.highest_epoch(report.instance)
        if report.epoch is not None and highest is not None and report.epoch < highest:
            raise StaleEpoch(f"epoch {report.epoch} of {report.instance} is older than {highest}")
        await self.registry.fail(report.instance)
        return SessionList(sessions=tuple(await self.instance_failed(report.instance)))

    async def instance_failed(self, instance: str, *, before_epoch: int | None = None) -> list[SessionView]:
        """Migrate every session of ``instance`` (with ``before_epoch``: only those it took
        in an earlier incarnation)."""
        moved = []
        for entry in self.sessions_of(instance):
            if before_epoch is not None and entry.instance_epoch is not None and entry.instance_epoch >= before_epoch:
                continue
            moved.append(await self.migrate(entry, failed=instance))
        return moved

    async def migrate(self, entry: SessionEntry, *, failed: str) -> SessionView:
        """Raise the epoch of a session whose instance failed, then resume it elsewhere."""
        async with self._held(entry):
            if entry.instance != failed or self._sessions.get(entry.open.session) is not entry:
                return entry.view()  # moved or finished meanwhile
            # from now on the failed instance's messages are stale (§6.8); stored first
            await self._commit(entry, epoch=entry.epoch + 1, fresh=True, instance=None, instance_epoch=None)
            exclude = entry.refused | ({failed} if self.registry.state(failed) == FAILED else set())
            await self._place(entry, exclude=exclude, resume=True)
            return entry.view()

    async def retry_pending(self) -> list[SessionView]:
        """Try again to place the sessions no instance took (re-reading unsure ones first)."""
        out = []
        # and the unsure ones: the store may hold them pending (``_commit``)
        for entry in [e for e in self._sessions.values() if e.unsure or (e.instance is None and e.failed is None)]:
            async with self._held(entry):
                if entry.instance is None and entry.failed is None and self._sessions.get(entry.open.session) is entry:
                    await self._place(entry, exclude=entry.refused, resume=True)
                    out.append(entry.view())
        return out

    async def check_failures(self) -> list[SessionView]:
        """Migrate the sessions of instances whose status expired (§6.3 failed), then retry
        the pending ones. The PC runs this periodically."""
        moved = []
        for instance in sorted({e.instance for e in self._sessions.values() if e.instance is not None}):
            if self.registry.state(instance) == FAILED:
                moved += await self.instance_failed(instance)
        return moved + await self.retry_pending()

    # -- placement -----------------------------------------------------------------------------------

    def _request(self, entry: SessionEntry) -> PlacementRequest:
        body = entry.open
        return PlacementRequest(
            scope_id=body.scope_id, compat_id=body.compat_id, block_keys=body.prompt_blocks,
            tokens=body.tokens + entry.checkpoint.output_offset, request_ref=str(body.session), prefetch=True,
        )

    async def _place(self, entry: SessionEntry, *, exclude: Collection[str], resume: bool) -> bool:
        """Send the session to the best instance that takes it, a new epoch per attempt.
        Called with ``entry.lock`` held."""
        if self.client is None:
            return False
        request = self._request(entry)
        for instance in await self.rank(request, exclude):
            # a new epoch per attempt, stored before the order that carries it (module notes)
            await self._commit(entry, epoch=entry.epoch if entry.fresh else entry.epoch + 1, fresh=False)
            order = SessionOrder(epoch=entry.epoch, checkpoint=entry.checkpoint, front_end=entry.open.front_end,
                                 max_tokens=entry.open.max_tokens)
            await self._prefetch(entry, request, instance)
            try:
                if resume:
                    await self.client.resume_session(instance, order)
                else:
                    await self.client.start_session(instance, order)
            except InstanceUnreachable as exc:
                log.warning("session %s: %s did not take epoch %d: %s", entry.open.session, instance, entry.epoch, exc)
                continue
            await self._commit(entry, instance=instance, instance_epoch=self.registry.highest_epoch(instance),
                               resumed=resume, directives=tuple(entry.directives))
            return True
        log.warning("session %s: no instance took it; pending", entry.open.session)
        return False

    async def _prefetch(self, entry: SessionEntry, request: PlacementRequest, instance: str) -> None:
        """§6.5 before the order: the blocks not resident at ``instance`` (module notes). A
        directive that could not be sent is no failure: the instance loads what it lacks."""
        if self.prefetch is None or not request.block_keys:
            return
        try:
            directive = await self.prefetch(request, instance)
        except Exception as exc:  # advisory: the IS or the instance may be unreachable
            log.warning("session %s: prefetch directive to %s failed: %s", entry.open.session, instance, exc)
            return
        if directive is not None:
            entry.directives.append(directive)
            for observe in self.directive_observers:
                observe(entry.open.session, instance, directive)
