"""The inference instance's control service (kvsp-draft §6.3, §6.5).

A plain class; :mod:`.routes` maps ``prefetch``, ``prefetch/{directive}``,
``state`` and ``sessions`` onto it (docs/http-api.md "Inference Instance"). Collaborators:

- :class:`~.common.lifecycle.Lifecycle` — active / draining / sleeping and the sessions in
  flight (§6.3);
- :class:`~.instance.prefetch.PrefetchExecutor` — directives as background tasks (§6.5);
- :class:`~.instance.reporter.StatusReporter` — status records to the PC (§6.3);
- its own :class:`~kvsp_moq.storage.BlockStore` and :class:`~.client.publisher.ReplicaPublisher`
  (the replicas it loads are published with the instance URL as holder, §6.5, so the IS
  counts them as resident there, §6.4).

Sessions (``POST sessions`` / ``DELETE sessions/{id}``) stand for the requests the engine
runs: admitting one is what "a request already admitted" means in §6.5, and it completes
whatever a directive is doing (the prefetch runs in its own task).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import TYPE_CHECKING

from ...kvsp.errors import RecordError
from ...kvsp.records import (
    InstanceStatusRecord,
    Link,
    PrefetchDirective,
    PrefetchStatus,
    ReshardMessage,
    ReshardPlan,
)
from ...kvsp.records.instance import ACTIVE, DRAINING, SLEEPING
from ...kvsp.records.shard import ReshardAbort, ReshardCommit
from ...storage import BlockStore, RecordKey
from ..common.auth import Principal, require_instance, require_scope
from ..common.clock import Timer
from ..common.config import InstanceConfig
from ..common.errors import NotActive, NotFound
from ..common.lifecycle import Lifecycle
from ..common.records import SessionAdmitted, SessionRequest, StatusAnswer
from ..common.session_records import ReshardAck, SessionAccepted, SessionOrder
from ..common.shard_store import MemoryShardStore, ShardSlice, ShardStore, TokenRange
from .metrics import InstanceMetrics
from .prefetch import PrefetchExecutor
from .reporter import PcClient, StatusReporter, sleep_request
from .reshard import ReshardParticipant, ShardFetcher
from .sessions import CheckpointSink, InstanceSessions, SessionEngine, TokenSink

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.engine import InferenceEngine

__all__ = ["InstanceService"]


class InstanceService:
    """One inference instance's control plane."""

    def __init__(
        self,
        *,
        url: str,
        epoch: int,
        store: BlockStore,
        prefetch: PrefetchExecutor,
        timer: Timer,
        pc: PcClient | None = None,
        config: InstanceConfig | None = None,
        session_engine: SessionEngine | None = None,
        checkpoints: CheckpointSink | None = None,
        front_ends: TokenSink | None = None,
        shard_store: ShardStore | None = None,
        shard_fetcher: ShardFetcher | None = None,
    ) -> None:
        self.config = config if config is not None else InstanceConfig()
        self.url = url
        self.epoch = epoch
        self.store = store
        self.prefetch = prefetch
        self.timer = timer
        self.lifecycle = Lifecycle(timer, max_sessions=self.config.max_sessions, on_sleep=self._entered_sleep)
        self.reporter = StatusReporter(self, pc, timer, self.config.report_ms)
        self.links = tuple(Link(holder=l.holder, mbit_per_s=l.mbit_per_s, rtt_us=l.rtt_us) for l in self.config.links)
        #: §6.8 sessions run by the engine (``instance/sessions.py``).
        self.sessions = InstanceSessions(engine=session_engine, lifecycle=self.lifecycle, pc=checkpoints, front_end=front_ends,
                                         checkpoint_every=self.config.checkpoint_every,
                                         checkpoint_timeout_ms=self.config.checkpoint_timeout_ms,
                                         delivery_deadline_ms=self.config.delivery_deadline_ms)
        #: §6.9 this instance's shards and its side of resharding (``instance/reshard.py``).
        self.shards = ReshardParticipant(shard_store if shard_store is not None else MemoryShardStore(), shard_fetcher)
        #: The model-running engine behind ``POST generate`` (``engine/engine.py``); set by
        #: ``instance.serve.serve_instance`` when ``[instance.engine]`` is configured.
        self.inference: InferenceEngine | None = None
        #: ``GET {ii}metrics`` (``instance/metrics.py``, docs/metrics.md); the engine's counters
        #: are added by ``serve_instance`` when it has one.
        self.metrics = InstanceMetrics()
        self.prefetch.on_finished = self.metrics.directive_finished
        self.metrics.watch(
            state=lambda: self.state, epoch=lambda: self.epoch, running_directives=lambda: self.prefetch.running,
            sessions=lambda: [(o.epoch, len(o.generated), o.acknowledged) for o in self.sessions.outputs()])

    @property
    def state(self) -> str:
        return self.lifecycle.state

    # -- §6.5 prefetch ---------------------------------------------------------------------------

    def accept_directive(self, principal: Principal, directive: PrefetchDirective) -> uuid.UUID:
        """Start a directive; the caller answers 202 with its status resource. The principal
        must act for this instance (the PC) and for the directive's scope (else 403); a
        draining or sleeping instance refuses (409 ``kvsp-not-active``, §6.3)."""
        require_instance(principal, self.url)
        require_scope(principal, directive.scope_id)
        existing = self.prefetch.get(directive.directive)
        if existing is None and self.state != ACTIVE:
            raise NotActive(f"the instance is {self.state}: it takes no prefetch directives")
        return self.prefetch.start(directive).directive.directive

    async def directive_status(self, principal: Principal, directive: uuid.UUID, *, wait_s: float = 0.0) -> PrefetchStatus:
        """The directive's status; with ``wait_s``, once it has ended or after ``wait_s``
        (a long poll: a caller learns of completion without polling)."""
        run = self.prefetch.get(directive)
        if run is None:
            raise NotFound(f"no directive {directive}")
        require_scope(principal, run.directive.scope_id)
        if wait_s > 0 and not run.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), wait_s)
        return run.status()

    # -- §6.3 state ------------------------------------------------------------------------------

    async def set_state(self, principal: Principal, state: str) -> StatusAnswer:
        """``PUT state`` from the PC; the answer is the state entered (``draining`` when
        sessions are still in flight for a requested ``sleeping``)."""
        require_instance(principal, self.url)
        return StatusAnswer(state=self.lifecycle.set_state(state))

    def _entered_sleep(self) -> None:
        self.reporter.trigger()  # §6.3 "enters sleeping and reports it"

    # -- sessions (requests the engine runs) ---------------------------------------------------------

    def admit(self, principal: Principal, request: SessionRequest) -> SessionAdmitted:
        """Admit a session; ``NotActive`` when draining or sleeping (§6.3 MUST NOT accept).
        ``resident`` is the number of leading blocks of its prompt held here complete (§6.5:
        the request is served with the loaded prefix, the rest recomputed); a block still
        landing (a prefetch or load writing its layers) ends the run."""
        require_scope(principal, request.scope_id)
        self.lifecycle.admit(request.session, request.scope_id)
        resident = 0
        for key in request.block_keys:
            info = self.store.get(RecordKey(request.compat_id, request.scope_id, key))
            if info is None or not info.complete:
                break
            resident += 1
        return SessionAdmitted(session=request.session, resident=resident)

    def finish(self, principal: Principal, session: uuid.UUID) -> None:
        scope = self.lifecycle.sessions.get(session)
        if scope is None:
            raise NotFound(f"no session {session} in flight")
        require_scope(principal, scope)
        self.sessions.stop(session)
        self.lifecycle.finish(session)

    # -- §6.8 start and resume -------------------------------------------------------------------

    def run_session(self, principal: Principal, session: uuid.UUID, order: SessionOrder, *, resume: bool) -> SessionAccepted:
        """``POST sessions/{id}/start`` (ours) or ``/resume`` (§6.8) from the PC: the principal
        acts for this instance and the session's scope (else 403); an epoch not above the
        highest seen here for the session is refused (409 ``kvsp-stale-epoch``, §6.8); a
        draining or sleeping instance refuses (409 ``kvsp-not-active``, §6.3)."""
        if order.session != session:
            raise RecordError("checkpoint.session", f"must be the session of the path ({session})")
        require_instance(principal, self.url)
        require_scope(principal, order.checkpoint.scope_id)
        return self.sessions.accept(order, resume=resume)

    # -- §6.9 resharding ---------------------------------------------------------------------------

    async def reshard(self, principal: Principal, message: ReshardMessage) -> ReshardAck | None:
        """``POST reshard`` from the PC: a plan answers once its fetches completed; commit and
        abort at once (``None``)."""
        require_instance(principal, self.url)
        if isinstance(message, ReshardPlan):
            return await self.shards.plan(message)
        if isinstance(message, ReshardCommit):
            self.shards.commit(message)
        elif isinstance(message, ReshardAbort):
            self.shards.abort(message)
        return None

    async def shard_tokens(self, principal: Principal, map_id: str, version: int, tokens: TokenRange) -> ShardSlice:
        """A peer's fetch of a token range (the peer acts for this instance, i.e. is a member
        of the parallel group the deployment configured)."""
        require_instance(principal, self.url)
        return await self.shards.serve(map_id, version, tokens)

    # -- §6.3 status -----------------------------------------------------------------------------

    def status_record(self) -> InstanceStatusRecord:
        stats = self.store.stats()
        capacity = sum(t.capacity for t in stats.tiers)
        used = sum(t.used for t in stats.tiers)
        return InstanceStatusRecord(
            instance=self.url,
            epoch=self.epoch,
            state=self.state,
            running=len(self.lifecycle.sessions),
            queued=0,
            batch_size=self.config.batch_size,
            kv_utilization=min(1.0, used / capacity) if capacity else 0.0,
            prefill_tokens_per_s=self._rates()[0],
            decode_tokens_per_s=self._rates()[1],
            links=self.links,
            requested_state=sleep_request(self.state, self.lifecycle.idle_for_ms(), self.config.sleep_after_idle_ms),
            ttl_ms=self.config.status_ttl_ms,
        )

    def on_answer(self, record: InstanceStatusRecord, answer: StatusAnswer) -> None:
        """The PC's answer to a report: ``draining`` accepts a request to sleep (§6.3)."""
        if record.requested_state != SLEEPING or self.state != ACTIVE:
            return
        if answer.state == DRAINING:
            self.lifecycle.set_state(DRAINING)
        else:
            self.lifecycle.restart_idle()

    def _rates(self) -> tuple[float, float]:
        """§4.4 prefill/decode rates: measured by the engine once it ran, else configured."""
        measured = self.inference.measured_rates() if self.inference is not None else (None, None)
        return (measured[0] or self.config.prefill_tokens_per_s, measured[1] or self.config.decode_tokens_per_s)

    async def close(self) -> None:
        if self.inference is not None:
            await self.inference.close()
        await self.sessions.close()
        await self.shards.close()
        await self.prefetch.close()
        await self.reporter.flush()
