"""Prometheus metrics of the control-plane roles (docs/metrics.md): what every role shares.

Each role's service owns one :class:`RoleMetrics`: its own ``CollectorRegistry`` (never the
process-wide default one: tests and ``kvsp demo`` run several roles in one process), the
counters and histograms of the events the role counts where they happen (a lookup, a lease
refusal, a directive's end), and *scrape-time collectors* that read the service's state and its
existing counters when ``GET {base}metrics`` is served (gauges such as sessions by state, and
the counters an engine keeps in ``engine/counters.py``), so nothing is counted twice.

State that only a coroutine can read (a Redis-backed store's record count, the live leases) is
read by the *refreshers* that :meth:`RoleMetrics.render` awaits before it renders; a refresher
that fails (the store is away) is logged and leaves its gauge at the last value read, the rest of
the scrape is still served.

The exposition is the Prometheus text format 0.0.4 (``CONTENT_TYPE``); every name starts with
``kvsp_`` (:data:`PREFIX`; checked when a metric is made).

No web framework here: ``control/http/metrics.py`` serves it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

__all__ = [
    "CONTENT_TYPE",
    "DURATION_BUCKETS",
    "PREFIX",
    "SIZE_BUCKETS",
    "RoleMetrics",
    "counter_family",
    "gauge_family",
]

log = logging.getLogger(__name__)

#: The text exposition format served at ``GET {base}metrics``.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Every metric of the control plane is named ``kvsp_<role>_...``.
PREFIX = "kvsp_"
#: Buckets (seconds) of the duration histograms: sub-millisecond in-process calls up to a
#: minute-long prefetch directive.
DURATION_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                       2.5, 5.0, 10.0, 30.0, 60.0)
#: Buckets of the size histograms counted in blocks (a matched prefix): powers of two.
SIZE_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)

#: Reads the service's state at scrape time: the metric families to expose.
CollectFn = Callable[[], Iterable[Metric]]
#: Reads state that needs a coroutine (a store) into gauges, before each scrape.
Refresher = Callable[[], Awaitable[None]]


def _version() -> str:
    try:
        return metadata.version("kvsp-moq")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "unknown"


def _check(name: str) -> str:
    if not name.startswith(PREFIX):
        raise ValueError(f"metric {name!r} must be named {PREFIX}...")
    return name


class _FunctionCollector(Collector):
    """A collector whose samples a function computes at every scrape."""

    def __init__(self, fn: CollectFn) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self.fn())


class RoleMetrics:
    """The metrics of one role's service instance (module notes)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=False)
        self._refreshers: list[Refresher] = []
        info = self.gauge("kvsp_build_info", "The kvsp_moq version and role of this process (always 1)",
                          ("role", "version"))
        info.labels(role, _version()).set(1)

    # -- making metrics ------------------------------------------------------------------------

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter counted where its event happens; ``name`` without ``_total`` (added)."""
        return Counter(_check(name), documentation, tuple(labels), registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(_check(name), documentation, tuple(labels), registry=self.registry)

    def histogram(self, name: str, documentation: str, buckets: Sequence[float] = DURATION_BUCKETS,
                  labels: Sequence[str] = ()) -> Histogram:
        return Histogram(_check(name), documentation, tuple(labels), registry=self.registry, buckets=tuple(buckets))

    def collect_with(self, fn: CollectFn) -> None:
        """Expose the families ``fn`` computes from the service's state at each scrape."""
        self.registry.register(_FunctionCollector(fn))

    def refresh_with(self, refresher: Refresher) -> None:
        """Await ``refresher`` before each scrape (state behind a coroutine, module notes)."""
        self._refreshers.append(refresher)

    # -- serving ---------------------------------------------------------------------------------

    async def refresh(self) -> None:
        for refresher in self._refreshers:
            try:
                await refresher()
            except Exception as exc:  # a store that is away must not fail the whole scrape
                log.warning("%s metrics: a refresh failed, serving the last values: %s", self.role, exc)

    async def render(self) -> bytes:
        """The text exposition (format 0.0.4) of every metric, refreshed first."""
        await self.refresh()
        return generate_latest(self.registry)


def counter_family(name: str, documentation: str, labels: Sequence[str] = (),
                   samples: Iterable[tuple[Sequence[str], float]] = ()) -> CounterMetricFamily:
    """A counter family read from existing counters at scrape time (``name`` without ``_total``)."""
    family = CounterMetricFamily(_check(name), documentation, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def gauge_family(name: str, documentation: str, labels: Sequence[str] = (),
                 samples: Iterable[tuple[Sequence[str], float]] = ()) -> GaugeMetricFamily:
    """A gauge family read from the service's state at scrape time."""
    family = GaugeMetricFamily(_check(name), documentation, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), value)
    return family
