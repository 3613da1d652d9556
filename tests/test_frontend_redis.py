"""The front end over a real ``redis-server`` (kvsp-draft §6.8; DESIGN.md §8), with faults and
real processes: a front end SIGKILLed mid-session and restarted on its port, two front-end
processes over one Redis, Redis itself killed and restarted with its append-only file, and a
hung Redis (SIGSTOP) answered with 503 ``kvsp-unavailable`` in bounded time, which an
instance's delivery retries."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from kvsp_moq.control.client.http import HttpFrontEndClient
from kvsp_moq.control.common.config import ControlConfig, FrontEndConfig
from kvsp_moq.control.common.errors import PeerUnreachable
from kvsp_moq.control.common.session_records import OutputTokens, SessionOrder
from kvsp_moq.control.common.store import parse_store
from kvsp_moq.control.frontend.delivery import Registration
from kvsp_moq.control.frontend.delivery_redis import RedisDeliveryStore
from kvsp_moq.control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from kvsp_moq.control.instance.sessions import SessionOutput
from kvsp_moq.kvsp.records.session import Sampler, SessionCheckpoint
from redis_support import SLACK_S, RedisServer, redis_aof, redis_server  # noqa: F401
from test_instance_support import AUTH, COMPAT, SCOPE_A, TOKENS
from test_pc_cli import PRINCIPAL, TOKEN

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def body(sid: uuid.UUID, epoch: int, tokens: Sequence[int] | range, values: dict[int, int],
         end: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"session": str(sid), "epoch": epoch,
                           "tokens": [{"index": i, "token": values[i]} for i in tokens]}
    if end is not None:
        out["end"] = end
    return out


class FrontEndProcess:
    """``kvsp frontend`` as a real process on a fixed port, over ``store``."""

    def __init__(self, folder: Path, store: str, port: int | None = None) -> None:
        self.config = folder / f"fe-{uuid.uuid4().hex[:8]}.toml"
        self.config.write_text(f'[frontend]\nstore = "{store}"\nstore_timeout_ms = 500\n' + PRINCIPAL)
        self.port = port if port is not None else _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "frontend", "--listen", f"127.0.0.1:{self.port}", "--config",
            str(self.config), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), GUARD)).decode()
        assert line.startswith("kvsp frontend: listening on "), (line, await self.proc.stderr.read(4000)
                                                                  if self.proc.stderr else b"")

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.proc.wait(), GUARD)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), GUARD)


async def post(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(f"{url}sessions/{doc['session']}/tokens", json=doc, headers=HEADERS) as resp:
        return resp.status, await resp.json(content_type=None)


async def stream(http: aiohttp.ClientSession, url: str, sid: uuid.UUID, start: int = 0) -> list[Any]:
    lines = []
    async with http.get(f"{url}sessions/{sid}/tokens", params={"from": str(start)}, headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            lines.append(json.loads(raw))
    return lines


@asynccontextmanager
async def registrar(url: str) -> AsyncIterator[RedisDeliveryStore]:
    """Registers sessions in the Redis the front ends use (as a front end that opened them would)."""
    store = RedisDeliveryStore(parse_store("frontend", url))
    try:
        yield store
    finally:
        await store.close()


async def test_a_killed_front_end_restarts_and_delivers_every_index_once(
        tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    sid, n = uuid.uuid4(), 40
    values = {i: (i * 37 + 11) % 32000 for i in range(n)}
    async with registrar(redis_server.url) as reg:
        await reg.register(sid, Registration(SCOPE_A, n), max_sessions=16)
    fe = FrontEndProcess(tmp_path, redis_server.url)
    await fe.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert await post(http, fe.url, body(sid, 1, range(0, 12), values)) == (200, {"accepted": 12, "duplicates": 0, "next": 12})
            assert (await post(http, fe.url, body(sid, 1, [15, 16], values)))[0] == 200  # buffered beyond a gap
            await fe.kill()  # SIGKILL: nothing flushed, nothing said goodbye
            await fe.start()  # the same port, the same Redis
            # the instance retries what it has no answer for, then goes on (and a resumed epoch re-sends)
            assert await post(http, fe.url, body(sid, 1, range(8, 15), values)) == (200, {"accepted": 3, "duplicates": 4, "next": 17})
            assert await post(http, fe.url, body(sid, 2, range(0, 20), values)) == (200, {"accepted": 3, "duplicates": 17, "next": 20})
            assert await post(http, fe.url, body(sid, 2, range(20, n), values, end=n)) == (200, {"accepted": 20, "duplicates": 0, "next": n})
            lines = await asyncio.wait_for(stream(http, fe.url, sid), GUARD)
    finally:
        await fe.stop()
    assert lines == [{"index": i, "token": values[i]} for i in range(n)] + [{"end": n}]


async def test_two_front_ends_over_one_redis_share_the_output(tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    sid, n = uuid.uuid4(), 10
    values = {i: 500 + i for i in range(n)}
    async with registrar(redis_server.url) as reg:
        await reg.register(sid, Registration(SCOPE_A, n), max_sessions=16)
    a, b = FrontEndProcess(tmp_path, redis_server.url), FrontEndProcess(tmp_path, redis_server.url)
    await a.start()
    await b.start()
    try:
        async with aiohttp.ClientSession() as http:
            # a client reads from B while the instance delivers to A: B hears of it (pub/sub)
            reader = asyncio.create_task(stream(http, b.url, sid))
            assert await post(http, a.url, body(sid, 1, range(0, 6), values)) == (200, {"accepted": 6, "duplicates": 0, "next": 6})
            # the same batch delivered to the other process: dropped by index
            assert await post(http, b.url, body(sid, 1, range(0, 6), values)) == (200, {"accepted": 0, "duplicates": 6, "next": 6})
            assert await post(http, b.url, body(sid, 1, [6], values)) == (200, {"accepted": 1, "duplicates": 0, "next": 7})
            assert await post(http, b.url, body(sid, 3, range(6, n), values, end=n)) == (200, {"accepted": 3, "duplicates": 1, "next": n})
            late = await post(http, a.url, body(sid, 2, [0], values))  # epoch 3 was seen through B
            assert late[0] == 409 and late[1]["type"].endswith("kvsp-stale-epoch")
            lines = await asyncio.wait_for(reader, GUARD)
            assert lines == await stream(http, a.url, sid)
    finally:
        await a.stop()
        await b.stop()
    assert lines == [{"index": i, "token": values[i]} for i in range(n)] + [{"end": n}]


async def test_redis_killed_and_restarted_with_aof_loses_nothing(redis_aof: RedisServer) -> None:  # noqa: F811
    sid, n = uuid.uuid4(), 12
    values = {i: 900 + i for i in range(n)}
    config = FrontEndConfig(store=redis_aof.url, store_timeout_ms=500)
    async with await serve_frontend(ControlConfig(auth=AUTH, frontend=config)) as server:
        fe = server.app[FRONTEND_SERVICE]
        await fe.register(sid, SCOPE_A, n)
        async with aiohttp.ClientSession() as http:
            async def deliver(doc: dict[str, Any]) -> tuple[int, Any]:
                async with http.post(f"{server.url}sessions/{sid}/tokens", json=doc,
                                     headers={"Authorization": f"Bearer {TOKENS['inst']}"}) as resp:
                    return resp.status, await resp.json(content_type=None)

            assert (await deliver(body(sid, 1, range(0, 5), values)))[1]["next"] == 5
            assert (await deliver(body(sid, 1, [7, 8], values)))[1]["next"] == 5
            redis_aof.restart()  # SIGKILL, then the AOF replayed (fsync always)
            # the client's first call after the restart reconnects at once (common/store.py)
            assert await deliver(body(sid, 1, range(3, 7), values)) == (200, {"accepted": 2, "duplicates": 2, "next": 9})
            assert await deliver(body(sid, 1, range(9, n), values, end=n)) == (200, {"accepted": 3, "duplicates": 0, "next": n})
        snap = await fe.snapshot(sid)
    assert snap is not None and list(snap.tokens) == [values[i] for i in range(n)] and snap.end == n and snap.epoch == 1


class RecordingSink:
    """An instance's view of the front end (``instance.sessions.TokenSink``) over HTTP that
    records each attempt; on the first failure it runs ``on_failure`` (the test resumes Redis)."""

    def __init__(self, client: HttpFrontEndClient, on_failure: Callable[[], None]) -> None:
        self.client = client
        self.on_failure = on_failure
        self.attempts: list[str] = []

    async def deliver(self, front_end: str, batch: OutputTokens) -> None:
        try:
            await self.client.deliver(front_end, batch)
        except PeerUnreachable as exc:
            self.attempts.append(str(exc))
            if len(self.attempts) == 1:
                self.on_failure()
            raise
        self.attempts.append("ok")


async def test_a_hung_redis_is_a_503_in_bounded_time_and_the_instance_retries(
        redis_server: RedisServer) -> None:  # noqa: F811
    timeout_ms = 400
    sid = uuid.uuid4()
    config = FrontEndConfig(store=redis_server.url, store_timeout_ms=timeout_ms)
    async with await serve_frontend(ControlConfig(auth=AUTH, frontend=config)) as server:
        fe = server.app[FRONTEND_SERVICE]
        await fe.register(sid, SCOPE_A, 8)
        async with aiohttp.ClientSession() as http:
            redis_server.pause()  # SIGSTOP: the socket stays open, nothing answers
            try:
                began = time.monotonic()
                async with http.post(f"{server.url}sessions/{sid}/tokens",
                                     json=body(sid, 1, [0], {0: 11}),  # the token a retry sends again (a 503 may have landed)
                                     headers={"Authorization": f"Bearer {TOKENS['inst']}"}) as resp:
                    problem = await resp.json(content_type=None)
                    status, retry_after = resp.status, resp.headers.get("Retry-After")
                elapsed = time.monotonic() - began
                reading = await http.get(f"{server.url}sessions/{sid}/tokens",
                                         headers={"Authorization": f"Bearer {TOKENS['client-a']}"})
                read_status = reading.status
                reading.release()
            finally:
                redis_server.resume()
        assert status == 503 and problem["type"].endswith("kvsp-unavailable") and retry_after == "1", problem
        assert elapsed < timeout_ms / 1000 + SLACK_S, elapsed  # answered within a bound, never a hang
        assert read_status == 503
        # The instance side: SessionOutput delivers through HttpFrontEndClient and retries a
        # failed delivery (with a growing pause, until delivery_deadline_ms). Redis hangs for the first attempt
        # and is resumed when it has failed: the retry delivers, nothing is lost.
        order = SessionOrder(epoch=1, front_end=server.url, max_tokens=8,
                             checkpoint=_checkpoint(sid))
        client = HttpFrontEndClient(TOKENS["inst"])
        try:
            sink = RecordingSink(client, redis_server.resume)
            output = SessionOutput(order, pc=None, front_end=sink)
            redis_server.pause()
            try:
                for token in (11, 12, 13):
                    await asyncio.wait_for(output.token(token), GUARD)
            finally:
                redis_server.resume()
        finally:
            await client.close()
        assert "503" in sink.attempts[0] and "kvsp-unavailable" in sink.attempts[0]
        assert sink.attempts[1:] == ["ok", "ok", "ok"], sink.attempts
        snap = await fe.snapshot(sid)
        assert snap is not None and snap.tokens == (11, 12, 13)


def _checkpoint(sid: uuid.UUID) -> SessionCheckpoint:
    sampler = Sampler(method="greedy", params={}, seed=1, step=0, deterministic=True)  # tokens released at once
    return SessionCheckpoint(session=sid, epoch=1, compat_id=COMPAT, scope_id=SCOPE_A, prompt_blocks=(),
                             prompt_tail=(1, 2), generated=(), output_offset=0, sampler=sampler)


async def test_concurrent_deliveries_through_two_clients_take_each_index_once(
        redis_server: RedisServer) -> None:  # noqa: F811
    """The accept script is atomic: batches racing through two connections (as two front-end
    processes would) take every index exactly once between them."""
    sid, n = uuid.uuid4(), 200
    values = {i: (i * 13) % 32000 for i in range(n)}
    async with registrar(redis_server.url) as one, registrar(redis_server.url) as two:
        await one.register(sid, Registration(SCOPE_A, n), max_sessions=16)
        batches = [OutputTokens.from_json(body(sid, 1, range(at, min(n, at + 20)), values)) for at in range(0, n, 10)]
        outcomes = await asyncio.gather(*(store.accept(sid, b, max_ahead=4096)
                                          for b in batches for store in (one, two)))
        snap = await two.read(sid, 0, n)
    assert sum(o.accepted for o in outcomes) == n and all(o.code == "ok" for o in outcomes)
    assert snap is not None and list(snap.tokens) == [values[i] for i in range(n)]
