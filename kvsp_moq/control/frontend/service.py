"""The front end (kvsp-draft §6.8): delivers each output index exactly once, discards lower epochs.

Instances deliver output tokens with ``POST {fe}sessions/{id}/tokens`` (an
:class:`~.common.session_records.OutputTokens` batch: the session, its epoch, tokens with their index,
and ``end`` once the output is complete). Per session the front end keeps the highest epoch
seen and the output delivered so far, in index order:

- a batch whose epoch is lower than the highest seen is refused with ``kvsp-stale-epoch``
  (409), none of its tokens used (§6.8 "front ends MUST discard tokens that carry a lower epoch
  than one they have already seen for the session");
- a higher epoch also drops the tokens of lower epochs that arrived out of order and are not
  delivered yet: the new instance sends them again (it re-sends what its checkpoint covers),
  so every index still undelivered comes from one epoch;
- a token whose index was delivered, or is already buffered, is a duplicate and dropped
  (§6.8 "the front end discards the duplicates by index"); tokens arriving out of order wait
  until the gap before them is filled, so the client sees every index once, in order.

Clients start a session with ``POST {fe}sessions`` (the front end names it and asks the PC to
place and start it, §6.4) and read it with ``GET {fe}sessions/{id}/tokens`` (NDJSON), i.e.
:meth:`FrontEnd.stream`.

A session the PC gave up (every instance refused it, §6.8 has no instance left to resume it
on) is reported here with ``POST {fe}sessions/{id}/failed`` (:meth:`FrontEnd.fail`, ours): the
tokens already delivered stay delivered, every later delivery is refused with
``kvsp-stale-epoch`` (no instance may add to a failed session's output), and each client
stream ends after the delivered tokens with :class:`StreamFailed` instead of
:class:`StreamEnd` (docs/http-api.md "Front end").

A write the store did not acknowledge (503 ``kvsp-unavailable``: fewer replicas than
``store_wait_replicas`` confirmed it) may be applied all the same (docs/deploy.md "A 503 that
was applied"). A delivery or a failure notice can be repeated (indexes already taken are
duplicates; the same notice changes nothing). A registration cannot (the client's retry opens a
new session): so :meth:`FrontEnd.open` withdraws a registration that was not acknowledged, as
far as the store answers, rather than leave it counted against ``max_sessions`` for ``retain_s``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ...kvsp.errors import RecordError
from ..common.auth import Principal, require_scope
from ..common.config import FrontEndConfig
from ..common.errors import NotActive, NotFound, SessionOpenFailed, StaleEpoch, StoreUnavailable
from ..common.session_records import (
    ClientSession,
    ClientSessionRequest,
    DeliveryAnswer,
    OutputToken,
    OutputTokens,
    SessionFailed,
    MAX_OUTPUT_TOKENS,
    SessionOpen,
    SessionView,
    StreamEnd,
    StreamFailed,
)
from .metrics import FrontEndMetrics
from .delivery import (
    END_LOW,
    END_MAX,
    FAILED,
    INDEX,
    MISSING,
    OK,
    STALE,
    DeliveryStore,
    MemoryDeliveryStore,
    Registration,
    Snapshot,
)

__all__ = ["DeliveryObserver", "DeliveryTally", "FrontEnd", "SessionOpener"]

log = logging.getLogger(__name__)


class SessionOpener(Protocol):
    """The PC, as the front end asks it to start sessions (``client.http.HttpPcClient.open_session``)."""

    async def open_session(self, body: SessionOpen) -> SessionView:
        """``POST {pc}sessions``; :class:`SessionOpenFailed` on any refusal."""
        ...


@dataclass
class DeliveryTally:
    """What instances delivered for one session: new indices taken per epoch, duplicates
    dropped (§6.8 "discards the duplicates by index") and batches refused for a lower epoch."""

    accepted: dict[int, int] = field(default_factory=dict)  # epoch -> indices taken
    duplicates: int = 0
    stale_batches: int = 0


#: Called after every delivery the front end handled: the session, the batch, and the answer
#: (``None`` when the batch was refused for its lower epoch). Embedding and tests observe the
#: output with it (e.g. that a non-deterministic sampler's tokens come after their checkpoint).
DeliveryObserver = Callable[[uuid.UUID, OutputTokens, "DeliveryAnswer | None"], None]


#: Tokens one store read gives a stream (a long output is streamed in reads of this size).
READ_CHUNK = 1024
#: Registrations (immutable) kept in process, so a delivery costs one store call.
REGISTRATION_CACHE = 4096


class FrontEnd:
    """Output delivery of sessions (see the module notes). The per-session state lives in
    ``store`` (:mod:`.delivery`; memory by default); ``tally`` and the observers count what
    this process handled."""

    def __init__(self, *, config: FrontEndConfig | None = None, pc: SessionOpener | None = None,
                 url: Callable[[], str] | None = None, store: DeliveryStore | None = None) -> None:
        self.config = config if config is not None else FrontEndConfig()
        self.pc = pc
        self._url = url
        self.store: DeliveryStore = store if store is not None else MemoryDeliveryStore()
        self._registrations: dict[uuid.UUID, Registration] = {}
        self._changed: dict[uuid.UUID, asyncio.Event] = {}  # a reader waits on its session's event
        self._tallies: dict[uuid.UUID, DeliveryTally] = {}
        self._watching = False
        self.closed = False
        self.observers: list[DeliveryObserver] = []
        #: ``GET {fe}metrics`` (``frontend/metrics.py``, docs/metrics.md): counts every delivery.
        self.metrics = FrontEndMetrics()
        self.observers.append(self.metrics.observe)
        self.metrics.watch(tracked=lambda: len(self._tallies))

    def close(self) -> None:
        """End every open stream (shutdown): readers see the stream stop without its end."""
        self.closed = True
        for session in list(self._changed):
            self._notify(session)

    async def aclose(self) -> None:
        """:meth:`close`, then close the store."""
        self.close()
        await self.store.close()

    @property
    def url(self) -> str:
        if self._url is not None:
            return self._url()
        if self.config.url is None:
            raise RuntimeError("the front end's URL is not known")
        return self.config.url

    def _notify(self, session: uuid.UUID) -> None:
        """Wake the readers of ``session`` in this process (they re-read the store)."""
        event = self._changed.pop(session, None)
        if event is not None:
            event.set()

    # -- sessions ----------------------------------------------------------------------------------

    async def register(self, session: uuid.UUID, scope_id: bytes, max_tokens: int) -> None:
        """Expect the output of ``session`` (what :meth:`open` does before asking the PC)."""
        registration = Registration(scope_id=scope_id, max_tokens=max_tokens)
        await self.store.register(session, registration, max_sessions=self.config.max_sessions)
        self._remember(session, registration)
        self._tally(session)

    async def forget(self, session: uuid.UUID) -> None:
        self._registrations.pop(session, None)
        self._tallies.pop(session, None)
        await self.store.forget(session)
        self._notify(session)

    async def open(self, principal: Principal, request: ClientSessionRequest) -> ClientSession:
        """A client starts a session: a new UUID, then ``POST {pc}sessions`` (§6.4 placement).
        ``NotActive`` (409) when the PC could not start it."""
        require_scope(principal, request.scope_id)
        if self.pc is None:
            raise NotActive("this front end has no PC to start sessions")
        session = uuid.uuid4()
        try:
            await self.register(session, request.scope_id, request.max_tokens)
        except StoreUnavailable:
            await self._withdraw(session)  # it may be stored all the same (module notes)
            raise
        body = SessionOpen(
            session=session, compat_id=request.compat_id, scope_id=request.scope_id, prompt_blocks=request.prompt_blocks,
            prompt_tail=request.prompt_tail, tokens=request.tokens, sampler=request.sampler, max_tokens=request.max_tokens,
            front_end=self.url,
        )
        try:
            view = await self.pc.open_session(body)
        except SessionOpenFailed as exc:
            await self.forget(session)
            self.metrics.sessions_opened.labels("refused").inc()
            raise NotActive(f"the PC did not start the session: {exc}") from None
        self.metrics.sessions_opened.labels("started").inc()
        return ClientSession(session=session, instance=view.instance, epoch=view.epoch,
                             tokens_url=f"{self.url}sessions/{session}/tokens")

    async def _withdraw(self, session: uuid.UUID) -> None:
        """Forget a registration that was not acknowledged, if the store answers."""
        try:
            await self.forget(session)
        except StoreUnavailable as exc:
            log.warning("session %s: withdrawing its registration failed: %s", session, exc)

    def _remember(self, session: uuid.UUID, registration: Registration) -> None:
        if len(self._registrations) >= REGISTRATION_CACHE:
            del self._registrations[next(iter(self._registrations))]
        self._registrations[session] = registration

    def _tally(self, session: uuid.UUID) -> DeliveryTally:
        tally = self._tallies.get(session)
        if tally is None:
            if len(self._tallies) >= self.config.max_sessions:
                del self._tallies[next(iter(self._tallies))]
            tally = self._tallies[session] = DeliveryTally()
        return tally

    async def _registration(self, principal: Principal, session: uuid.UUID) -> Registration:
        registration = self._registrations.get(session)
        if registration is None:
            registration = await self.store.registration(session)
            if registration is None:
                raise NotFound(f"the front end has no session {session}")
            self._remember(session, registration)
        require_scope(principal, registration.scope_id)
        return registration

    def _missing(self, session: uuid.UUID) -> NotFound:
        self._registrations.pop(session, None)  # forgotten (or expired) since it was cached
        return NotFound(f"the front end has no session {session}")

    # -- delivery (§6.8) ---------------------------------------------------------------------------

    async def deliver(self, principal: Principal, session: uuid.UUID, batch: OutputTokens) -> DeliveryAnswer:
        """Take a batch of output tokens (see the module notes), in one atomic store step. The
        batch is checked whole before any token is used: one bad token refuses all (400)."""
        if batch.session != session:
            raise RecordError("session", f"must be the session of the path ({session})")
        registration = await self._registration(principal, session)
        out = await self.store.accept(session, batch, max_ahead=self.config.max_ahead)
        tally = self._tally(session)
        if out.code in (FAILED, STALE):
            tally.stale_batches += 1
            for observe in self.observers:
                observe(session, batch, None)
            if out.code == FAILED:
                raise StaleEpoch(f"the session failed, its output is closed: {out.failed}")
            raise StaleEpoch(f"epoch {batch.epoch} is lower than epoch {out.epoch}, already seen for the session")
        if out.code == MISSING:
            raise self._missing(session)
        if out.code == INDEX:
            why = {"max_tokens": "max_tokens", "end": "the output's end"}.get(
                out.kind, f"{self.config.max_ahead} beyond the next index ({out.next})")
            raise RecordError(f"tokens[{out.at}].index", f"{out.index} is at or beyond {why}")
        if out.code == END_MAX:
            raise RecordError("end", f"is beyond max_tokens ({registration.max_tokens})")
        if out.code == END_LOW:
            raise RecordError("end", f"is below the {out.next} tokens already delivered")
        self._notify(session)
        tally.accepted[batch.epoch] = tally.accepted.get(batch.epoch, 0) + out.accepted
        tally.duplicates += out.duplicates
        answer = DeliveryAnswer(accepted=out.accepted, duplicates=out.duplicates, next=out.next)
        for observe in self.observers:
            observe(session, batch, answer)
        return answer

    async def fail(self, principal: Principal, session: uuid.UUID, notice: SessionFailed) -> None:
        """``POST {fe}sessions/{id}/failed`` (ours): the PC gave the session up (see the module
        notes). ``StaleEpoch`` when ``notice.epoch`` is lower than an epoch already seen here
        (the notice is about a session state this front end has moved past). A session whose
        output is complete is left as it is; a repeated notice changes nothing."""
        await self._registration(principal, session)
        out = await self.store.fail(session, notice)
        if out.code == MISSING:
            raise self._missing(session)
        if out.code == STALE:
            raise StaleEpoch(f"epoch {notice.epoch} is lower than epoch {out.epoch}, already seen for the session")
        if out.code == OK:
            self._notify(session)

    # -- the client's stream -------------------------------------------------------------------------

    async def stream(self, principal: Principal, session: uuid.UUID,
                     start: int = 0) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        """The session's output from index ``start``, in order, each index once, then
        :class:`StreamEnd` when the output is complete, or :class:`StreamFailed` when the PC
        gave the session up; waits for tokens as they are delivered.
        ``NotFound``/``Forbidden`` (and ``StoreUnavailable``) are raised here, before anything
        is streamed; a store lost later ends the iteration with ``StoreUnavailable``."""
        await self._registration(principal, session)
        if not self._watching:
            self._watching = True
            self.store.watch(self._notify)  # deliveries through other front-end processes
        changed = self._changed.setdefault(session, asyncio.Event())
        first = await self.store.read(session, start, READ_CHUNK)  # a lost store is a 503, not a cut stream
        if first is None:
            raise self._missing(session)
        return self._iterate(session, start, changed, first)

    async def _iterate(self, session: uuid.UUID, index: int, changed: asyncio.Event,
                       snap: Snapshot | None) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        while True:
            if snap is None:
                return  # forgotten
            for token in snap.tokens:
                yield OutputToken(index=index, token=token)
                index += 1
            if index < snap.next:  # more than one read's worth
                snap = await self.store.read(session, index, READ_CHUNK)
                continue
            if snap.end is not None and index >= snap.end:
                yield StreamEnd(end=snap.end)
                return
            if snap.failed is not None:
                yield StreamFailed(reason=snap.failed, next=snap.next)
                return
            if self.closed:
                return
            try:
                await asyncio.wait_for(changed.wait(), timeout=self.store.poll_s)
            except TimeoutError:
                pass  # re-read: a change another process made may have gone unannounced
            # take the event before reading, so a change after the read is not missed
            changed = self._changed.setdefault(session, asyncio.Event())
            snap = await self.store.read(session, index, READ_CHUNK)

    async def snapshot(self, session: uuid.UUID) -> Snapshot | None:
        """The whole delivery state of ``session`` (any store)."""
        return await self.store.read(session, 0, MAX_OUTPUT_TOKENS)

    def _peek(self, session: uuid.UUID) -> Snapshot | None:
        if not isinstance(self.store, MemoryDeliveryStore):
            raise RuntimeError("only the memory store is read synchronously: use `await snapshot()`")
        return self.store.peek(session)

    def delivered(self, session: uuid.UUID) -> list[int]:
        """The tokens delivered so far (tests, embedding; memory store)."""
        snap = self._peek(session)
        return list(snap.tokens) if snap else []

    def tally(self, session: uuid.UUID) -> DeliveryTally | None:
        """What this process handled for ``session``, counted (tests, embedding)."""
        return self._tallies.get(session)

    def epoch(self, session: uuid.UUID) -> int | None:
        """The highest epoch seen for ``session`` (tests, embedding; memory store)."""
        snap = self._peek(session)
        return snap.epoch if snap else None

    def failure(self, session: uuid.UUID) -> str | None:
        """Why the PC gave ``session`` up, once it told this front end (tests, embedding;
        memory store)."""
        snap = self._peek(session)
        return snap.failed if snap else None
