"""Where the front end keeps each session's delivery state (kvsp-draft §6.8; DESIGN.md §8).

Per session a :class:`DeliveryStore` holds the registration (scope, ``max_tokens``), the
highest epoch seen, the output delivered so far (every token of indices ``0..next-1``, so a
client that reconnects re-reads its stream from any index), the tokens buffered beyond a gap,
the end once known, and the failure notice of a session the PC gave up. Two implementations:

- :class:`MemoryDeliveryStore` (here): the embedded default (``store = "memory"``), state
  lives and dies with the process;
- ``delivery_redis.RedisDeliveryStore``: Redis (or Valkey), so a restarted front end, or
  several front-end processes behind one Redis, deliver every index exactly once.

Both apply the same rules, the ones of :class:`~.service.FrontEnd`'s module notes, in one
atomic step per batch (:meth:`DeliveryStore.accept`): the epoch check, "not delivered or
buffered yet", the append and the move of the contiguous run into the output. The Redis one
does it in one Lua script, so two processes cannot both take an index. The answer is an
:class:`Outcome`, which the front end turns into its reply or its problem.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..common.errors import NotActive
from ..common.session_records import OutputTokens, SessionFailed

__all__ = ["DeliveryStore", "MemoryDeliveryStore", "Outcome", "Registration", "Snapshot"]

# Outcome codes (the Lua scripts of delivery_redis return the same strings).
OK = "ok"
MISSING = "missing"  # no such session (never registered, forgotten, or expired)
FAILED = "failed"  # the PC gave the session up: its output is closed
STALE = "stale"  # §6.8: an epoch lower than one already seen
INDEX = "index"  # a token at or beyond the limit (``at`` in the batch, ``index``, ``kind``)
END_MAX = "end_max"  # ``end`` beyond max_tokens
END_LOW = "end_low"  # ``end`` below what was delivered
COMPLETE = "complete"  # fail(): the output is complete, the notice changes nothing
ALREADY = "already"  # fail(): already failed, a repeated notice changes nothing


@dataclass(frozen=True)
class Registration:
    """What a session was registered with (it never changes)."""

    scope_id: bytes
    max_tokens: int


@dataclass(frozen=True)
class Outcome:
    """The answer of :meth:`DeliveryStore.accept` or :meth:`DeliveryStore.fail`. ``next`` is the
    first index not delivered, ``epoch`` the highest epoch seen (after the call); for
    :data:`INDEX`, ``at`` is the token's position in the batch, ``index`` its index and ``kind``
    the limit it hit ("max_tokens", "end" or "ahead"); for :data:`FAILED`, ``failed`` the reason."""

    code: str
    accepted: int = 0
    duplicates: int = 0
    next: int = 0
    epoch: int = 0
    at: int = 0
    index: int = 0
    kind: str = ""
    failed: str = ""


@dataclass(frozen=True)
class Snapshot:
    """A read of one session: ``tokens`` are the delivered tokens from index ``start`` (at most
    the number asked for), ``next`` the first index not delivered."""

    start: int
    tokens: tuple[int, ...]
    next: int
    epoch: int
    end: int | None
    failed: str | None


#: Told the session whose state another process changed (a live stream re-reads it).
ChangeListener = Callable[[uuid.UUID], None]


class DeliveryStore(Protocol):
    """The front end's per-session delivery state (see the module notes). Every call of the
    Redis store is bounded and raises ``StoreUnavailable`` when Redis cannot be reached."""

    #: A reader waiting for changes re-reads the store at least this often (seconds; None: the
    #: store reports every change through :meth:`watch`'s listener or the process's own calls).
    poll_s: float | None

    def register(self, session: uuid.UUID, registration: Registration, *, max_sessions: int) -> Awaitable[None]:
        """Expect the output of ``session``; nothing when it is registered already.
        ``NotActive`` when ``max_sessions`` sessions are registered."""
        ...

    def registration(self, session: uuid.UUID) -> Awaitable[Registration | None]: ...

    def forget(self, session: uuid.UUID) -> Awaitable[None]: ...

    def accept(self, session: uuid.UUID, batch: OutputTokens, *, max_ahead: int) -> Awaitable[Outcome]:
        """Take ``batch`` atomically: :data:`OK`, or a refusal that changed nothing."""
        ...

    def fail(self, session: uuid.UUID, notice: SessionFailed) -> Awaitable[Outcome]:
        """Mark the session given up: :data:`OK`, :data:`COMPLETE`, :data:`ALREADY`,
        :data:`STALE` (a lower epoch) or :data:`MISSING`."""
        ...

    def read(self, session: uuid.UUID, start: int, limit: int) -> Awaitable[Snapshot | None]:
        """Up to ``limit`` delivered tokens from ``start``; None when the session is unknown."""
        ...

    def watch(self, listener: ChangeListener) -> None:
        """Call ``listener`` for sessions other processes change (nothing for a store only
        this process uses)."""
        ...

    def close(self) -> Awaitable[None]: ...


@dataclass
class _State:
    registration: Registration
    epoch: int = 0
    delivered: list[int] = field(default_factory=list)
    ahead: dict[int, int] = field(default_factory=dict)  # index -> token, beyond len(delivered)
    end: int | None = None
    failed: str | None = None


def limit_kind(index: int, max_tokens: int, end: int | None) -> str:
    """Which limit a refused token index hit (the message of the 400 names it)."""
    if index >= max_tokens:
        return "max_tokens"
    if end is not None and index >= end:
        return "end"
    return "ahead"


class MemoryDeliveryStore:
    """The embedded store (``store = "memory"``): one process, nothing survives it."""

    poll_s: float | None = None

    def __init__(self) -> None:
        self._states: dict[uuid.UUID, _State] = {}

    async def register(self, session: uuid.UUID, registration: Registration, *, max_sessions: int) -> None:
        if session in self._states:
            return
        if len(self._states) >= max_sessions:
            raise NotActive(f"the front end serves {max_sessions} sessions, its maximum")
        self._states[session] = _State(registration)

    async def registration(self, session: uuid.UUID) -> Registration | None:
        state = self._states.get(session)
        return state.registration if state is not None else None

    async def forget(self, session: uuid.UUID) -> None:
        self._states.pop(session, None)

    async def accept(self, session: uuid.UUID, batch: OutputTokens, *, max_ahead: int) -> Outcome:
        out = self._states.get(session)
        if out is None:
            return Outcome(MISSING)
        nxt = len(out.delivered)
        if out.failed is not None:
            return Outcome(FAILED, next=nxt, epoch=out.epoch, failed=out.failed)
        if batch.epoch < out.epoch:
            return Outcome(STALE, next=nxt, epoch=out.epoch)
        max_tokens = out.registration.max_tokens
        limit = min(max_tokens, nxt + max_ahead, out.end if out.end is not None else max_tokens)
        for i, t in enumerate(batch.tokens):
            if t.index >= limit:
                return Outcome(INDEX, next=nxt, epoch=out.epoch, at=i, index=t.index,
                               kind=limit_kind(t.index, max_tokens, out.end))
        if batch.end is not None:
            if batch.end > max_tokens:
                return Outcome(END_MAX, next=nxt, epoch=out.epoch)
            if batch.end < nxt:
                return Outcome(END_LOW, next=nxt, epoch=out.epoch)
        if batch.epoch > out.epoch:
            out.epoch = batch.epoch
            out.ahead.clear()  # lower epochs' undelivered tokens: the new epoch re-sends them
        accepted = duplicates = 0
        for t in batch.tokens:
            if t.index < nxt or t.index in out.ahead:
                duplicates += 1
                continue
            out.ahead[t.index] = t.token
            accepted += 1
        if batch.end is not None:
            out.end = batch.end
            out.ahead = {i: tok for i, tok in out.ahead.items() if i < batch.end}
        while len(out.delivered) in out.ahead:
            out.delivered.append(out.ahead.pop(len(out.delivered)))
        return Outcome(OK, accepted=accepted, duplicates=duplicates, next=len(out.delivered), epoch=out.epoch)

    async def fail(self, session: uuid.UUID, notice: SessionFailed) -> Outcome:
        out = self._states.get(session)
        if out is None:
            return Outcome(MISSING)
        nxt = len(out.delivered)
        if out.end is not None and nxt >= out.end:
            return Outcome(COMPLETE, next=nxt, epoch=out.epoch)
        if out.failed is not None:
            return Outcome(ALREADY, next=nxt, epoch=out.epoch, failed=out.failed)
        if notice.epoch < out.epoch:
            return Outcome(STALE, next=nxt, epoch=out.epoch)
        out.epoch = notice.epoch
        out.failed = notice.reason
        out.ahead.clear()  # tokens beyond a gap that will never be filled
        return Outcome(OK, next=nxt, epoch=out.epoch, failed=notice.reason)

    async def read(self, session: uuid.UUID, start: int, limit: int) -> Snapshot | None:
        return self.peek(session, start, limit)

    def peek(self, session: uuid.UUID, start: int = 0, limit: int | None = None) -> Snapshot | None:
        """:meth:`read` without awaiting (tests and embedding read the state synchronously)."""
        out = self._states.get(session)
        if out is None:
            return None
        limit = len(out.delivered) if limit is None else limit
        return Snapshot(start=start, tokens=tuple(out.delivered[start : start + limit]), next=len(out.delivered),
                        epoch=out.epoch, end=out.end, failed=out.failed)

    def watch(self, listener: ChangeListener) -> None:
        return None  # only this process changes it, and the front end notifies its own readers

    async def close(self) -> None:
        return None
