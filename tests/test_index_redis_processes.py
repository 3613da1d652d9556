"""``kvsp index`` processes over one real redis-server (``[index] store = "redis://..."``):
SIGKILL the IS and start it again — the same lookups; two IS processes behind one Redis — the
same lookups, whichever was written to; a withdrawal through one is seen by the other."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from kvsp_moq.kvsp.records import dump_json
from redis_support import RedisServer, redis_server  # noqa: F401
from test_index_support import H1, H2, SCOPE_A, block_path, key, lookup_body, replica

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
TOKEN = "redis-proc-token-0123456789abcdef"


def write_config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kvsp.toml"
    path.write_text(f"""
[index]
base_path = "/is/"
store = "{url}"
store_timeout_ms = 1000

[[principals]]
name = "h"
token = "{TOKEN}"
scopes = ["{SCOPE_A.hex()}"]
holders = ["{H1}", "{H2}"]
""")
    return path


class IndexProcess:
    """One ``kvsp index`` process on 127.0.0.1 port 0 (its URL read from its first line)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, config: Path) -> IndexProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "index", "--listen", "127.0.0.1:0", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), GUARD)).decode()
        prefix = "kvsp index: listening on "
        assert line.startswith(prefix), line
        return cls(proc, line[len(prefix):].strip())

    async def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), GUARD)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), GUARD)


@asynccontextmanager
async def index_processes(config: Path, count: int) -> AsyncIterator[list[IndexProcess]]:
    procs = [await IndexProcess.start(config) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            await p.stop()


async def call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    data = dump_json(body) if hasattr(body, "to_json") else (json.dumps(body).encode() if body is not None else None)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/kvsp+json"}
    async with http.request(method, url, data=data, headers=headers, **kw) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw else None


async def lookup(http: aiohttp.ClientSession, url: str, keys: list[bytes]) -> dict[str, Any]:
    """A lookup answer without the remaining TTLs (they shrink as time passes), which must
    all be within the granted 60 s."""
    status, answer = await call(http, "POST", url + "lookup", lookup_body(keys))
    assert status == 200, answer
    for block in answer["blocks"]:
        for r in block["replicas"]:
            assert 0 < r.pop("ttl_ms") <= 60_000
    return answer


async def publish(http: aiohttp.ClientSession, url: str) -> None:
    for i in range(8):
        assert (await call(http, "PUT", url + block_path(key(i)), replica(key(i))))[0] == 201
    assert (await call(http, "PUT", url + block_path(key(3)), replica(key(3), holder=H2)))[0] == 201
    status, body = await call(http, "POST", url + "replicas:batch",
                              {"records": [replica(key(i), holder=H2).to_json() for i in (4, 5)]})
    assert status == 200 and [r["created"] for r in body["results"]] == [True, True]


async def test_sigkill_the_is_and_restart_it_lookups_unchanged(tmp_path: Path, redis_server: RedisServer) -> None:
    config = write_config(tmp_path, redis_server.url)
    keys = [key(i) for i in range(10)]
    async with aiohttp.ClientSession() as http:
        first = await IndexProcess.start(config)
        try:
            await publish(http, first.url)
            before = await lookup(http, first.url, keys)
            assert before["matched"] == 8
        finally:
            await first.kill()
        async with index_processes(config, 1) as (second,):
            assert await lookup(http, second.url, keys) == before
            assert (await call(http, "PUT", second.url + block_path(key(0)), replica(key(0))))[0] == 200  # a refresh


async def test_two_is_processes_behind_one_redis_answer_alike(tmp_path: Path, redis_server: RedisServer) -> None:
    config = write_config(tmp_path, redis_server.url)
    keys = [key(i) for i in range(10)]
    async with aiohttp.ClientSession() as http, index_processes(config, 2) as (a, b):
        await publish(http, a.url)
        assert await lookup(http, a.url, keys) == await lookup(http, b.url, keys)
        # withdrawn at b, gone at a: the lookup stops at the first key without a replica (§6.2)
        status, _ = await call(http, "DELETE", b.url + block_path(key(2)), params={"holder": H1})
        assert status == 204
        answer = await lookup(http, a.url, keys)
        assert answer["matched"] == 2 and answer == await lookup(http, b.url, keys)
        status, _ = await call(http, "DELETE", a.url + block_path(key(2)), params={"holder": H1})
        assert status == 404  # already withdrawn, through the other process
