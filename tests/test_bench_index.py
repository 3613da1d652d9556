"""``kvsp bench index`` run as a real process with small sizes: its JSON figures (members,
ratio = value / baseline_value, both measured) and the table. Never asserts on speed."""

from __future__ import annotations

import json

import pytest

from test_cli import kvsp

FIGURES = {
    "is_lookup_http": ("lookups/s", "is_lookup_in_process"),
    "holder_block_get": ("MB/s", "tcp_copy"),
    "holder_block_get_verified": ("MB/s", "tcp_copy"),
}


def test_bench_index_prints_its_figures() -> None:
    proc = kvsp("bench", "index", "--records", "2000", "--block-mib", "2", "--lookups", "10", "--repeat", "1")
    figures = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [f["name"] for f in figures] == list(FIGURES)
    for fig in figures:
        assert {"name", "unit", "value", "baseline_name", "baseline_value", "ratio", "params"} <= fig.keys()
        assert (fig["unit"], fig["baseline_name"]) == FIGURES[fig["name"]]
        assert fig["value"] > 0 and fig["baseline_value"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline_value"], rel=1e-3)
        assert fig["name"] in proc.stderr and fig["baseline_name"] in proc.stderr
    lookup, block = figures[0]["params"], figures[1]["params"]
    assert lookup == {"records": 2000, "prompt_blocks": 64, "layer_digests": 32, "lookups": 10}
    assert block == {"layers": 32, "layer_bytes": 65536}


def test_bench_index_refuses_fewer_records_than_a_prompt() -> None:
    proc = kvsp("bench", "index", "--records", "10", check=False)
    assert proc.returncode == 2 and "--prompt-blocks" in proc.stderr and proc.stdout == ""


REDIS_FIGURES = {
    "is_lookup_http_redis": ("lookups/s", "is_lookup_http"),
    "is_refresh_batched_redis": ("records/s", "is_refresh_single_put_redis"),
    "is_refresh_vs_ttl_redis": ("records/s", "refresh_needed"),
    "is_refresh_vs_ttl_redis_1is": ("records/s", "refresh_needed"),  # through a `kvsp index` process
    "is_refresh_batched_redis_2is": ("records/s", "is_refresh_batched_redis_1is"),
}


def test_bench_index_on_redis_prints_its_figures() -> None:
    """``--store redis`` starts its own redis-server: lookups beside the memory store's, the
    batched refresh beside single PUTs and the rate the TTL needs."""
    proc = kvsp("bench", "index", "--store", "redis", "--records", "2000", "--block-mib", "2", "--lookups", "10",
                "--repeat", "1", "--refresh-records", "600", "--single-puts", "50")
    figures = {f["name"] + "/" + f["baseline_name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    memory = figures["is_lookup_http/is_lookup_in_process"]
    for name, (unit, baseline) in REDIS_FIGURES.items():
        fig = figures[f"{name}/{baseline}"]
        assert fig["unit"] == unit and fig["value"] > 0 and fig["baseline_value"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline_value"], rel=1e-3)
    assert figures["is_lookup_http_redis/is_lookup_http"]["baseline_value"] == memory["value"]
    assert figures["is_refresh_vs_ttl_redis/refresh_needed"]["baseline_value"] == pytest.approx(600 / 20)
    assert figures["is_refresh_vs_ttl_redis/refresh_needed"]["params"] == {
        "records": 600, "batch": 256, "single_puts": 50, "ttl_ms": 60_000, "layer_digests": 32, "holders": 4}


def test_bench_index_redis_url_needs_the_redis_store() -> None:
    proc = kvsp("bench", "index", "--redis-url", "redis://127.0.0.1:1/0", check=False)
    assert proc.returncode == 2 and "--store redis" in proc.stderr and proc.stdout == ""
