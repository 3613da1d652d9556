"""The baseline of ``kvsp bench vllm``'s load-rate figures: ``kvsp bench kv``'s direct MOQT row
for one block of the size engine B loaded (docs/vllm.md "Benchmark").

The code is ``kvsp bench kv``'s (``cli.bench.kv``): the holder is its ``serve_block`` (the
benchmark block, random octets under 8 KV heads x 128 bf16, served over MOQT, binding v1) in a
process of its own (:mod:`.holder`: ``kv.holder``'s entry point with the layer's size in
octets); the loader is its ``kv.loader.measure`` in the bench process: one QUIC connection,
connected before the clock, a warm-up load and then the best of ``repeat`` loads of the whole
block into a torch CPU sink, every layer verified against the record's digest. Its figure name
is the one ``kvsp bench kv`` prints for that row, ``kv_{backend}_dgram{size}_rate``.
"""

from __future__ import annotations

import selectors
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from ....transport import TransportConfig, new_event_loop
from ..kv.holder import HolderInfo
from ..kv.loader import measure
from ..kv.relayed import stop_process

__all__ = ["BACKEND", "DATAGRAM_SIZE", "DirectRate", "TOKEN_BYTES", "direct_rate"]

#: ``kvsp bench kv``'s defaults for its direct row.
BACKEND = "aioquic"
DATAGRAM_SIZE = 16384
#: Octets per token of one layer (K and V) of the benchmark block's geometry (8 x 128 bf16):
#: a layer's size must be a multiple of it.
TOKEN_BYTES = 2 * 8 * 128 * 2
#: Bound (s) on the holder process's start (its first line).
HOLDER_START_S = 120.0


@dataclass(frozen=True)
class DirectRate:
    """The best whole-block load of ``layers`` x ``layer_bytes`` and its first layer (s)."""

    layers: int
    layer_bytes: int
    block_s: float
    first_layer_s: float
    backend: str = BACKEND
    datagram_size: int = DATAGRAM_SIZE
    repeat: int = 3

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def name(self) -> str:
        """``kvsp bench kv``'s name for the row."""
        return f"kv_{self.backend}_dgram{self.datagram_size}_rate"

    @property
    def mb_s(self) -> float:
        return self.block_bytes / self.block_s / 1e6

    def params(self) -> dict[str, Any]:
        return {"direct_layers": self.layers, "direct_layer_bytes": self.layer_bytes,
                "direct_block_ms": round(self.block_s * 1e3, 3),
                "direct_first_layer_ms": round(self.first_layer_s * 1e3, 3), "direct_repeat": self.repeat,
                "direct": f"kvsp bench kv's direct MOQT row ({self.backend}, max datagram {self.datagram_size}; "
                          "holder in its own process, one connection)"}


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The process's first stdout line, waited for at most ``timeout`` s."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"the direct holder process printed nothing in {timeout:.0f} s")
    return proc.stdout.readline()


def direct_rate(layers: int, layer_bytes: int, *, repeat: int = 3, backend: str = BACKEND,
                datagram_size: int = DATAGRAM_SIZE) -> DirectRate:
    """Start the holder process, measure (module notes), stop it; every wait bounded."""
    if layers < 1 or layer_bytes < TOKEN_BYTES or layer_bytes % TOKEN_BYTES:
        raise ValueError(f"a direct block needs layers >= 1 and a layer size that is a multiple of "
                         f"{TOKEN_BYTES} octets, not {layers} x {layer_bytes}")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"{__package__}.holder", "--layers", str(layers), "--layer-bytes", str(layer_bytes),
         "--datagram-size", str(datagram_size), "--backend", backend],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = _first_line(proc, HOLDER_START_S)
        if not line.startswith("{"):
            raise RuntimeError(f"the direct holder process did not start (exit {proc.poll()})")
        info = HolderInfo.from_line(line)
        config = TransportConfig(backend=backend, insecure=True, max_datagram_size=datagram_size)
        loop = new_event_loop(use_uvloop=True)
        try:  # bounded inside: connect 30 s, each load 600 s (kv.loader)
            got = loop.run_until_complete(measure(info, config, repeat, http=False))
        finally:
            loop.close()
    finally:
        stop_process(proc)
    first, whole = got["moqt"]
    return DirectRate(layers, layer_bytes, whole, first, backend, datagram_size, repeat)

