"""Sessions on an inference instance (kvsp-draft §6.8): start, resume, checkpoints, output.

The seam for the model: a :class:`SessionEngine` runs one session's generation. The instance
hands it a :class:`SessionOrder` (the checkpoint to continue from and the session epoch) and a
:class:`SessionOutput`, through which every output token and checkpoint leaves:

- :meth:`SessionOutput.token` labels a token with the next index and the session epoch
  (§6.8 step 4) and releases it to the front end: at once when the sampler is deterministic,
  otherwise only once the PC has acknowledged a checkpoint covering it (§6.8 MUST NOT release
  before); a checkpoint is sent automatically every ``checkpoint_every`` tokens (§6.8 "at
  least every 64 output tokens").
- :meth:`SessionOutput.checkpoint` sends a Session Checkpoint (``PUT sessions/{id}/checkpoint``)
  with the engine's sampler state and releases what the acknowledgement covers.
- A refusal with ``kvsp-stale-epoch`` (from the PC or the front end) means the session was
  moved to another instance: :class:`Superseded` is raised into the engine, which stops.
- A PC that cannot be reached, or does not answer a checkpoint within ``checkpoint_timeout_ms``,
  does not stop an admitted session (docs/reliability.md): the checkpoint is counted
  (``checkpoint_failures``) and skipped, the next one covers its tokens. A deterministic
  sampler's tokens are released all the same (§6.8: the front end discards duplicates by index
  after a resume); a non-deterministic one's wait for an acknowledged checkpoint, and the last
  checkpoint of such a run is retried with a growing pause until ``delivery_deadline_ms`` (§6.8
  MUST NOT release before the PC acknowledged it). ``session_done`` failing is logged: the front
  end has the end already.
- A run that fails otherwise — the engine cannot serve the session here
  (:class:`SessionRefused`: another model, prompt blocks no replica delivers, an unknown
  sampler) or any other error — is reported to the PC with ``POST {pc}sessions/{id}/failed``
  (:class:`~.common.session_records.SessionFailed`, the run's epoch and the reason), so that the PC
  places it elsewhere or marks it failed, instead of the session waiting for ever.

On resume, the output first re-sends the tokens the checkpoint covers, labelled with the new
epoch: the front end drops those it delivered (by index), and delivers any that the failed
instance had released but that never reached it.

:class:`InstanceSessions` keeps the highest epoch seen per session: a start or resume with an
epoch not above it is refused with ``kvsp-stale-epoch`` (§6.8 "Any message ... carrying the old
epoch MUST be rejected"), and a newer order for a session running here replaces the old run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

from ...kvsp.records import Sampler, SessionCheckpoint
from ..common.errors import NotActive, PeerUnreachable, SessionRefused, StaleEpoch, Superseded
from ..common.lifecycle import Lifecycle
from ..common.session_records import (
    MAX_REASON_CHARS,
    MAX_TOKENS_PER_BATCH,
    CheckpointAck,
    OutputToken,
    OutputTokens,
    SessionAccepted,
    SessionDone,
    SessionFailed,
    SessionOrder,
)

__all__ = ["CheckpointSink", "InstanceSessions", "SessionEngine", "SessionOutput", "TokenSink"]

log = logging.getLogger(__name__)


class CheckpointSink(Protocol):
    """The PC, as an instance running sessions reaches it (``client.http.HttpPcClient``)."""

    async def checkpoint(self, checkpoint: SessionCheckpoint) -> CheckpointAck:
        """``PUT {pc}sessions/{id}/checkpoint``; :class:`Superseded` on ``kvsp-stale-epoch``,
        :class:`PeerUnreachable` on any other failure."""
        ...

    async def session_done(self, session: uuid.UUID, done: SessionDone) -> None:
        """``POST {pc}sessions/{id}/done``; the same errors."""
        ...

    async def session_failed(self, session: uuid.UUID, failed: SessionFailed) -> None:
        """``POST {pc}sessions/{id}/failed`` (ours); the same errors."""
        ...


class TokenSink(Protocol):
    """Front ends, as instances deliver output to them (``client.http.HttpFrontEndClient``)."""

    async def deliver(self, front_end: str, batch: OutputTokens) -> None:
        """``POST {fe}sessions/{id}/tokens``; the same errors."""
        ...


class SessionEngine(Protocol):
    """Runs the generation of sessions (the model; a later engineer plugs the real one in).

    Both methods run one session to its end, emitting through ``output`` (``output.next_index``
    is the index of the next token; ``output.generated`` the tokens so far) and returning when
    the output is complete (``order.max_tokens`` tokens, or an end of sequence). They are
    cancelled when the session is superseded or finished early; :class:`Superseded` raised by
    ``output`` may simply propagate.
    """

    async def start(self, order: SessionOrder, output: SessionOutput) -> None:
        """A new session (``order.checkpoint`` is the initial one: nothing generated)."""
        ...

    async def resume(self, order: SessionOrder, output: SessionOutput) -> None:
        """§6.8: load the checkpoint's blocks and the generated blocks published by the failed
        instance; recompute prompt_tail and the generated tokens not covered; restore the
        sampler (method, params, seed, step); continue from ``order.checkpoint.output_offset``."""
        ...


#: Pauses between delivery attempts to a front end: doubling from the first to the largest.
DELIVERY_RETRY_FIRST_S = 0.1
DELIVERY_RETRY_MAX_S = 2.0


class SessionOutput:
    """One run's output: labels, release rules and checkpoints (see the module notes)."""

    def __init__(
        self,
        order: SessionOrder,
        *,
        pc: CheckpointSink | None,
        front_end: TokenSink | None,
        checkpoint_every: int = 64,
        delivery_deadline_ms: int = 15_000,
        checkpoint_timeout_ms: int = 10_000,
    ) -> None:
        self.order = order
        self.session = order.session
        self.epoch = order.epoch
        self.pc = pc
        self.front_end = front_end
        self.checkpoint_every = checkpoint_every
        self.delivery_deadline_ms = delivery_deadline_ms
        self.checkpoint_timeout_ms = checkpoint_timeout_ms
        #: Checkpoints the PC did not acknowledge (unreachable, failing, or too slow).
        self.checkpoint_failures = 0
        base = order.checkpoint
        self.deterministic = base.sampler.deterministic
        self.sampler = base.sampler
        self.generated: list[int] = list(base.generated)
        self.acknowledged = base.output_offset  # covered by a checkpoint the PC keeps
        self.released = 0  # tokens [0, released) were handed to the front end (this run)
        self._last_checkpoint = base.output_offset
        self.finished = False

    @property
    def next_index(self) -> int:
        return len(self.generated)

    @property
    def max_tokens(self) -> int | None:
        return self.order.max_tokens

    async def replay(self) -> None:
        """Re-send, with this run's epoch, the tokens the checkpoint covers (resume)."""
        await self._release_up_to(self.acknowledged)

    async def token(self, token: int) -> int:
        """Emit the next output token; returns its index."""
        if self.finished:
            raise RuntimeError("the output is finished")
        if self.max_tokens is not None and self.next_index >= self.max_tokens:
            raise RuntimeError(f"max_tokens ({self.max_tokens}) reached")
        index = self.next_index
        self.generated.append(token)
        if self.deterministic:
            await self._release_up_to(self.next_index)
        if self.next_index - self._last_checkpoint >= self.checkpoint_every:
            await self.checkpoint()
        return index

    async def checkpoint(self, sampler: Sampler | None = None, *, required: bool = False) -> int:
        """Checkpoint everything generated so far (``sampler`` is the engine's state; default:
        the order's with ``step`` = tokens generated). Returns the acknowledged offset. A PC
        that does not acknowledge it leaves the offset where it was (see the module notes);
        ``required``: retried until ``delivery_deadline_ms``, then ``PeerUnreachable``."""
        if sampler is not None:
            self.sampler = sampler
        else:
            self.sampler = dataclasses.replace(self.sampler, step=self.next_index)
        cp = dataclasses.replace(
            self.order.checkpoint, epoch=self.epoch, generated=tuple(self.generated), output_offset=self.next_index,
            sampler=self.sampler,
        )
        self._last_checkpoint = cp.output_offset
        if self.pc is None:
            self.acknowledged = cp.output_offset  # no PC: nobody to acknowledge (embedding, tests)
        else:
            ack = await self._send_checkpoint(cp, required)
            if ack is not None:
                if ack.epoch != self.epoch:
                    raise Superseded(f"the PC holds session {self.session} at epoch {ack.epoch}")
                self.acknowledged = max(self.acknowledged, min(ack.output_offset, self.next_index))
        await self._release_up_to(self.acknowledged)
        return self.acknowledged

    async def _send_checkpoint(self, cp: SessionCheckpoint, required: bool) -> CheckpointAck | None:
        """``PUT {pc}sessions/{id}/checkpoint``, each attempt within ``checkpoint_timeout_ms``;
        None when the PC did not acknowledge it (and it is not ``required``)."""
        assert self.pc is not None
        deadline = time.monotonic() + self.delivery_deadline_ms / 1000
        pause = DELIVERY_RETRY_FIRST_S
        while True:
            try:
                async with asyncio.timeout(self.checkpoint_timeout_ms / 1000):
                    return await self.pc.checkpoint(cp)
            except (PeerUnreachable, TimeoutError) as exc:
                self.checkpoint_failures += 1
                reason = f"{type(exc).__name__}: {exc}"
            if not required:
                log.warning("session %s: checkpoint at %d not acknowledged (%s); generating on",
                            self.session, cp.output_offset, reason)
                return None
            if time.monotonic() + pause > deadline:
                raise PeerUnreachable(f"checkpoint at {cp.output_offset} not acknowledged within "
                                      f"delivery_deadline_ms: {reason}")
            log.warning("session %s: checkpoint failed, retrying in %.1f s: %s", self.session, pause, reason)
            await asyncio.sleep(pause)  # back-off between attempts, bounded by the deadline
            pause = min(pause * 2, DELIVERY_RETRY_MAX_S)

    async def finish(self) -> None:
        """The output is complete: checkpoint what is not covered (a non-deterministic
        sampler's last tokens wait for it), deliver the end, and tell the PC."""
        if self.finished:
            return
        if self.acknowledged < self.next_index or self._last_checkpoint < self.next_index:
            # A non-deterministic sampler's last tokens are released only once acknowledged.
            await self.checkpoint(required=not self.deterministic)
        await self._deliver([], end=self.next_index)
        self.finished = True
        if self.pc is not None:
            done = SessionDone(epoch=self.epoch, output_offset=self.next_index)
            try:
                async with asyncio.timeout(self.checkpoint_timeout_ms / 1000):
                    await self.pc.session_done(self.session, done)
            except (PeerUnreachable, TimeoutError) as exc:
                log.warning("session %s: telling the PC it is done failed (%s: %s); the front end has the end",
                            self.session, type(exc).__name__, exc)

    async def _release_up_to(self, limit: int) -> None:
        if limit <= self.released:
            return
        start = self.released
        tokens = [OutputToken(index=i, token=self.generated[i]) for i in range(start, limit)]
        for at in range(0, len(tokens), MAX_TOKENS_PER_BATCH):
            await self._deliver(tokens[at : at + MAX_TOKENS_PER_BATCH])
        self.released = limit

    async def _deliver(self, tokens: Sequence[OutputToken], *, end: int | None = None) -> None:
        target = self.order.front_end
        if self.front_end is None or target is None:
            return
        batch = OutputTokens(session=self.session, epoch=self.epoch, tokens=tuple(tokens), end=end)
        # A front end that cannot take the batch now (restarting, its store answering 503) is
        # retried with a growing pause until delivery_deadline_ms; a retried batch is safe, the
        # front end drops the indexes it already has (§6.8 exactly once per index).
        deadline = time.monotonic() + self.delivery_deadline_ms / 1000
        pause = DELIVERY_RETRY_FIRST_S
        while True:
            try:
                await self.front_end.deliver(target, batch)
                return
            except PeerUnreachable as exc:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("session %s: delivery to %s failed, retrying in %.1f s: %s",
                            self.session, target, pause, exc)
                await asyncio.sleep(pause)  # back-off between attempts, bounded by the deadline
                pause = min(pause * 2, DELIVERY_RETRY_MAX_S)


