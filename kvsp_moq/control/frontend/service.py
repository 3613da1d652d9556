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
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from ...kvsp.errors import RecordError
from ..common.auth import Principal, require_scope
from ..common.config import FrontEndConfig
from ..common.errors import NotActive, NotFound, SessionOpenFailed, StaleEpoch
from ..common.session_records import (
    ClientSession,
    ClientSessionRequest,
    DeliveryAnswer,
    OutputToken,
    OutputTokens,
    SessionFailed,
    SessionOpen,
    SessionView,
    StreamEnd,
    StreamFailed,
)

__all__ = ["DeliveryObserver", "DeliveryTally", "FrontEnd", "SessionOpener"]


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


@dataclass
class _Output:
    scope_id: bytes
    max_tokens: int
    epoch: int = 0  # the highest epoch seen
    delivered: list[int] = field(default_factory=list)  # tokens of indices 0..next-1, in order
    pending: dict[int, int] = field(default_factory=dict)  # index -> token, beyond next
    end: int | None = None
    failed: str | None = None  # why the PC gave the session up (no more output will come)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tally: DeliveryTally = field(default_factory=lambda: DeliveryTally())

    def notify(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()


class FrontEnd:
    """Output delivery of sessions (see the module notes)."""

    def __init__(self, *, config: FrontEndConfig | None = None, pc: SessionOpener | None = None,
                 url: Callable[[], str] | None = None) -> None:
        self.config = config if config is not None else FrontEndConfig()
        self.pc = pc
        self._url = url
        self._outputs: dict[uuid.UUID, _Output] = {}
        self.closed = False
        self.observers: list[DeliveryObserver] = []

    def close(self) -> None:
        """End every open stream (shutdown): readers see the stream stop without its end."""
        self.closed = True
        for output in self._outputs.values():
            output.notify()

    @property
    def url(self) -> str:
        if self._url is not None:
            return self._url()
        if self.config.url is None:
            raise RuntimeError("the front end's URL is not known")
        return self.config.url

    # -- sessions ----------------------------------------------------------------------------------

    def register(self, session: uuid.UUID, scope_id: bytes, max_tokens: int) -> None:
        """Expect the output of ``session`` (what :meth:`open` does before asking the PC)."""
        if session in self._outputs:
            return
        if len(self._outputs) >= self.config.max_sessions:
            raise NotActive(f"the front end serves {self.config.max_sessions} sessions, its maximum")
        self._outputs[session] = _Output(scope_id=scope_id, max_tokens=max_tokens)

    def forget(self, session: uuid.UUID) -> None:
        output = self._outputs.pop(session, None)
        if output is not None:
            output.notify()

    async def open(self, principal: Principal, request: ClientSessionRequest) -> ClientSession:
        """A client starts a session: a new UUID, then ``POST {pc}sessions`` (§6.4 placement).
        ``NotActive`` (409) when the PC could not start it."""
        require_scope(principal, request.scope_id)
        if self.pc is None:
            raise NotActive("this front end has no PC to start sessions")
        session = uuid.uuid4()
        self.register(session, request.scope_id, request.max_tokens)
        body = SessionOpen(
            session=session, compat_id=request.compat_id, scope_id=request.scope_id, prompt_blocks=request.prompt_blocks,
            prompt_tail=request.prompt_tail, tokens=request.tokens, sampler=request.sampler, max_tokens=request.max_tokens,
            front_end=self.url,
        )
        try:
            view = await self.pc.open_session(body)
        except SessionOpenFailed as exc:
            self.forget(session)
            raise NotActive(f"the PC did not start the session: {exc}") from None
        return ClientSession(session=session, instance=view.instance, epoch=view.epoch,
                             tokens_url=f"{self.url}sessions/{session}/tokens")

    def _output(self, principal: Principal, session: uuid.UUID) -> _Output:
        output = self._outputs.get(session)
        if output is None:
            raise NotFound(f"the front end has no session {session}")
        require_scope(principal, output.scope_id)
        return output

    # -- delivery (§6.8) ---------------------------------------------------------------------------

    def deliver(self, principal: Principal, session: uuid.UUID, batch: OutputTokens) -> DeliveryAnswer:
        """Take a batch of output tokens (see the module notes). The batch is checked whole
        before any token is used: one bad token refuses all (400)."""
        if batch.session != session:
            raise RecordError("session", f"must be the session of the path ({session})")
        out = self._output(principal, session)
        if out.failed is not None:
            out.tally.stale_batches += 1
            for observe in self.observers:
                observe(session, batch, None)
            raise StaleEpoch(f"the session failed, its output is closed: {out.failed}")
        if batch.epoch < out.epoch:
            out.tally.stale_batches += 1
            for observe in self.observers:
                observe(session, batch, None)
            raise StaleEpoch(f"epoch {batch.epoch} is lower than epoch {out.epoch}, already seen for the session")
        next_index = len(out.delivered)
        limit = min(out.max_tokens, next_index + self.config.max_ahead)
        for i, t in enumerate(batch.tokens):
            if t.index >= limit:
                why = "max_tokens" if t.index >= out.max_tokens else f"{self.config.max_ahead} beyond the next index ({next_index})"
                raise RecordError(f"tokens[{i}].index", f"{t.index} is at or beyond {why}")
        if batch.end is not None:
            if batch.end > out.max_tokens:
                raise RecordError("end", f"is beyond max_tokens ({out.max_tokens})")
            if batch.end < next_index:
                raise RecordError("end", f"is below the {next_index} tokens already delivered")
        if batch.epoch > out.epoch:
            out.epoch = batch.epoch
            out.pending.clear()
        accepted = duplicates = 0
        for t in batch.tokens:
            if t.index < len(out.delivered) or t.index in out.pending:
                duplicates += 1
                continue
            out.pending[t.index] = t.token
            accepted += 1
        if batch.end is not None:
            out.end = batch.end
            out.pending = {i: t for i, t in out.pending.items() if i < batch.end}
        while len(out.delivered) in out.pending:
            out.delivered.append(out.pending.pop(len(out.delivered)))
        out.notify()
        out.tally.accepted[batch.epoch] = out.tally.accepted.get(batch.epoch, 0) + accepted
        out.tally.duplicates += duplicates
        answer = DeliveryAnswer(accepted=accepted, duplicates=duplicates, next=len(out.delivered))
        for observe in self.observers:
            observe(session, batch, answer)
        return answer

    def fail(self, principal: Principal, session: uuid.UUID, notice: SessionFailed) -> None:
        """``POST {fe}sessions/{id}/failed`` (ours): the PC gave the session up (see the module
        notes). ``StaleEpoch`` when ``notice.epoch`` is lower than an epoch already seen here
        (the notice is about a session state this front end has moved past). A session whose
        output is complete is left as it is; a repeated notice changes nothing."""
        out = self._output(principal, session)
        if out.end is not None and len(out.delivered) >= out.end:
            return  # complete: every client stream ends normally
        if out.failed is not None:
            return
        if notice.epoch < out.epoch:
            raise StaleEpoch(f"epoch {notice.epoch} is lower than epoch {out.epoch}, already seen for the session")
        out.epoch = notice.epoch
        out.failed = notice.reason
        out.pending.clear()  # tokens beyond a gap that will never be filled
        out.notify()

    # -- the client's stream -------------------------------------------------------------------------

    def stream(self, principal: Principal, session: uuid.UUID,
               start: int = 0) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        """The session's output from index ``start``, in order, each index once, then
        :class:`StreamEnd` when the output is complete, or :class:`StreamFailed` when the PC
        gave the session up; waits for tokens as they are delivered.
        ``NotFound``/``Forbidden`` are raised here, before anything is streamed."""
        return self._iterate(session, self._output(principal, session), start)

    async def _iterate(self, session: uuid.UUID, out: _Output,
                       index: int) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        while True:
            while index < len(out.delivered):
                yield OutputToken(index=index, token=out.delivered[index])
                index += 1
            if out.end is not None and index >= out.end:
                yield StreamEnd(end=out.end)
                return
            if out.failed is not None:
                yield StreamFailed(reason=out.failed, next=len(out.delivered))
                return
            if self.closed or self._outputs.get(session) is not out:
                return  # shut down, or forgotten
            await out.changed.wait()

    def delivered(self, session: uuid.UUID) -> list[int]:
        """The tokens delivered so far (tests, embedding)."""
        output = self._outputs.get(session)
        return list(output.delivered) if output else []

    def tally(self, session: uuid.UUID) -> DeliveryTally | None:
        """What was delivered for ``session``, counted (tests, embedding)."""
        output = self._outputs.get(session)
        return output.tally if output else None

    def epoch(self, session: uuid.UUID) -> int | None:
        output = self._outputs.get(session)
        return output.epoch if output else None

    def failure(self, session: uuid.UUID) -> str | None:
        """Why the PC gave ``session`` up, once it told this front end (tests, embedding)."""
        output = self._outputs.get(session)
        return output.failed if output else None
