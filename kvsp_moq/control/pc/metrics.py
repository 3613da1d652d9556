"""The Placement Controller's metrics (docs/metrics.md "Placement Controller"): instances and
sessions by state, session epochs, leadership, prefetch directives sent, checkpoints.

The gauges are read from the PC's registry and sessions at scrape time (a standby PC, which holds
no cache of the store, shows none). Labels: ``state`` and ``result`` take a fixed set of values;
no per-instance, per-session or per-scope label (unbounded).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from ...kvsp.records.instance import ACTIVE, DRAINING, FAILED, SLEEPING
from ..common.metrics import RoleMetrics, gauge_family

__all__ = ["INSTANCE_STATES", "SESSION_STATES", "PcMetrics"]

INSTANCE_STATES = (ACTIVE, DRAINING, SLEEPING, FAILED)
#: A session is ``serving`` (an instance runs it), ``pending`` (none took it yet) or ``failed``.
SESSION_STATES = ("serving", "pending", "failed")

#: ``() -> [(session state, session epoch), ...]`` of the sessions the PC tracks.
SessionStates = Callable[[], Iterable[tuple[str, int]]]
#: ``() -> [instance state, ...]`` of the instances the PC knows.
InstanceStates = Callable[[], Iterable[str]]


class PcMetrics(RoleMetrics):
    """Counted by :class:`~.pc.service.PlacementController` and its routes; the state through
    :meth:`watch`."""

    def __init__(self) -> None:
        super().__init__("pc")
        self.directives = self.counter(
            "kvsp_pc_prefetch_directives", "§6.5 prefetch directives sent to instances, by result (sent, refused)",
            ("result",))
        self.checkpoints = self.counter(
            "kvsp_pc_checkpoints", "§6.8 Session Checkpoints received, by result (acknowledged, stale_epoch)",
            ("result",))
        for result in ("sent", "refused"):
            self.directives.labels(result)
        for result in ("acknowledged", "stale_epoch"):
            self.checkpoints.labels(result)
        self._instances: InstanceStates = lambda: ()
        self._sessions: SessionStates = lambda: ()
        self._leading: Callable[[], bool] = lambda: True
        self.collect_with(self._families)

    def watch(self, *, instances: InstanceStates, sessions: SessionStates, leading: Callable[[], bool]) -> None:
        self._instances, self._sessions, self._leading = instances, sessions, leading

    def _families(self) -> Iterable[Metric]:
        states = Tally(self._instances())
        yield gauge_family("kvsp_pc_instances", "Instances the PC knows, by state (§6.3)", ("state",),
                           (((s,), states.get(s, 0)) for s in sorted(set(INSTANCE_STATES) | set(states))))
        sessions = list(self._sessions())
        by_state = Tally(state for state, _ in sessions)
        yield gauge_family("kvsp_pc_sessions", "§6.8 sessions the PC tracks, by state", ("state",),
                           (((s,), by_state.get(s, 0)) for s in SESSION_STATES))
        yield gauge_family("kvsp_pc_session_epoch_max", "The highest session epoch of the sessions tracked (§6.8; "
                           "an epoch above 1 is a session that moved)", (),
                           [((), max((epoch for _, epoch in sessions), default=0))])
        yield gauge_family("kvsp_pc_session_epoch_raises", "Epoch raises of the sessions tracked: the sum of "
                           "(epoch - 1) over them (migrations, refusals, retried orders)", (),
                           [((), sum(max(epoch - 1, 0) for _, epoch in sessions))])
        yield gauge_family("kvsp_pc_leader", "1 while this PC is the active one (holds the leader lock), else 0", (),
                           [((), 1 if self._leading() else 0)])
