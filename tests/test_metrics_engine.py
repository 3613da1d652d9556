"""``GET {ii}metrics`` of an instance running the reference model (docs/metrics.md "Engine"):
the engine's own counters (``engine/counters.py``) exposed, after real requests against a real
IS, HTTP holder and MOQT relay (the cluster of tests/test_engine.py): blocks and octets by
source, the MOQT-to-HTTP fallback by cause, publication and the time to first token."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

import pytest

torch = pytest.importorskip("torch")

from test_engine import TOKEN, Cluster, cluster, engine_of, everyone, model_dir, request, within  # noqa: E402,F401


async def scrape(c: Cluster, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_engine_counters_by_source_fallbacks_and_ttft(cluster: Cluster) -> None:
    a = await cluster.instance()
    b = await cluster.instance()
    cold = await within(engine_of(a).generate(everyone(), request()))
    blocks = len(cold.blocks)
    await engine_of(a).moqt_holder.close()  # the MOQT origin leaves: b's MOQT loads fail, HTTP serves
    warm = await within(engine_of(b).generate(everyone(), request()))
    assert [blk.source for blk in warm.blocks] == ["http"] * blocks

    ma = await scrape(cluster, a.url)
    assert ma[("kvsp_engine_requests_total", ())] == 1
    assert ma[("kvsp_engine_request_blocks_total", (("source", "recomputed"),))] == blocks
    assert ma[("kvsp_engine_request_blocks_total", (("source", "http"),))] == 0
    for target in ("store", "holder", "moqt"):
        assert ma[("kvsp_engine_published_blocks_total", (("target", target),))] == blocks
    assert ma[("kvsp_engine_ttft_seconds_count", ())] == 1

    mb = await scrape(cluster, b.url)
    counters = engine_of(b).counters
    assert mb[("kvsp_engine_request_blocks_total", (("source", "http"),))] == blocks
    assert mb[("kvsp_engine_request_blocks_total", (("source", "recomputed"),))] == 0
    assert mb[("kvsp_engine_request_octets_total", (("source", "http"),))] == counters.http.octets > 0
    assert mb[("kvsp_engine_load_fallbacks_total", (("cause", "moqt_load_failed"),))] == counters.moqt_fallbacks >= 1
    assert mb[("kvsp_engine_prompt_blocks_total", (("result", "matched"),))] == blocks
    assert mb[("kvsp_engine_ttft_seconds_sum", ())] == pytest.approx(sum(counters.ttft_ms) / 1000)
    # the instance's own metrics are served beside the engine's
    assert mb[("kvsp_instance_state", (("state", "active"),))] == 1


def test_ttft_durations_stay_bounded_and_the_histogram_counts_all_of_them() -> None:
    """A long-lived instance's times to first token: the histogram counts every request (the
    same buckets as from the whole list, at and under each bound), the JSON keeps the latest."""
    from kvsp_moq.control.common.metrics import DURATION_BUCKETS
    from kvsp_moq.control.engine.counters import RECENT_DURATIONS, Durations

    values = [(i * 7919 % 120_001) / 2 for i in range(3 * RECENT_DURATIONS)]  # 0 ... 60 s, bounds included
    values += [b * 1000 for b in DURATION_BUCKETS] + [90_000.0]
    d = Durations()
    for v in values:
        d.append(v)
    assert d.count == len(values) and d.sum_ms == pytest.approx(sum(values))
    assert list(d) == values[-RECENT_DURATIONS:] and len(d) == RECENT_DURATIONS
    want = [sum(1 for v in values if v / 1000 <= b) for b in DURATION_BUCKETS] + [len(values)]
    assert d.cumulative() == want
