"""``kvsp bench kv``: loading one KV block (default 32 layers x 1 MiB) into torch buffers.

Figures, all from one run, each against a baseline measured in the same run (a raw TCP socket
copy of the same bytes over loopback, ``bench.baseline.tcp_copy``):

* MOQT direct, per transport backend and QUIC max datagram size
  (``kv_{backend}_dgram{size}_first_layer`` / ``_block``): the holder runs in its own process
  (``kv.holder``, as a real holder would), the loader here does ``load_block`` into a
  torch sink (CPU, or ``device`` "cuda[:i]": pinned staging then a device copy, timed to
  the copy's completion), every layer verified against the record's digest (binding v1): time to the
  first verified layer and to the whole verified block; ``params.loader_cpu_s_per_gib``: the
  CPU seconds the loader process (all its threads) spent per GiB delivered, best run;
* HTTP GET of the same block from the same holder process (``kv_http_*``: the KVB1 container,
  §6.7, plain HTTP/1.1 client on asyncio streams into one buffer, SHA-256 of the body);
* through the relay (``.relayed``: relay and holder each in its own process, first backend,
  largest datagram size), cold (a miss: the relay FETCHes upstream, cut through) and warm
  (served from its cache), and each of them against that direct row
  (``kv_relay_{cold,warm}_vs_direct_{first_layer,rate}``);
* with ``parallel`` (issue 9, ``.parallel``): the block split into N layer ranges,
  each over its own QUIC connection, in-process (``connections``) or in N worker processes
  (``processes``) writing into a shared-memory torch buffer, from the same holder process:
  ``kv_{path}_par{N}_{kind}_rate`` (MB/s vs the TCP copy) and ``..._vs_par1`` (MB/s vs N = 1
  of the same kind, same run);
* prefetch (issue 16, ``.prefetch``): a directive's worth of small blocks (the demo's 12 x
  4 x 32 KiB) through a relay process from a holder process, ``prefetch_window`` in flight on
  one session, landed straight in a store (``kv_prefetch_land``) and through a container as
  before (``kv_prefetch_container``), against the TCP copy and against each other.
* Mooncake Transfer Engine's TCP transport (issue 28, ``.mooncake``), where its package is
  installed: the same block read with one ``transfer_sync_read`` from a target engine in its
  own process (``kv_mooncake_tcp_block`` / ``_rate`` against the TCP copy); elsewhere a line on
  stderr says why the row was skipped.

This module lives in ``kvsp_moq.cli`` (not ``kvsp_moq.bench``) because it starts the relay
and the HTTP holder: ``kvsp_moq.bench`` may not import ``kvsp_moq.control`` or ``relay``
(tests/test_layering.py). Sessions are connected before the clock starts (we time the block,
not the handshake). Both processes ``gc.freeze()`` their heap after setup (docs/perf/README.md).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np

from ....bench.baseline import tcp_copy
from ....bench.report import Figure
from ....transport import TransportConfig, new_event_loop
from ....transport.config import BACKENDS
from .holder import HolderInfo, freeze_heap, geometry
from .loader import Timing, measure
from .mooncake import MooncakeTiming, measure_mooncake
from .parallel import KINDS, ParallelTiming, measure_parallel
from .relayed import measure_relay, stop_process
from ...core import UsageError

__all__ = ["check_backends", "check_device", "run", "start_holder"]


def check_backends(backends: tuple[str, ...]) -> None:
    """UsageError naming the backends this build's transport has, for any other."""
    for backend in backends:
        if backend not in BACKENDS:
            raise UsageError(f"transport backend {backend!r} is not available in this build "
                             f"(kvsp_moq.transport knows {', '.join(BACKENDS)})")


def check_device(device: str) -> str:
    """The sink's name in the figures' params for the torch ``device`` ("cpu", "cuda[:i]");
    UsageError for another device or for CUDA where torch has none."""
    from ....sinks import SinkError, import_torch

    try:
        torch = import_torch()
    except SinkError as exc:
        raise UsageError(f"bench kv loads into torch buffers: {exc}") from None
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {device!r}: {exc}") from None
    if dev.type == "cpu":
        return "torch-cpu"
    if dev.type != "cuda":
        raise UsageError(f"--device {device!r}: cpu or cuda[:i]")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: this torch has no CUDA device")
    return f"torch-{device} (pinned staging)"


