"""``kvsp bench wan``: block load across an emulated WAN path, MOQT vs HTTP over TCP.

Two network namespaces joined by a veth pair, each end shaped with ``tc qdisc add dev ...
root netem delay D loss L%`` (so the round trip is 2 D and each direction loses L %). The
holder (``bench_kv_holder``: MOQT and HTTP on the same store) runs in one namespace, the
loader (``bench_kv_loader``: MOQT FETCH into a torch sink with every layer verified, and the
HTTP GET of the same container with its Repr-Digest) in the other. Figures: time to the
first layer and to the whole block over MOQT, each against the same figure over HTTP/TCP on
the same path in the same run.

Needs root (network namespaces, tc) and iproute2 with the netem qdisc; otherwise it skips
with a message saying why. The namespaces (and with them the veth pair) are deleted on every
exit path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ..bench.report import Figure
from .bench_kv import check_backends, start_holder, stop_holder

__all__ = ["Skip", "run", "wan_path"]

_HOLDER_IP, _LOADER_IP = "10.211.0.1", "10.211.0.2"


class Skip(Exception):
    """The WAN path cannot be built here (not root, no iproute2, no netem)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise Skip(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


@contextmanager
def wan_path(delay_ms: float, loss_pct: float, mtu: int = 1500) -> Iterator[tuple[str, str]]:
    """Two namespaces (holder, loader) joined by a netem-shaped veth pair; deleted on exit."""
    if delay_ms < 0 or not 0 <= loss_pct <= 100:
        raise ValueError("delay must be >= 0 ms and loss in [0, 100] %")
    if os.geteuid() != 0:
        raise Skip("needs root (network namespaces and tc): run it as root, e.g. in a CI container")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise Skip(f"needs iproute2 (`{tool}` not found)")
    tag = f"{os.getpid() % 100000}"
    ns_h, ns_l = f"kvsp-wan-h{tag}", f"kvsp-wan-l{tag}"
    created: list[str] = []
    try:
        for ns in (ns_h, ns_l):
            _ip("netns", "add", ns)
            created.append(ns)
        # veth names are <= 15 characters; created in the holder namespace, moved across.
        _ip("-n", ns_h, "link", "add", "wanh", "type", "veth", "peer", "name", "wanl")
        _ip("-n", ns_h, "link", "set", "wanl", "netns", ns_l)
        for ns, dev, addr in ((ns_h, "wanh", _HOLDER_IP), (ns_l, "wanl", _LOADER_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", str(mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if not delay_ms and not loss_pct:
                continue  # an unshaped veth path (--delay-ms 0 --loss 0): no netem needed
            shaped = subprocess.run(
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay",
                 f"{delay_ms}ms", "loss", f"{loss_pct}%", "limit", "100000"],
                capture_output=True, text=True)
            if shaped.returncode != 0:
                raise Skip(f"tc netem unavailable: {shaped.stderr.strip()}")
        yield ns_h, ns_l
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair, hence both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(layers: int = 32, layer_bytes: int = 1 << 20, datagram_size: int = 1452,
        backend: str = "aioquic", delay_ms: float = 20.0, loss_pct: float = 0.5,
        repeat: int = 3) -> list[Figure]:
    """The figures, or [] after printing why the bench was skipped (stderr)."""
    check_backends((backend,))
    try:
        with wan_path(delay_ms, loss_pct, mtu=max(1500, datagram_size + 28)) as (ns_h, ns_l):
            proc, info = start_holder(layers, layer_bytes, datagram_size, backend,
                                      host=_HOLDER_IP, prefix=("ip", "netns", "exec", ns_h))
            try:
                done = subprocess.run(
                    ["ip", "netns", "exec", ns_l, sys.executable, "-m",
                     "kvsp_moq.cli.bench_kv_loader", "--info", info.to_line(), "--backend",
                     backend, "--datagram-size", str(datagram_size), "--repeat", str(repeat)],
                    capture_output=True, text=True, check=True)
            finally:
                stop_holder(proc)
    except Skip as exc:
        print(f"kvsp bench wan: skipped: {exc}", file=sys.stderr)
        return []
    got = json.loads(done.stdout.strip().splitlines()[-1])
    params = {"layers": layers, "layer_bytes": layer_bytes, "backend": backend,
              "max_datagram_size": datagram_size, "netem_delay_ms_each_way": delay_ms,
              "netem_loss_pct_each_way": loss_pct, "rtt_ms": 2 * delay_ms}
    (m_first, m_block), (h_first, h_block) = got["moqt"], got["http"]
    block = layers * layer_bytes
    return [
        Figure("wan_moqt_first_layer", "ms", m_first * 1e3, "wan_http_first_layer", h_first * 1e3, params=params),
        Figure("wan_moqt_block", "ms", m_block * 1e3, "wan_http_block", h_block * 1e3, params=params),
        Figure("wan_moqt_rate", "MB/s", block / m_block / 1e6, "wan_http_rate", block / h_block / 1e6, params=params),
    ]
