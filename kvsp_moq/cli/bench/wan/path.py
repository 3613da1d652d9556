"""The emulated WAN path of ``kvsp bench wan``: two network namespaces (holder, loader) joined
by a shaped link, built on entry and removed on every exit path.

Shapers (``shaper``):

* ``netem``: a veth pair, each end shaped by ``tc qdisc add dev ... root netem delay D loss L%
  limit 100000`` (the kernel's ``sch_netem``); with D = 0 and L = 0 the veth pair unshaped
  (reported as ``none``);
* ``tun``: two TUN devices joined by the userspace shaper process (``.shaper``), which
  applies the same delay / loss / limit per direction; for kernels without ``sch_netem``;
* ``auto``: ``netem`` when the kernel has it (tried on the holder namespace's loopback), or
  when the path is unshaped; ``tun`` otherwise.

Either way each direction has delay D and loss L %, so the round trip is 2 D. TCP's congestion
control between the ends is the host's default (a namespace inherits it) unless ``tcp_cc``
names another (set on the routes between them); :attr:`WanPath.tcp_congestion_control` says
which one the HTTP baseline ran with (it decides much of a lossy path's TCP figure: BBR
ignores random loss, Reno and CUBIC back off on it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HOLDER_IP", "LOADER_IP", "SHAPERS", "Skip", "WanPath", "wan_path"]

HOLDER_IP, LOADER_IP = "10.211.0.1", "10.211.0.2"
SHAPERS = ("auto", "netem", "tun")
_NETEM_LIMIT = 100_000  # packets queued per direction: never the bottleneck at 20 ms


class Skip(Exception):
    """The WAN path cannot be built here (not root, no iproute2, no netem nor TUN)."""


@dataclass
class WanPath:
    """The namespaces, how the path between them is shaped (``netem``, ``tun``, ``none``),
    TCP's congestion control in them; for ``tun``, the shaper's counters once it has stopped
    (after the ``with`` block)."""

    holder_ns: str
    loader_ns: str
    shaper: str
    tcp_congestion_control: str = ""
    counters: dict[str, Any] = field(default_factory=dict)


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise Skip(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _tcp_cc(path: WanPath, name: str | None) -> None:
    """Make ``name`` TCP's congestion control between the two ends, or note the default.

    Per route (``ip route ... congctl NAME``, RTAX_CC_ALGO): the per-namespace sysctl only
    takes what the host lists in ``net.ipv4.tcp_allowed_congestion_control``, a route any
    algorithm the kernel has, and it leaves the host's settings alone."""
    if not name:
        default = _ip("netns", "exec", path.holder_ns, "cat",
                          "/proc/sys/net/ipv4/tcp_congestion_control")
        path.tcp_congestion_control = default.strip()
        return
    for ns, peer in ((path.holder_ns, LOADER_IP), (path.loader_ns, HOLDER_IP)):
        dev = json.loads(_ip("-n", ns, "-j", "route", "get", peer))[0]["dev"]
        _ip("-n", ns, "route", "replace", f"{peer}/32", "dev", dev, "congctl", name)
    path.tcp_congestion_control = name


def _netem(ns: str, dev: str, delay_ms: float, loss_pct: float) -> str | None:
    """Shape ``dev`` in ``ns`` with netem; None, or why it could not (tc's message)."""
    if shutil.which("tc") is None:
        return "needs iproute2's `tc` for netem (not found)"
    done = subprocess.run(
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms",
         "loss", f"{loss_pct}%", "limit", str(_NETEM_LIMIT)], capture_output=True, text=True)
    return None if done.returncode == 0 else f"tc netem unavailable: {done.stderr.strip()}"


def _netem_works(ns: str) -> bool:
    """Whether this kernel has sch_netem: a netem qdisc on ``ns``'s loopback, removed again."""
    if _netem(ns, "lo", 0, 0) is not None:
        return False
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return True


