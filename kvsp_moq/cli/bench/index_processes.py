"""``kvsp index`` processes for ``kvsp bench index --store cluster``: several Index Services
over one store, each its own process (as a fleet runs them behind a load balancer, docs/deploy.md
"Index Service"), so that what they do in parallel is not serialized by one event loop.

Each process is started with a configuration written to a temporary folder (the store's URL,
the bench's key prefix, one principal for the bench's token) and listens on a free loopback
port, which it reports on its first line of output; each start and stop is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

__all__ = ["index_processes"]

#: Bound on a process's start (its imports on a busy machine) and on its exit.
START_S = 60.0
STOP_S = 15.0
_LISTENING = "kvsp index: listening on "


def _config(store_url: str, key_prefix: str, token: str, store_timeout_ms: int) -> str:
    return f"""
[index]
store = "{store_url}"
store_key_prefix = "{key_prefix}"
store_timeout_ms = {store_timeout_ms}
purge_interval_ms = 0

[[principals]]
name = "bench"
token = "{token}"
scopes = ["*"]
holders = ["*"]
"""


async def _start(config: Path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", "index", "--listen", "127.0.0.1:0", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), START_S)).decode()
    except asyncio.TimeoutError:
        await _stop(proc)
        raise RuntimeError(f"kvsp index did not start within {START_S} s") from None
    if not line.startswith(_LISTENING):
        await _stop(proc)
        raise RuntimeError(f"kvsp index did not start: {line.strip()!r}")
    return proc, line[len(_LISTENING):].strip()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def index_processes(count: int, store_url: str, key_prefix: str, token: str,
                          *, store_timeout_ms: int = 2_000) -> AsyncIterator[list[str]]:
    """``count`` ``kvsp index`` processes over ``store_url`` (keys under ``key_prefix``, each
    call bounded by ``store_timeout_ms``), accepting ``token`` for every scope and holder;
    yields their base URLs."""
    with tempfile.TemporaryDirectory(prefix="kvsp-bench-index-") as folder:
        config = Path(folder) / "index.toml"
        config.write_text(_config(store_url, key_prefix, token, store_timeout_ms))
        procs: list[asyncio.subprocess.Process] = []
        try:
            urls = []
            for _ in range(count):
                proc, url = await _start(config)
                procs.append(proc)
                urls.append(url)
            yield urls
        finally:
            for proc in procs:
                await _stop(proc)
