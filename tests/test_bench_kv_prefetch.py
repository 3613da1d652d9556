"""``kvsp bench kv``'s prefetch rows (issue 16) as real processes: a relay process and a holder
process (``kv.relayed relay``, ``kv.prefetch holder``), the instance's MOQT retriever landing a
directive's worth of blocks in a store and, for comparison, assembling containers; each row
beside the same run's TCP copy and the landing beside the container path. Never asserts on speed."""

from __future__ import annotations

import json

from test_cli import kvsp


def test_bench_kv_prefetch_rows_beside_tcp_and_each_other() -> None:
    proc = kvsp("bench", "kv", "--prefetch-only", "--repeat", "1", "--prefetch-window", "3")
    figures = {f["name"]: f for f in map(json.loads, proc.stdout.splitlines())}
    assert set(figures) == {"kv_prefetch_land", "kv_prefetch_container", "kv_prefetch_land_vs_container"}
    land, container, versus = (figures[n] for n in ("kv_prefetch_land", "kv_prefetch_container",
                                                    "kv_prefetch_land_vs_container"))
    assert land["baseline_name"] == container["baseline_name"] == "tcp_copy"
    assert land["value"] > 0 and container["value"] > 0 and land["baseline_value"] > 0
    assert versus["value"] == land["value"] and versus["baseline_value"] == container["value"]
    assert land["params"]["window"] == 3 and land["params"]["blocks"] == 12
    assert land["params"]["layer_bytes"] == 32768 and land["params"]["relay"] == "own process, cold"
