"""``kvsp bench wan``: MOQT vs HTTP across two network namespaces joined by a shaped link
(docs/benchmarks.md).

:mod:`.driver` runs the figures over :mod:`.path` (the namespaces and the link: tc netem on a
veth pair, or the userspace TUN shaper :mod:`.shaper`, ``python -m
kvsp_moq.cli.bench.wan.shaper``, built on :mod:`.tun` and :mod:`.netem`).
"""