def start_holder(layers: int, layer_bytes: int, datagram_size: int, backend: str,
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 congestion_control: str | None = None
                 ) -> tuple[subprocess.Popen[str], HolderInfo]:
    """Start ``kv.holder`` (behind ``prefix``, e.g. ``ip netns exec NS``; its MOQT sender
    with ``congestion_control`` where given); return the process (it serves until its stdin
    is closed) and its :class:`HolderInfo`."""
    cc = ("--congestion-control", congestion_control) if congestion_control else ()
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvsp_moq.cli.bench.kv.holder", "--host", host,
         "--layers", str(layers), "--layer-mib", str(layer_bytes >> 20), "--datagram-size",
         str(datagram_size), "--backend", backend, *cc],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
    except BaseException:  # interrupted (e.g. SIGTERM in ``bench wan``): no holder left behind
        stop_holder(proc)
        raise
    if not line.startswith("{"):
        stop_holder(proc)
        raise RuntimeError(f"the holder process did not start (exit {proc.returncode})")
    return proc, HolderInfo.from_line(line)


def stop_holder(proc: subprocess.Popen[str]) -> None:
    stop_process(proc)


def _relay_vs_direct(got: dict[str, tuple[Timing, dict[str, Any]]], block: int) -> list[Figure]:
    """Each relay row against the direct row of its backend and datagram size, same run
    (issue 16's targets: cold first layer <= direct + 10 ms, cold rate >= 0.8 x direct, warm
    rate >= direct)."""
    out = []
    for path in ("relay_cold", "relay_warm"):
        if path not in got:
            continue
        (first, whole), params = got[path]
        direct = params["direct"]
        (d_first, d_whole), _ = got[direct]
        out.append(Figure(f"kv_{path}_vs_direct_first_layer", "ms", first * 1e3,
                          f"kv_{direct}_first_layer", d_first * 1e3, params=params))
        out.append(Figure(f"kv_{path}_vs_direct_rate", "MB/s", block / whole / 1e6,
                          f"kv_{direct}_rate", block / d_whole / 1e6, params=params))
    return out


def _mooncake_figures(peer: MooncakeTiming, layers: int, layer_bytes: int,
                      tcp_s: float) -> list[Figure]:
    """The Mooncake row (block time and rate) against the TCP copy of the same run."""
    block = layers * layer_bytes
    params = {"layers": layers, "layer_bytes": layer_bytes,
              "peer": f"mooncake-transfer-engine {peer.version}", "transport": "tcp",
              "target": "own process", "reader": "own process",
              "sink": "numpy (registered memory)", "handshake": "excluded (warm-up read)",
              "verify": "SHA-256 of the block after the clock (not per layer)",
              "loader_cpu_s_per_gib": round(peer.cpu_s / (block / (1 << 30)), 3)}
    return [Figure("kv_mooncake_tcp_block", "ms", peer.block_s * 1e3, "tcp_copy", tcp_s * 1e3,
                   params=params),
            Figure("kv_mooncake_tcp_rate", "MB/s", block / peer.block_s / 1e6, "tcp_copy",
                   block / tcp_s / 1e6, params=params)]


