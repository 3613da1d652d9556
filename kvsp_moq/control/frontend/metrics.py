"""The front end's metrics (docs/metrics.md "Front end"): tokens delivered, duplicates dropped
and stale epochs refused (§6.8), and the client sessions started.

Counted by a delivery observer of :class:`~.frontend.service.FrontEnd` (its ``observers``: one
call per delivery it handled), so the counting is where the delivery is decided. What this
process handled: with several front-end processes over one Redis store, sum over them. No
per-session or per-scope label (unbounded).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from ..common.metrics import RoleMetrics, gauge_family
from ..common.session_records import DeliveryAnswer, OutputTokens

__all__ = ["FrontEndMetrics"]


class FrontEndMetrics(RoleMetrics):
    def __init__(self) -> None:
        super().__init__("frontend")
        self.batches = self.counter(
            "kvsp_frontend_delivery_batches", "Output batches instances delivered (POST sessions/{id}/tokens), by "
            "result: accepted, or stale_epoch (a lower epoch than one seen, or a failed session: refused whole)",
            ("result",))
        for result in ("accepted", "stale_epoch"):
            self.batches.labels(result)
        self.tokens = self.counter("kvsp_frontend_tokens_delivered", "Output indices taken (each index once, §6.8)")
        self.duplicates = self.counter(
            "kvsp_frontend_duplicates_dropped", "Tokens dropped as duplicates of an index delivered or buffered (§6.8)")
        self.stale_tokens = self.counter(
            "kvsp_frontend_stale_tokens_refused", "Tokens of batches refused for a stale epoch (§6.8 MUST discard)")
        self.sessions_opened = self.counter(
            "kvsp_frontend_sessions_opened", "Client sessions (POST sessions), by result: started, or refused by the PC",
            ("result",))
        for result in ("started", "refused"):
            self.sessions_opened.labels(result)
        self._tracked: Callable[[], int] = lambda: 0
        self.collect_with(self._families)

    def observe(self, session: uuid.UUID, batch: OutputTokens, answer: DeliveryAnswer | None) -> None:
        """A ``DeliveryObserver`` (``frontend/service.py``): ``answer`` None is a stale batch."""
        if answer is None:
            self.batches.labels("stale_epoch").inc()
            self.stale_tokens.inc(len(batch.tokens))
            return
        self.batches.labels("accepted").inc()
        self.tokens.inc(answer.accepted)
        self.duplicates.inc(answer.duplicates)

    def watch(self, *, tracked: Callable[[], int]) -> None:
        self._tracked = tracked

    def _families(self) -> Iterable[Metric]:
        yield gauge_family("kvsp_frontend_sessions", "Sessions whose deliveries this process tracks", (),
                           [((), self._tracked())])
