"""The inference instance's metrics (docs/metrics.md "Inference instance"): prefetch directive
outcomes and durations (§6.5), state and epoch (§6.3), the sessions it runs with their epochs
and checkpoint lag (§6.8), and its engine's counters when it has one (``engine/metrics.py``).

Labels: ``outcome`` and ``state`` take fixed sets. Sessions are aggregated (max, sum), never a
label per session (unbounded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from ...kvsp.records.instance import ACTIVE, DRAINING, SLEEPING
from ...kvsp.records.prefetch import COMPLETE, FAILED, PARTIAL
from ..common.metrics import RoleMetrics, gauge_family
from ..engine.counters import EngineCounters
from ..engine.metrics import engine_families

__all__ = ["DIRECTIVE_OUTCOMES", "InstanceMetrics", "SessionProgress"]

DIRECTIVE_OUTCOMES = (COMPLETE, PARTIAL, FAILED)
#: ``(session epoch, tokens generated, tokens acknowledged by the PC)`` of one running session.
SessionProgress = tuple[int, int, int]


class InstanceMetrics(RoleMetrics):
    """Counted by the prefetch executor (:meth:`directive_finished`); the rest is read from the
    instance through :meth:`watch` at scrape time."""

    def __init__(self) -> None:
        super().__init__("instance")
        self.directives = self.counter(
            "kvsp_instance_prefetch_directives", "§6.5 prefetch directives ended, by outcome", ("outcome",))
        self.directive_seconds = self.histogram(
            "kvsp_instance_prefetch_duration_seconds", "Time from accepting a prefetch directive to its end, by outcome",
            labels=("outcome",))
        for outcome in DIRECTIVE_OUTCOMES:
            self.directives.labels(outcome)
            self.directive_seconds.labels(outcome)
        self._state: Callable[[], str] = lambda: ACTIVE
        self._epoch: Callable[[], int] = lambda: 0
        self._running_directives: Callable[[], int] = lambda: 0
        self._sessions: Callable[[], Iterable[SessionProgress]] = lambda: ()
        self.engine: EngineCounters | None = None
        self.collect_with(self._families)

    def directive_finished(self, outcome: str, seconds: float) -> None:
        self.directives.labels(outcome).inc()
        self.directive_seconds.labels(outcome).observe(seconds)

    def watch(self, *, state: Callable[[], str], epoch: Callable[[], int], running_directives: Callable[[], int],
              sessions: Callable[[], Iterable[SessionProgress]]) -> None:
        self._state, self._epoch = state, epoch
        self._running_directives, self._sessions = running_directives, sessions

    def _families(self) -> Iterable[Metric]:
        state = self._state()
        yield gauge_family("kvsp_instance_state", "1 for the instance's lifecycle state (§6.3), 0 for the others",
                           ("state",), (((s,), 1 if s == state else 0) for s in (ACTIVE, DRAINING, SLEEPING)))
        yield gauge_family("kvsp_instance_epoch", "The instance epoch (§6.3)", (), [((), self._epoch())])
        yield gauge_family("kvsp_instance_prefetch_running", "Prefetch directives still loading", (),
                           [((), self._running_directives())])
        sessions = list(self._sessions())
        lags = [max(generated - acknowledged, 0) for _, generated, acknowledged in sessions]
        yield gauge_family("kvsp_instance_sessions_running", "§6.8 sessions running here", (), [((), len(sessions))])
        yield gauge_family("kvsp_instance_session_epoch_max", "The highest session epoch of the sessions running here",
                           (), [((), max((epoch for epoch, _, _ in sessions), default=0))])
        yield gauge_family("kvsp_instance_checkpoint_lag_tokens_max", "Checkpoint lag: tokens generated but not yet "
                           "covered by a checkpoint the PC acknowledged, the largest over the running sessions", (),
                           [((), max(lags, default=0))])
        yield gauge_family("kvsp_instance_checkpoint_lag_tokens_sum", "Checkpoint lag summed over the running sessions",
                           (), [((), sum(lags))])
        if self.engine is not None:
            yield from engine_families(self.engine)
