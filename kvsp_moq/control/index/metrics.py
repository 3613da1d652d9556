"""The Index Service's metrics (docs/metrics.md "Index Service"): lookups, the matched prefix,
lookup latency, record publication, and the replica records stored.

No per-scope labels: scopes are unbounded (one per tenant or user), so a label per scope would
grow the series without limit; the ``result`` labels below have a fixed set of values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..common.metrics import SIZE_BUCKETS, RoleMetrics

__all__ = ["IndexMetrics"]


class IndexMetrics(RoleMetrics):
    """Counted by :class:`~.index.service.IndexService` where each event happens."""

    def __init__(self) -> None:
        super().__init__("index")
        self.lookups = self.counter("kvsp_index_lookups", "Lookups answered (§6.2 POST lookup)")
        self.lookup_blocks = self.counter(
            "kvsp_index_lookup_blocks", "Block keys asked for, and matched, by lookups", ("result",))
        self.matched = self.histogram(
            "kvsp_index_lookup_matched_blocks", "Matched prefix length of each lookup, in blocks", SIZE_BUCKETS)
        self.latency = self.histogram(
            "kvsp_index_lookup_duration_seconds", "Time to answer a lookup (the store's prefix read and the estimates)")
        self.puts = self.counter(
            "kvsp_index_replica_puts", "Replica records published (created) or refreshed (§6.1)", ("result",))
        self.withdrawals = self.counter("kvsp_index_replica_withdrawals", "Replica records withdrawn (§6.1 DELETE)")
        self.records = self.gauge("kvsp_index_replica_records", "Unexpired replica records in the store")

    def lookup(self, asked: int, matched: int, seconds: float) -> None:
        self.lookups.inc()
        self.lookup_blocks.labels("asked").inc(asked)
        self.lookup_blocks.labels("matched").inc(matched)
        self.matched.observe(matched)
        self.latency.observe(seconds)

    def put(self, created: bool) -> None:
        self.puts.labels("created" if created else "refreshed").inc()

    def put_many(self, created: list[bool]) -> None:
        """:meth:`put` of each of a batch's results, one increment per label."""
        new = sum(created)
        if new:
            self.puts.labels("created").inc(new)
        if len(created) > new:
            self.puts.labels("refreshed").inc(len(created) - new)

    def count_records_with(self, count: Callable[[], Awaitable[int]]) -> None:
        """``kvsp_index_replica_records`` from the store's ``count()``, read at each scrape."""

        async def refresh() -> None:
            try:
                self.records.set(await count())
            except NotImplementedError:  # a store that cannot count (the interface's default)
                self.records.set(float("nan"))

        self.refresh_with(refresh)
