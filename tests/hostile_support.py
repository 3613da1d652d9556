"""Shared helpers of tests/test_hostile_*.py (holds no tests): the hostile MOQT peer of
tests/hostile_moqt_peer.py started as a child process, and resident memory read from
/proc (``VmRSS``) of this process or of a child."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed

HERE = Path(__file__).resolve().parent
GUARD = 60.0
MiB = 1 << 20
CERT = make_self_signed()


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


def rss(pid: int | str = "self") -> int:
    """Resident set size of process ``pid`` in octets (``VmRSS`` of /proc/PID/status)."""
    return _status("VmRSS", pid)


def _status(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


class PeakRss:
    """Peak resident memory of process ``pid`` (this one by default) from now on:
    ``VmHWM`` of /proc/PID/status after resetting it (``echo 5 > /proc/PID/clear_refs``),
    so an allocation that was freed again before the end still counts. ``growth`` is the
    peak above the resident size at the start."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:  # no reset here: only growth beyond the earlier peak is seen
            pass
        self.start = _status("VmRSS", pid)

    @property
    def growth(self) -> int:
        return max(0, _status("VmHWM", self.pid) - self.start)

    def __str__(self) -> str:
        return f"peak RSS {self.growth / MiB:.1f} MiB above the start"


def client_config() -> TransportConfig:
    # Loopback, no credentials: an unverified server is acceptable here.
    return TransportConfig(insecure=True)


@dataclass
class Peer:
    proc: asyncio.subprocess.Process
    url: str
    #: ``stopped <stream ID> <code>`` lines of the peer, as (stream ID, code).
    stops: asyncio.Queue[tuple[int, int]]


@asynccontextmanager
async def hostile_peer(tmp_path: Path, mode: str, *args: str) -> AsyncIterator[Peer]:
    """Run ``tests/hostile_moqt_peer.py MODE`` (a child process) until the block ends."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(CERT.cert_pem)
    key.write_bytes(CERT.key_pem)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "hostile_moqt_peer.py"), mode, str(cert), str(key), *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdin is not None
    stops: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    reader: asyncio.Task[None] | None = None
    try:
        url = (await within(proc.stdout.readline())).decode().strip()
        assert url.startswith("moqt://"), url

        async def read_lines() -> None:
            assert proc.stdout is not None
            async for line in proc.stdout:
                word, sid, code = line.decode().split()
                assert word == "stopped"
                stops.put_nowait((int(sid), int(code)))

        reader = asyncio.ensure_future(read_lines())
        yield Peer(proc, url, stops)
    finally:
        proc.stdin.close()
        try:
            await within(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        if reader is not None:
            reader.cancel()
