"""Mooncake Transfer Engine's TCP transport as a peer row of ``kvsp bench kv`` (issue 28).

Optional: the row is measured where ``mooncake.engine`` imports (the package
``mooncake-transfer-engine-non-cuda``, the extra ``kvsp-moq[mooncake]``; its ``engine.so`` also
needs Debian's ``libibverbs1``, even for TCP), otherwise :func:`measure_mooncake` returns why not
and the driver prints it. Read from the package's own API (``TransferEngine``: ``initialize``,
``register_memory``, ``get_rpc_port``, ``transfer_sync_read``), nothing copied from it.

What is measured, the same shape as the MOQT rows: a *target* engine in its own process
(``python -m kvsp_moq.cli.bench.kv.mooncake serve``, as our holder is) registers the block —
the TCP copy baseline's bytes, ``bench.baseline`` — and a *reader* engine in another process
(``... read``) registers a destination buffer of the same size and reads the whole block with
one ``transfer_sync_read`` over Mooncake's TCP transport on loopback, with its P2P handshake
(``P2PHANDSHAKE``: no metadata server). A warm-up read first (it opens the segment: the
handshake, excluded as the MOQT rows exclude theirs), then ``repeat`` timed reads; the best
one is kept, with the reader process's CPU seconds (all its threads) over it. Every read is
checked afterwards, outside the clock (SHA-256 of the destination against the target's):
Mooncake's TCP transport verifies nothing, so the row carries no digest work where the MOQT
rows hash every layer while it lands (its params say so).

Both engines run in child processes because the engine logs to stderr through glog with no
switch to silence it: their stderr is kept and shown only when they fail. Every wait has a
bound (:data:`START_TIMEOUT_S`, :data:`READ_TIMEOUT_S`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ENGINE_MODULE", "MooncakeTiming", "block_bytes_of", "measure_mooncake"]

#: The module that holds Mooncake's ``TransferEngine``.
ENGINE_MODULE = "mooncake.engine"
#: Where the package's version is read from (the first one installed).
_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
#: Seconds the target process gets to print its line (import + engine start + registration).
START_TIMEOUT_S = 60.0
#: Seconds the reader process gets for its warm-up and each timed read.
READ_TIMEOUT_S = 60.0
#: Seed of the block's bytes: the TCP copy baseline's (``driver.run``).
_SEED = 2


@dataclass(frozen=True)
class MooncakeTiming:
    """The best timed read: its seconds, the reader's CPU seconds over it, the version."""

    block_s: float
    cpu_s: float
    version: str


def block_bytes_of(size: int) -> np.ndarray:
    """The block: ``size`` random octets, the same as the TCP copy baseline's."""
    return np.random.default_rng(_SEED).integers(0, 256, size, dtype=np.uint8)


def _version() -> str:
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _engine(module: str) -> Any:
    """A started TransferEngine on loopback, TCP transport, P2P handshake."""
    engine = importlib.import_module(module).TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def _register(engine: Any, buf: np.ndarray) -> None:
    rc = engine.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"TransferEngine.register_memory returned {rc}")


def _serve(size: int, module: str) -> int:
    engine = _engine(module)
    block = block_bytes_of(size)
    _register(engine, block)
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}",
                      "address": block.ctypes.data,
                      "sha256": hashlib.sha256(block.data).hexdigest()}), flush=True)
    sys.stdin.read()  # until the parent closes it (or dies)
    return 0


def _read(info: dict[str, Any], size: int, repeat: int, module: str) -> int:
    engine = _engine(module)
    dst = np.zeros(size, dtype=np.uint8)
    _register(engine, dst)
    best: tuple[float, float] | None = None
    for i in range(repeat + 1):  # the first opens the segment (handshake): not timed
        dst[:] = 0
        wall, cpu = time.perf_counter(), time.process_time()
        rc = engine.transfer_sync_read(info["session"], dst.ctypes.data, info["address"], size)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if rc != 0:
            raise RuntimeError(f"transfer_sync_read returned {rc}")
        if hashlib.sha256(dst.data).hexdigest() != info["sha256"]:
            raise RuntimeError("the block read differs from the target's")
        if i and (best is None or wall < best[0]):
            best = (wall, cpu)
    assert best is not None
    print(json.dumps({"block_s": best[0], "cpu_s": best[1], "version": _version()}), flush=True)
    return 0


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first stdout line, waited for at most ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _tail(text: str | None, lines: int = 5) -> str:
    return " | ".join((text or "").strip().splitlines()[-lines:])


def measure_mooncake(size: int, repeat: int, module: str = ENGINE_MODULE) -> MooncakeTiming | str:
    """The Mooncake row's timing for a block of ``size`` octets, or the reason it was skipped
    (the module does not import, or an engine failed: the child's last stderr lines)."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as exc:
        return (f"{module} does not import ({exc}); pip install 'kvsp-moq[mooncake]' and, on "
                f"Debian, apt-get install libibverbs1")
    child = [sys.executable, "-m", __name__]
    target = subprocess.Popen([*child, "serve", "--bytes", str(size), "--module", module],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(target, START_TIMEOUT_S)
        if not line.startswith("{"):
            target.kill()
            _, err = target.communicate()
            return f"the Mooncake target did not start: {_tail(err)}"
        try:
            done = subprocess.run(
                [*child, "read", "--info", line.strip(), "--bytes", str(size), "--repeat",
                 str(repeat), "--module", module],
                capture_output=True, text=True, timeout=READ_TIMEOUT_S * (repeat + 1))
        except subprocess.TimeoutExpired:
            return f"the Mooncake reads took over {READ_TIMEOUT_S * (repeat + 1):.0f} s"
        if done.returncode != 0:
            return f"the Mooncake reader failed (exit {done.returncode}): {_tail(done.stderr)}"
        got = json.loads(done.stdout.strip().splitlines()[-1])
        return MooncakeTiming(block_s=got["block_s"], cpu_s=got["cpu_s"], version=got["version"])
    finally:
        _stop(target)


def _stop(proc: subprocess.Popen[str]) -> None:
    """End the target: its stdin closed, its pipes drained; killed after 30 s."""
    if proc.poll() is None:
        try:
            proc.communicate(input="", timeout=30)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.communicate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.kv.mooncake")
    parser.add_argument("role", choices=("serve", "read"))
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--module", default=ENGINE_MODULE)
    parser.add_argument("--info", help="read: the target's JSON line")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.role == "serve":
        return _serve(args.bytes, args.module)
    return _read(json.loads(args.info), args.bytes, args.repeat, args.module)


if __name__ == "__main__":
    sys.exit(main())
