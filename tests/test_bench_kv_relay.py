"""``kvsp bench kv``'s relay rows (issue 16) as real processes with small sizes: the relay and
the holder attached to it each in its own process (``kv.relayed``), cold and warm figures, and
each against the direct row of the same backend and datagram size from the same run. Never
asserts on speed."""

from __future__ import annotations

import json

import pytest

from test_cli import kvsp


def test_bench_kv_relay_rows_beside_direct() -> None:
    pytest.importorskip("torch")
    proc = kvsp("bench", "kv", "--layers", "2", "--repeat", "1", "--no-http")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    direct = "kv_aioquic_dgram16384"
    for path in ("relay_cold", "relay_warm"):
        block = figures[f"kv_{path}_block"]
        assert block["baseline_name"] == "tcp_copy" and block["value"] > 0
        assert block["params"]["relay"] == "own process"
        first = figures[f"kv_{path}_vs_direct_first_layer"]
        rate = figures[f"kv_{path}_vs_direct_rate"]
        assert first["baseline_name"] == f"{direct}_first_layer"
        assert first["baseline_value"] == figures[f"{direct}_first_layer"]["value"]
        assert rate["baseline_name"] == f"{direct}_rate"
        assert rate["value"] == figures[f"kv_{path}_rate"]["value"]
        assert rate["baseline_value"] == figures[f"{direct}_rate"]["value"]
