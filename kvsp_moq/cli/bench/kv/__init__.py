"""``kvsp bench kv``: one KV block into a layer sink (docs/benchmarks.md).

:mod:`.driver` runs the figures; :mod:`.holder` is the holder process
(``python -m kvsp_moq.cli.bench.kv.holder``), :mod:`.loader` the loader
(``python -m kvsp_moq.cli.bench.kv.loader``), :mod:`.parallel` the parallel-load figures,
:mod:`.relayed` the relay rows (relay and holder processes: ``python -m
kvsp_moq.cli.bench.kv.relayed relay|holder``).
"""