def run(layers: int = 32, layer_bytes: int = 1 << 20, datagram_sizes: tuple[int, ...] = (16384,),
        backends: tuple[str, ...] = ("aioquic",), repeat: int = 3, http: bool = True,
        relay: bool = True, parallel: tuple[int, ...] = (),
        workers: tuple[str, ...] = ("connections",), device: str = "cpu",
        holders: int = 1, prefetch_window: int | None = 4, mooncake: bool = True) -> list[Figure]:
    """Every figure of the module docstring; ``prefetch_window`` None skips the prefetch rows
    (``.prefetch``: a directive's worth of small blocks through a relay, that many in flight);
    ``mooncake`` False skips the Mooncake row (``.mooncake``)."""
    check_backends(backends)
    sink = check_device(device)
    for kind in workers:
        if kind not in KINDS:
            raise UsageError(f"--workers {kind!r}: one of {', '.join(KINDS)}")
    if holders < 1 or (holders > 1 and not parallel):
        raise UsageError("--holders: N >= 1, and more than one only with --parallel")
    if any(n < 1 for n in parallel):
        raise UsageError("--parallel: every N must be >= 1")
    if parallel and 1 not in parallel:
        parallel = (1, *parallel)  # N = 1 is the baseline of every N
    parallel = tuple(sorted(set(parallel)))
    if layer_bytes % (1 << 20):
        raise UsageError("the layer size must be a whole number of MiB")
    block = layers * layer_bytes
    data = np.random.default_rng(2).integers(0, 256, block, dtype=np.uint8).tobytes()
    tcp = min((tcp_copy(data, layer_bytes) for _ in range(max(repeat, 3))), key=lambda t: t[0])
    del data
    from ....sinks import import_torch

    import_torch()
    freeze_heap()
    got: dict[str, tuple[Timing, dict[str, Any]]] = {}
    par: dict[str, dict[tuple[int, str], ParallelTiming]] = {}
    loop = new_event_loop(use_uvloop=True)
    try:
        for backend in backends:
            for size in datagram_sizes:
                params: dict[str, Any] = {"layers": layers, "layer_bytes": layer_bytes,
                                          "backend": backend, "max_datagram_size": size,
                                          "sink": sink, "holder": "own process"}
                proc, info = start_holder(layers, layer_bytes, size, backend)
                extra: list[subprocess.Popen[str]] = []
                try:
                    config = TransportConfig(backend=backend, insecure=True, max_datagram_size=size)
                    want_http = http and "http" not in got
                    cpu: dict[str, float] = {}
                    res = loop.run_until_complete(measure(info, config, repeat, want_http,
                                                          device=device, cpu=cpu))
                    # The loader's CPU (all its threads) per GiB delivered, best run.
                    params["loader_cpu_s_per_gib"] = round(cpu["moqt"] / (block / (1 << 30)), 3)
                    if parallel:
                        from ....kvsp.records import ReplicaRecord

                        # More replicas of the same block, each in its own holder process.
                        replicas = [start_holder(layers, layer_bytes, size, backend)
                                    for _ in range(holders - 1)]
                        extra.extend(p for p, _ in replicas)
                        records = [ReplicaRecord.from_json(i.record)
                                   for i in (info, *(i for _, i in replicas))]
                        par[f"{backend}_dgram{size}"] = loop.run_until_complete(measure_parallel(
                            records, geometry(), info.tokens,
                            config, parallel, workers, repeat))  # type: ignore[arg-type]
                finally:
                    for p in (proc, *extra):
                        stop_holder(p)
                    extra.clear()
                got[f"{backend}_dgram{size}"] = (res["moqt"], params)
                if want_http:
                    got["http"] = (res["http"], {"layers": layers, "layer_bytes": layer_bytes,
                                                 "holder": "own process", "verify": "Repr-Digest"})
        if relay:
            backend, size = backends[0], max(datagram_sizes)
            res = loop.run_until_complete(measure_relay(layers, layer_bytes, size, backend, repeat))
            for name, timing in res.items():
                got[name] = (timing, {"layers": layers, "layer_bytes": layer_bytes,
                                      "backend": backend, "max_datagram_size": size,
                                      "sink": "torch-cpu", "relay": "own process",
                                      "holder": "own process", "direct": f"{backend}_dgram{size}"})
    finally:
        loop.close()
    peer = measure_mooncake(block, repeat) if mooncake else None
    figures = []
    for path, ((first, whole), params) in got.items():
        figures.append(Figure(f"kv_{path}_first_layer", "ms", first * 1e3,
                              "tcp_first_layer", tcp[1] * 1e3, params=params))
        figures.append(Figure(f"kv_{path}_block", "ms", whole * 1e3,
                              "tcp_copy", tcp[0] * 1e3, params=params))
        # The same as a rate: ratio = the fraction of the TCP copy's speed (the "x TCP").
        figures.append(Figure(f"kv_{path}_rate", "MB/s", block / whole / 1e6,
                              "tcp_copy", block / tcp[0] / 1e6, params=params))
    figures.extend(_relay_vs_direct(got, block))
    if isinstance(peer, str):
        print(f"kvsp bench kv: kv_mooncake_tcp skipped: {peer}", file=sys.stderr, flush=True)
    elif peer is not None:
        figures.extend(_mooncake_figures(peer, layers, layer_bytes, tcp[0]))
    for path, timings in par.items():
        params = {**got[path][1], "holders": holders,
                  "holder": "own process" if holders == 1 else f"{holders} processes"}
        suffix = "" if holders == 1 else f"_h{holders}"
        for (n, kind), (first, whole, median) in timings.items():
            name = f"kv_{path}_par{n}_{kind}{suffix}"
            run_params = {**params, "parallel": n, "workers": kind,
                          "median_block_ms": median * 1e3,
                          "sink": "torch-cpu-shared" if kind == "processes" else "torch-cpu"}
            base = timings[(1, kind)]
            figures.append(Figure(f"{name}_first_layer", "ms", first * 1e3,
                                  "tcp_first_layer", tcp[1] * 1e3, params=run_params))
            figures.append(Figure(f"{name}_rate", "MB/s", block / whole / 1e6,
                                  "tcp_copy", block / tcp[0] / 1e6, params=run_params))
            # Same kind, same run, N = 1: the speed-up from splitting (ratio > 1 helps).
            figures.append(Figure(f"{name}_vs_par1", "MB/s", block / whole / 1e6,
                                  f"kv_{path}_par1_{kind}{suffix}_rate", block / base[1] / 1e6,
                                  params={**run_params, "baseline_median_block_ms": base[2] * 1e3}))
    if prefetch_window is not None:
        from .prefetch import prefetch_figures

        figures.extend(prefetch_figures(window=prefetch_window, datagram_size=max(datagram_sizes),
                                        backend=backends[0], repeat=repeat))
    return figures
