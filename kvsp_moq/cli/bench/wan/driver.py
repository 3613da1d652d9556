"""``kvsp bench wan``: block load across an emulated WAN path, MOQT vs HTTP over TCP.

Two network namespaces joined by a shaped link (``.path``): delay D and loss L % on
each direction (so the round trip is 2 D), by the kernel's ``tc ... netem`` on a veth pair or,
on kernels without ``sch_netem``, by the userspace TUN shaper (``.shaper``), which
emulates the same netem options per direction at the IP level. The holder (``kv.holder``:
MOQT and HTTP on the same store) runs in one namespace, the loader (``kv.loader``: MOQT
FETCH into a torch sink with every layer verified, and the HTTP GET of the same container with
its Repr-Digest) in the other. Figures: time to the first layer and to the whole block over
MOQT, each against the same figure over HTTP/TCP on the same path in the same run; the params
say which shaper was used (and, for the TUN shaper, its counters) and which QUIC congestion
controller the MOQT endpoints ran (``congestion_control``). Several losses (``--loss
0.5,0``): one path each, in turn; several controllers (``--congestion-control
reno,cubic,bbr``): one MOQT load each on every path, all against that path's one HTTP load.

Needs root and iproute2, and netem or ``/dev/net/tun``; otherwise it skips with a message
saying why. The namespaces, devices and processes are removed on every exit path, SIGTERM
included (it is turned into an exception for the duration of the run).
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from ....bench.report import Figure
from ....transport import TransportConfig
from ..kv.driver import check_backends, start_holder, stop_holder
from .codec import check_codecs, codec_figures, load_codecs
from .path import HOLDER_IP, SHAPERS, Skip, WanPath, wan_path
from ...core import UsageError

__all__ = ["SHAPERS", "Skip", "WanPath", "run", "wan_path"]


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit (so the ``finally`` blocks remove the path) while inside."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: What a backend runs when ``congestion_control`` is not given (the params name it).
_DEFAULT_CC = {"aioquic": "bbr", "qh3": "built-in", "aiopquic": "bbr1", "native": "bbr"}


def _check_congestion_control(backend: str, name: str) -> None:
    """UsageError where ``backend`` would refuse ``name`` (its ``configure`` decides)."""
    if backend not in ("aioquic", "qh3"):
        return  # aiopquic checks picoquic's names when it connects
    module = importlib.import_module(f"kvsp_moq.transport.{backend}_backend")
    config = TransportConfig(backend=backend, congestion_control_algorithm=name)
    try:
        module.LIBRARY.configure(module.LIBRARY.QuicConfiguration(is_client=True), config)
    except ValueError as exc:
        raise UsageError(f"--congestion-control {name}: {exc}") from None


def _load(path: WanPath, layers: int, layer_bytes: int, datagram_size: int, backend: str,
          repeat: int, sink: str, congestion_control: str | None,
          http: bool) -> dict[str, list[float]]:
    proc, info = start_holder(layers, layer_bytes, datagram_size, backend, host=HOLDER_IP,
                              prefix=("ip", "netns", "exec", path.holder_ns),
                              congestion_control=congestion_control)
    cc = ("--congestion-control", congestion_control) if congestion_control else ()
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", path.loader_ns, sys.executable, "-m",
             "kvsp_moq.cli.bench.kv.loader", "--info", info.to_line(), "--backend", backend,
             "--datagram-size", str(datagram_size), "--repeat", str(repeat), "--sink", sink,
             *cc, *(() if http else ("--no-http",))],
            stdout=subprocess.PIPE, text=True, check=True)
    finally:
        stop_holder(proc)
    got: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def run(layers: int = 32, layer_bytes: int = 1 << 20, datagram_size: int = 1452,
        backend: str = "aioquic", delay_ms: float = 20.0,
        loss_pct: float | Sequence[float] = 0.5, repeat: int = 3, shaper: str = "auto",
        seed: int = 1, tcp_cc: str | None = None, sink: str = "torch",
        congestion_controls: Sequence[str | None] = (None,),
        codecs: Sequence[str] = ()) -> list[Figure]:
    """The figures, or [] after printing why the bench was skipped (stderr). ``sink``:
    the loader's layer sink, ``torch`` (CPU tensors) or ``numpy`` (where torch is not
    installed, e.g. a Python that only the aiopquic backend runs on). One path per loss in
    ``loss_pct``; on each, one MOQT load per QUIC congestion controller in
    ``congestion_controls`` (None: the backend's default) and one HTTP load, the baseline of
    that path's MOQT figures. ``codecs``: also, on each path, the effective KV rate of each
    codec (HTTP ``codec=n`` from a transcoding holder) beside raw HTTP (:mod:`.codec`)."""
    check_backends((backend,))
    check_codecs(codecs)
    if sink not in ("torch", "numpy"):
        raise UsageError(f"--sink {sink!r}: torch or numpy")
    if shaper not in SHAPERS:
        raise UsageError(f"--shaper {shaper!r}: one of {', '.join(SHAPERS)}")
    losses = (loss_pct,) if isinstance(loss_pct, (int, float)) else tuple(loss_pct)
    ccs = tuple(congestion_controls) or (None,)
    for cc in ccs:
        if cc is not None:  # refused before any path is built (an unknown name, qh3)
            _check_congestion_control(backend, cc)
    figures: list[Figure] = []
    for loss in losses:
        got = _one_path(layers, layer_bytes, datagram_size, backend, delay_ms, loss, repeat,
                        shaper, seed, tcp_cc, sink, ccs, tuple(codecs))
        if got is None:
            return []
        figures += got
    return figures


def _one_path(layers: int, layer_bytes: int, datagram_size: int, backend: str, delay_ms: float,
              loss_pct: float, repeat: int, shaper: str, seed: int, tcp_cc: str | None,
              sink: str, ccs: tuple[str | None, ...], codecs: tuple[str, ...] = ()) -> list[Figure] | None:
    try:
        with _sigterm_unwinds(), wan_path(delay_ms, loss_pct, mtu=max(1500, datagram_size + 28),
                                          shaper=shaper, seed=seed, tcp_cc=tcp_cc) as path:
            print(f"kvsp bench wan: path up ({path.shaper}): {path.holder_ns} <-> "
                  f"{path.loader_ns}, {delay_ms} ms and {loss_pct} % each way, TCP "
                  f"{path.tcp_congestion_control}", file=sys.stderr, flush=True)
            loads = [_load(path, layers, layer_bytes, datagram_size, backend, repeat, sink, cc,
                           http=i == 0) for i, cc in enumerate(ccs)]
            coded = load_codecs(path, layers, layer_bytes, codecs, repeat, (backend, datagram_size, ccs[0])) \
                if codecs else None
    except Skip as exc:
        print(f"kvsp bench wan: skipped: {exc}", file=sys.stderr)
        return None
    base: dict[str, object] = {
        "layers": layers, "layer_bytes": layer_bytes, "backend": backend,
        "max_datagram_size": datagram_size, "shaper": path.shaper, "delay_ms_each_way": delay_ms,
        "loss_pct_each_way": loss_pct, "rtt_ms": 2 * delay_ms,
        "tcp_congestion_control": path.tcp_congestion_control, "sink": sink}
    if path.shaper == "tun":  # holder to loader is a_to_b: the block's direction
        base["shaper_seed"] = seed
        base["shaper_counters"] = {"holder_to_loader": path.counters.get("a_to_b"),
                                   "loader_to_holder": path.counters.get("b_to_a")}
    h_first, h_block = loads[0]["http"]
    block = layers * layer_bytes
    figures = []
    for cc, got in zip(ccs, loads):
        params = {**base, "congestion_control": cc or _DEFAULT_CC.get(backend, "default")}
        m_first, m_block = got["moqt"]
        figures += [
            Figure("wan_moqt_first_layer", "ms", m_first * 1e3, "wan_http_first_layer", h_first * 1e3, params=params),
            Figure("wan_moqt_block", "ms", m_block * 1e3, "wan_http_block", h_block * 1e3, params=params),
            Figure("wan_moqt_rate", "MB/s", block / m_block / 1e6, "wan_http_rate", block / h_block / 1e6, params=params),
        ]
    if coded is not None:
        figures += codec_figures(*coded, codecs, base, {"congestion_control": ccs[0] or _DEFAULT_CC.get(backend, "default")})
    return figures