class InstanceSessions:
    """The sessions this instance runs with its engine (see the module notes)."""

    def __init__(
        self,
        *,
        engine: SessionEngine | None,
        lifecycle: Lifecycle,
        pc: CheckpointSink | None,
        front_end: TokenSink | None,
        checkpoint_every: int = 64,
        checkpoint_timeout_ms: int = 10_000,
        delivery_deadline_ms: int = 15_000,
    ) -> None:
        self.engine = engine
        self.lifecycle = lifecycle
        self.pc = pc
        self.front_end = front_end
        self.checkpoint_every = checkpoint_every
        self.checkpoint_timeout_ms = checkpoint_timeout_ms
        self.delivery_deadline_ms = delivery_deadline_ms
        self._epochs: dict[uuid.UUID, int] = {}  # highest epoch seen per session
        self._runs: dict[uuid.UUID, tuple[SessionOutput, asyncio.Task[None]]] = {}

    def epoch_of(self, session: uuid.UUID) -> int | None:
        return self._epochs.get(session)

    def outputs(self) -> list[SessionOutput]:
        """The outputs of the sessions running here (metrics, ``instance/metrics.py``)."""
        return [output for output, _ in self._runs.values()]

    def output_of(self, session: uuid.UUID) -> SessionOutput | None:
        run = self._runs.get(session)
        return run[0] if run is not None else None

    def accept(self, order: SessionOrder, *, resume: bool) -> SessionAccepted:
        """Start running ``order``; ``StaleEpoch`` unless its epoch is above every epoch seen
        for the session here; ``NotActive`` without an engine, or when draining or sleeping
        (§6.3, for a session not already running here)."""
        session = order.session
        highest = self._epochs.get(session)
        if highest is not None and order.epoch <= highest:
            raise StaleEpoch(f"session {session} was already at epoch {highest} here; got {order.epoch}")
        if self.engine is None:
            raise NotActive("this instance has no session engine")
        self.lifecycle.admit(session, order.checkpoint.scope_id)
        self._epochs[session] = order.epoch
        self._cancel(session)
        output = SessionOutput(order, pc=self.pc, front_end=self.front_end, checkpoint_every=self.checkpoint_every,
                               checkpoint_timeout_ms=self.checkpoint_timeout_ms,
                               delivery_deadline_ms=self.delivery_deadline_ms)
        task = asyncio.get_running_loop().create_task(self._run(order, output, resume))
        self._runs[session] = (output, task)
        return SessionAccepted(session=session, epoch=order.epoch)

    async def _run(self, order: SessionOrder, output: SessionOutput, resume: bool) -> None:
        assert self.engine is not None
        try:
            if resume:
                await output.replay()
                await self.engine.resume(order, output)
            else:
                await self.engine.start(order, output)
            await output.finish()
        except Superseded as exc:
            log.info("session %s epoch %d superseded: %s", order.session, order.epoch, exc)
        except asyncio.CancelledError:
            raise
        except SessionRefused as exc:
            log.warning("session %s epoch %d cannot be served here: %s", order.session, order.epoch, exc)
            await self._report_failed(order, f"not servable here: {exc}")
        except Exception as exc:
            log.exception("session %s epoch %d failed", order.session, order.epoch)
            await self._report_failed(order, f"{type(exc).__name__}: {exc}")
        finally:
            run = self._runs.get(order.session)
            if run is not None and run[0] is output:
                del self._runs[order.session]
                self.lifecycle.finish(order.session)

    async def _report_failed(self, order: SessionOrder, reason: str) -> None:
        """Tell the PC the run failed, so that it re-places the session (see the module notes)."""
        if self.pc is None:
            return
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        try:
            await self.pc.session_failed(order.session, SessionFailed(epoch=order.epoch, reason=reason or "failed"))
        except Superseded as exc:
            log.info("session %s epoch %d: the PC moved it on already: %s", order.session, order.epoch, exc)
        except PeerUnreachable as exc:
            log.warning("session %s epoch %d: reporting the failure to the PC failed: %s", order.session, order.epoch, exc)

    def _cancel(self, session: uuid.UUID) -> None:
        run = self._runs.pop(session, None)
        if run is not None:
            run[1].cancel()

    def stop(self, session: uuid.UUID) -> None:
        """Stop the run of ``session`` (it completed elsewhere, or was deleted)."""
        self._cancel(session)

    async def wait(self, session: uuid.UUID) -> None:
        """Wait until the current run of ``session`` ends (tests, shutdown)."""
        run = self._runs.get(session)
        if run is not None:
            await asyncio.gather(run[1], return_exceptions=True)

    async def close(self) -> None:
        tasks = [task for _, task in self._runs.values()]
        self._runs.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
