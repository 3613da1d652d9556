"""The holder's metrics (docs/metrics.md "Holder"): blocks and octets served by tier and stored,
the block store's tiers and counters, leases and lease refusals by reason.

Labels: ``tier`` / ``kind`` are the configured tiers (a handful), ``result`` a fixed set. No
per-scope or per-principal labels: both are unbounded (one per tenant or client).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from prometheus_client.core import Metric

from ...storage import BlockReader, BlockStore
from ..common.errors import Forbidden, LeaseQuotaExceeded, NotFound, StoreUnavailable
from ..common.metrics import RoleMetrics, counter_family, gauge_family

__all__ = ["LEASE_RESULTS", "HolderMetrics", "lease_result"]

#: ``kvsp_holder_lease_requests_total{result}``: a grant, or why it was refused.
LEASE_RESULTS = ("granted", "quota", "not_found", "forbidden", "unavailable", "error")


def lease_result(exc: BaseException | None) -> str:
    """The ``result`` label of a lease request that raised ``exc`` (None: granted)."""
    if exc is None:
        return "granted"
    if isinstance(exc, LeaseQuotaExceeded):
        return "quota"  # §6.6 kvsp-lease-quota: TTL, octets, live leases or keys per lease
    if isinstance(exc, NotFound):
        return "not_found"
    if isinstance(exc, Forbidden):
        return "forbidden"
    if isinstance(exc, StoreUnavailable):
        return "unavailable"
    return "error"


class HolderMetrics(RoleMetrics):
    """Counted by :class:`~.holder.service.HolderService`; the store is read at scrape time."""

    def __init__(self, store: BlockStore) -> None:
        super().__init__("holder")
        self.store = store
        self.served_layers = self.counter(
            "kvsp_holder_served_layers", "Layers served by block GETs (HTTP), by the tier they were read from",
            ("tier", "kind"))
        self.served_octets = self.counter(
            "kvsp_holder_served_octets", "K and V octets served by block GETs (HTTP), by tier", ("tier", "kind"))
        self.served_blocks = self.counter(
            "kvsp_holder_served_blocks", "Block GETs served in full, by transport and range (all layers or layers=a-b)",
            ("transport", "range"))
        self.stored_blocks = self.counter(
            "kvsp_holder_stored_blocks", "Blocks stored by PUT (§6.7), by transport", ("transport",))
        self.stored_octets = self.counter(
            "kvsp_holder_stored_octets", "Container octets stored by PUT (§6.7), by transport", ("transport",))
        self.transcodes = self.counter(
            "kvsp_holder_transcodes", "Replicas transcoded for GET ?codec=n (§6.7), once per replica, range and codec",
            ("codec",))
        self.transcoded_octets = self.counter(
            "kvsp_holder_transcoded_octets", "Octets of the containers made by transcoding, by codec", ("codec",))
        self.lease_requests = self.counter(
            "kvsp_holder_lease_requests", "Lease requests (§6.6 POST leases) granted, or refused by reason", ("result",))
        for result in LEASE_RESULTS:
            self.lease_requests.labels(result)
        self.lease_renewals = self.counter("kvsp_holder_lease_renewals", "Leases renewed (§6.6 PUT leases/{id})")
        self.lease_releases = self.counter("kvsp_holder_lease_releases", "Leases released (§6.6 DELETE leases/{id})")
        self.leases = self.gauge("kvsp_holder_leases", "Live leases")
        self.leased_octets = self.gauge("kvsp_holder_leased_octets", "Octets of the replicas the live leases name")
        self.collect_with(self._store_families)

    def served(self, reader: BlockReader, full: bool) -> None:
        """A block GET whose body was sent: its layers and octets by the tier each was read from."""
        kind = {tier.name: tier.kind for tier in self.store.tiers}
        tier_of: dict[int, str] = {}
        for entry in self.store.residency(reader.key):
            for layer in entry.layer_range:
                tier_of[layer] = entry.tier
        for layer, (k_len, v_len) in zip(range(reader.first_layer, reader.last_layer + 1), reader.header.lengths):
            tier = tier_of.get(layer, "unknown")
            labels = (tier, kind.get(tier, "unknown"))
            self.served_layers.labels(*labels).inc()
            self.served_octets.labels(*labels).inc(k_len + v_len)
        self.served_blocks.labels("http", "all" if full else "layers").inc()

    def stored(self, octets: int) -> None:
        self.stored_blocks.labels("http").inc()
        self.stored_octets.labels("http").inc(octets)

    def count_leases_with(self, live: Callable[[], Awaitable[tuple[int, int]]]) -> None:
        """``kvsp_holder_leases`` and ``kvsp_holder_leased_octets`` from ``live()`` (count, octets)."""

        async def refresh() -> None:
            count, octets = await live()
            self.leases.set(count)
            self.leased_octets.set(octets)

        self.refresh_with(refresh)

    def _store_families(self) -> Iterable[Metric]:
        stats = self.store.stats()
        tiers = [((t.name, t.kind), t) for t in stats.tiers]
        yield gauge_family("kvsp_holder_tier_capacity_octets", "Payload capacity of each tier", ("tier", "kind"),
                           ((labels, t.capacity) for labels, t in tiers))
        yield gauge_family("kvsp_holder_tier_used_octets", "Payload octets held in each tier", ("tier", "kind"),
                           ((labels, t.used) for labels, t in tiers))
        yield gauge_family("kvsp_holder_tier_replicas", "Replicas with at least one layer in each tier", ("tier", "kind"),
                           ((labels, t.replicas) for labels, t in tiers))
        yield gauge_family("kvsp_holder_tier_layers", "Layers held in each tier", ("tier", "kind"),
                           ((labels, t.layers) for labels, t in tiers))
        yield gauge_family("kvsp_holder_replicas", "Replicas stored (being written included)", (), [((), stats.replicas)])
        yield gauge_family("kvsp_holder_replicas_writing", "Replicas being written", (), [((), stats.writing)])
        yield gauge_family("kvsp_holder_replicas_pinned", "Replicas pinned by a live lease (§6.6: not evicted)", (),
                           [((), stats.pinned)])
        yield counter_family("kvsp_holder_store_reads", "Reads of the block store (GETs, MOQT objects) that found "
                             "their layers (hit) or not (miss)", ("result",),
                             [(("hit",), stats.hits), (("miss",), stats.misses)])
        yield counter_family("kvsp_holder_evictions", "Replicas dropped to make room", (), [((), stats.evictions)])
        yield counter_family("kvsp_holder_demotions", "Replica layers moved to a slower tier to make room", (),
                             [((), stats.demotions)])
        yield counter_family("kvsp_holder_removals", "Replicas removed on request", (), [((), stats.removals)])
        yield counter_family("kvsp_holder_store_puts", "Replicas stored by any path (PUT, MOQT, writers)", (),
                             [((), stats.puts)])
