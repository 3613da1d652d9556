"""The inference engine's metrics (docs/metrics.md "Engine"), read at scrape time from its
:class:`~.engine.counters.EngineCounters` (the counting stays there, in one place): blocks and
KV octets reused by source (``local``, ``moqt``, ``http``; ``recomputed`` for the misses) on the
request path, blocks and octets per transport loaded by prefetch directives, fallbacks and load
failures by cause, publication, tokens, and the time to first token.

Served by the instance that runs the engine (``GET {ii}metrics``). Labels take fixed sets.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import HistogramMetricFamily, Metric

from ..common.metrics import DURATION_BUCKETS, counter_family, gauge_family
from .counters import Durations, EngineCounters

__all__ = ["engine_families"]


def engine_families(counters: EngineCounters) -> Iterable[Metric]:
    """The metric families of one engine's counters, as they are now."""
    c = counters
    yield counter_family("kvsp_engine_requests", "Requests served by POST generate (failed ones included)", (),
                         [((), c.requests)])
    yield counter_family("kvsp_engine_failed_requests", "Requests of POST generate that failed", (),
                         [((), c.failed_requests)])
    yield counter_family("kvsp_engine_sessions", "§6.8 session runs (starts and resumes), by result", ("result",),
                         [(("run",), c.sessions), (("failed",), c.failed_sessions)])
    yield counter_family("kvsp_engine_tokens", "Tokens: of prompts, prefilled here, and generated", ("kind",),
                         [(("prompt",), c.prompt_tokens), (("prefilled",), c.prefill_tokens),
                          (("output",), c.output_tokens)])
    yield counter_family("kvsp_engine_prompt_blocks", "Complete prompt blocks (§4.2) of the requests, and how many "
                         "the IS lookup matched", ("result",),
                         [(("total",), c.prompt_blocks), (("matched",), c.lookup_matched)])
    yield counter_family("kvsp_engine_request_blocks", "Prompt blocks of the request path by where their KV came "
                         "from: local (own store), moqt, http, or recomputed (a miss)", ("source",),
                         [(("local",), c.local.blocks), (("moqt",), c.moqt.blocks), (("http",), c.http.blocks),
                          (("recomputed",), c.recomputed_blocks)])
    yield counter_family("kvsp_engine_request_octets", "K and V octets of the reused prompt blocks, by source",
                         ("source",),
                         [(("local",), c.local.octets), (("moqt",), c.moqt.octets), (("http",), c.http.octets)])
    yield counter_family("kvsp_engine_prefetch_blocks", "Blocks loaded by §6.5 prefetch directives, by transport",
                         ("transport",), [(("moqt",), c.prefetch_moqt.blocks), (("http",), c.prefetch_http.blocks)])
    yield counter_family("kvsp_engine_prefetch_octets", "K and V octets loaded by prefetch directives, by transport",
                         ("transport",), [(("moqt",), c.prefetch_moqt.octets), (("http",), c.prefetch_http.octets)])
    yield counter_family("kvsp_engine_load_fallbacks", "Block loads that failed and fell back, by cause "
                         "(moqt_load_failed: a MOQT load failed for some layer and was retried over HTTP; "
                         "lookup_failed: the IS lookup failed or timed out and the prompt was recomputed)",
                         ("cause",), [(("moqt_load_failed",), c.moqt_fallbacks),
                                      (("lookup_failed",), c.lookup_failures)])
    yield counter_family("kvsp_engine_published_blocks", "New complete blocks published, by target (own store + "
                         "IS, HTTP holder, MOQT via the relay)", ("target",),
                         [(("store",), c.published_store), (("holder",), c.published_holder),
                          (("moqt",), c.published_moqt)])
    yield counter_family("kvsp_engine_publish_errors", "Publications of computed blocks that failed", (),
                         [((), c.publish_errors)])
    yield counter_family("kvsp_engine_compute_seconds", "Seconds spent computing, by phase", ("phase",),
                         [(("prefill",), c.prefill_s), (("decode",), c.decode_s)])
    rate = c.decode_rate()
    yield gauge_family("kvsp_engine_decode_tokens_per_second", "Measured decode rate (§6.3 status)", (),
                       [((), rate if rate is not None else float("nan"))])
    yield _histogram("kvsp_engine_ttft_seconds", "Time to first token of each request", c.ttft_ms)


def _histogram(name: str, documentation: str, durations: Durations) -> HistogramMetricFamily:
    """The histogram of ``durations`` over :data:`DURATION_BUCKETS` (kept as it goes, in seconds)."""
    counts = durations.cumulative()
    buckets = [(_le(bound), float(n)) for bound, n in zip(DURATION_BUCKETS, counts, strict=False)]
    buckets.append(("+Inf", float(counts[-1])))
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], buckets, sum_value=durations.sum_ms / 1000)
    return family


def _le(bound: float) -> str:
    return repr(float(bound))