def _veth(path: WanPath, delay_ms: float, loss_pct: float, mtu: int) -> None:
    ns_h, ns_l = path.holder_ns, path.loader_ns
    # veth names are <= 15 characters; created in the holder namespace, moved across.
    _ip("-n", ns_h, "link", "add", "wanh", "type", "veth", "peer", "name", "wanl")
    _ip("-n", ns_h, "link", "set", "wanl", "netns", ns_l)
    for ns, dev, addr in ((ns_h, "wanh", HOLDER_IP), (ns_l, "wanl", LOADER_IP)):
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "mtu", str(mtu), "up")
        if path.shaper == "netem" and (why := _netem(ns, dev, delay_ms, loss_pct)) is not None:
            raise Skip(why)


@contextmanager
def _tun_shaper(path: WanPath, delay_ms: float, loss_pct: float, mtu: int,
                seed: int) -> Iterator[None]:
    """The shaper process between the namespaces; stopped (stdin closed) on exit, its
    counters then in ``path.counters``."""
    if not os.path.exists("/dev/net/tun"):
        raise Skip("no netem in this kernel and no /dev/net/tun for the userspace shaper")
    errors = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the shaper runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsp_moq.cli.bench.wan.shaper", "--ns-a", path.holder_ns,
         "--addr-a", HOLDER_IP, "--ns-b", path.loader_ns, "--addr-b", LOADER_IP, "--delay-ms",
         str(delay_ms), "--loss", str(loss_pct), "--limit", str(_NETEM_LIMIT), "--seed",
         str(seed), "--mtu", str(mtu)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
    assert proc.stdout is not None
    try:
        if not proc.stdout.readline().startswith('{"ready"'):
            proc.communicate(timeout=30)
            errors.seek(0)
            raise Skip(f"the TUN shaper did not start: {errors.read().decode().strip()}")
        yield
    finally:
        if proc.returncode is None:
            try:  # closes its stdin: it drains its queues (at most the delay) and reports
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()  # its devices go with its descriptors
                out, _ = proc.communicate()
            try:
                path.counters = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                pass  # interrupted before it could report: no counters
            errors.seek(0)
            if said := errors.read().decode(errors="replace").strip():
                print(f"kvsp bench wan: the TUN shaper said: {said}", file=sys.stderr)
        errors.close()


@contextmanager
def wan_path(delay_ms: float, loss_pct: float, mtu: int = 1500, shaper: str = "auto",
             seed: int = 1, tcp_cc: str | None = None) -> Iterator[WanPath]:
    """Two namespaces (holder at :data:`HOLDER_IP`, loader at :data:`LOADER_IP`) joined by
    a path shaped by ``shaper`` (see the module docstring); all of it removed on exit."""
    if delay_ms < 0 or not 0 <= loss_pct <= 100:
        raise ValueError("delay must be >= 0 ms and loss in [0, 100] %")
    if shaper not in SHAPERS:
        raise ValueError(f"shaper {shaper!r}: one of {', '.join(SHAPERS)}")
    if os.geteuid() != 0:
        raise Skip("needs root (network namespaces, tc or TUN): run it as root, e.g. in a CI container")
    if shutil.which("ip") is None:
        raise Skip("needs iproute2 (`ip` not found)")
    tag = f"{os.getpid() % 100000}"
    path = WanPath(f"kvsp-wan-h{tag}", f"kvsp-wan-l{tag}", shaper)
    created: list[str] = []
    try:
        for ns in (path.holder_ns, path.loader_ns):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        unshaped = not delay_ms and not loss_pct
        if shaper == "auto":
            path.shaper = "netem" if unshaped or _netem_works(path.holder_ns) else "tun"
        if path.shaper == "netem" and unshaped:
            path.shaper = "none"  # an unshaped veth path: no netem needed
        with ExitStack() as stack:
            if path.shaper == "tun":
                stack.enter_context(_tun_shaper(path, delay_ms, loss_pct, mtu, seed))
            else:
                _veth(path, delay_ms, loss_pct, mtu)
            _tcp_cc(path, tcp_cc)
            yield path
    finally:
        for ns in created:  # deleting a namespace deletes the devices in it (veth: both ends)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
