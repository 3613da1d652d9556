"""The front end (kvsp-draft §6.8) over real HTTP on 127.0.0.1: every index delivered exactly
once and in order, duplicates dropped by index, lower epochs discarded (MUST), hostile bodies
answered with problem details, and ``kvsp frontend`` as a real process."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from kvsp_moq.control.client.http import HttpFrontEndClient
from kvsp_moq.control.common.config import ControlConfig, FrontEndConfig
from kvsp_moq.control.common.session_records import StreamEnd
from kvsp_moq.control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from kvsp_moq.control.frontend.service import FrontEnd
from kvsp_moq.control.http.server import RunningServer
from test_instance_support import AUTH, SCOPE_A, SCOPE_B, TOKENS, call
from test_pc_cli import PRINCIPAL, TOKEN, start, stop
from test_sessions_support import guarded, read_stream


@asynccontextmanager
async def front_end(**kw: Any) -> AsyncIterator[tuple[RunningServer, FrontEnd, aiohttp.ClientSession]]:
    async with await serve_frontend(ControlConfig(auth=AUTH, frontend=FrontEndConfig(**kw))) as server:
        async with aiohttp.ClientSession() as session:
            yield server, server.app[FRONTEND_SERVICE], session


def batch(sid: uuid.UUID, epoch: int, tokens: dict[int, int], end: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"session": str(sid), "epoch": epoch, "tokens": [{"index": i, "token": t} for i, t in tokens.items()]}
    if end is not None:
        body["end"] = end
    return body


async def test_exactly_once_with_duplicates_and_a_lower_epoch_interleaved() -> None:
    async with front_end() as (server, fe, http):
        sid = uuid.uuid4()
        await fe.register(sid, SCOPE_A, max_tokens=16)
        url = f"{server.url}sessions/{sid}/tokens"
        reader = asyncio.create_task(read_stream(http, url))

        async def deliver(body: dict[str, Any]) -> Any:
            return await call(http, "POST", url, who="inst", body=body)

        r = await deliver(batch(sid, 1, {0: 100, 1: 101, 2: 102}))
        assert r.json == {"accepted": 3, "duplicates": 0, "next": 3}
        r = await deliver(batch(sid, 1, {1: 101, 2: 102, 3: 103}))
        assert r.json == {"accepted": 1, "duplicates": 2, "next": 4}
        r = await deliver(batch(sid, 1, {6: 106}))  # out of order: buffered
        assert r.json == {"accepted": 1, "duplicates": 0, "next": 4}
        r = await deliver(batch(sid, 1, {6: 106}))
        assert r.json == {"accepted": 0, "duplicates": 1, "next": 4}
        # epoch 2 (a resumed instance) re-sends what its checkpoint covers; the undelivered
        # epoch-1 token 6 is dropped, since index 6 will come from epoch 2
        r = await deliver(batch(sid, 2, {0: 100, 1: 101, 2: 102}))
        assert r.json == {"accepted": 0, "duplicates": 3, "next": 4}
        stale = await deliver(batch(sid, 1, {4: 999, 5: 999}))  # the failed instance, late
        assert stale.status == 409 and stale.problem == "kvsp-stale-epoch"
        r = await deliver(batch(sid, 2, {5: 205, 4: 204, 3: 103}))
        assert r.json == {"accepted": 2, "duplicates": 1, "next": 6}
        r = await deliver(batch(sid, 2, {6: 206, 7: 207}, end=8))
        assert r.json == {"accepted": 2, "duplicates": 0, "next": 8}
        lines = await guarded(reader)
        assert lines == [{"index": i, "token": t} for i, t in enumerate([100, 101, 102, 103, 204, 205, 206, 207])] + [{"end": 8}]
        assert fe.epoch(sid) == 2
        # a stream opened later, from an index, sees the same output
        assert (await read_stream(http, f"{url}?from=6")) == [{"index": 6, "token": 206}, {"index": 7, "token": 207}, {"end": 8}]
        # and the client API over HTTP
        client = HttpFrontEndClient(TOKENS["client-a"])
        try:
            items = [item async for item in client.tokens(server.url, sid, 5)]
        finally:
            await client.close()
        assert [getattr(i, "index", None) for i in items] == [5, 6, 7, None] and items[-1] == StreamEnd(end=8)


async def test_hostile_deliveries_are_problems_and_change_nothing() -> None:
    async with front_end(max_ahead=4) as (server, fe, http):
        sid = uuid.uuid4()
        await fe.register(sid, SCOPE_A, max_tokens=10)
        url = f"{server.url}sessions/{sid}/tokens"

        async def deliver(body: Any, who: str | None = "inst", **kw: Any) -> Any:
            return await call(http, "POST", url, who=who, body=body, **kw)

        assert (await deliver(batch(sid, 1, {0: 1, 1: 2}))).status == 200
        cases: list[tuple[Any, str]] = [
            (batch(sid, 1, {2: 3, 10: 4}), "tokens[1].index"),  # at max_tokens
            (batch(sid, 1, {2: 3, 9: 4}), "tokens[1].index"),  # beyond max_ahead
            (batch(sid, 1, {}, end=1), "end"),  # below what was delivered
            (batch(sid, 1, {5: 1}, end=4), "tokens[0].index"),
            (batch(uuid.uuid4(), 1, {2: 3}), "session"),
            (batch(sid, 0, {2: 3}), "epoch"),
            (batch(sid, 1, {2: -1}), "tokens[0].token"),
            (batch(sid, 1, {2: 2**32}), "tokens[0].token"),
            ({"session": str(sid), "epoch": 1, "tokens": [{"index": i, "token": 0} for i in range(4097)]}, "tokens"),
            ({"session": str(sid), "epoch": 1, "tokens": {}}, "tokens"),
            (b'{"session": "x", "session": "y"}', "$"),
            (b"\xff", "$"),
        ]
        for body, member in cases:
            reply = await deliver(body)
            assert reply.status == 400 and reply.problem == "kvsp-bad-record", (member, reply.body)
            assert reply.json["member"] == member, (member, reply.json)
        assert fe.delivered(sid) == [1, 2] and fe.epoch(sid) == 1
        assert (await deliver(batch(sid, 1, {2: 3}), content_type="text/plain")).status == 415
        assert (await deliver(batch(sid, 1, {2: 3}), who=None)).status == 401
        assert (await deliver(batch(sid, 1, {2: 3}), who="pc-b")).problem == "kvsp-forbidden"
        unknown = uuid.uuid4()
        missing = await call(http, "POST", f"{server.url}sessions/{unknown}/tokens", who="inst", body=batch(unknown, 1, {0: 1}))
        assert missing.status == 404 and missing.problem == "kvsp-not-found"
        bad_from = await call(http, "GET", f"{url}?from=-1", who="client-a")
        assert bad_from.status == 400 and bad_from.json["member"] == "from"
        assert (await call(http, "GET", url, who="pc-b")).problem == "kvsp-forbidden"
        # a client start without a PC, and a hostile start body
        no_pc = await call(http, "POST", f"{server.url}sessions", who="client-a", body={
            "compat_id": "00" * 32, "scope_id": SCOPE_A.hex(), "prompt_tail": [1], "tokens": 1, "max_tokens": 4,
            "sampler": {"method": "greedy", "params": {}, "seed": 1, "step": 0, "deterministic": True}})
        assert no_pc.status == 409 and no_pc.problem == "kvsp-not-active"
        other_scope = await call(http, "POST", f"{server.url}sessions", who="client-a", body={
            "compat_id": "00" * 32, "scope_id": SCOPE_B.hex(), "prompt_tail": [1], "tokens": 1, "max_tokens": 4,
            "sampler": {"method": "greedy", "params": {}, "seed": 1, "step": 0, "deterministic": True}})
        assert other_scope.problem == "kvsp-forbidden"
        bad_start = await call(http, "POST", f"{server.url}sessions", who="client-a", body={"compat_id": "00" * 32})
        assert bad_start.status == 400 and bad_start.json["member"] == "scope_id"


async def test_kvsp_frontend_role(tmp_path: Path) -> None:
    (tmp_path / "fe.toml").write_text('[frontend]\nmax_ahead = 16\n' + PRINCIPAL)
    proc, url = await start("frontend", tmp_path / "fe.toml")
    try:
        async with aiohttp.ClientSession() as http:
            sid = uuid.uuid4()
            async with http.post(f"{url}sessions/{sid}/tokens", json=batch(sid, 1, {0: 1}),
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 404  # no such session: the role answers with problems
                assert (await resp.json())["type"].endswith("kvsp-not-found")
    finally:
        assert await stop(proc) == 0
    (tmp_path / "bad.toml").write_text('[frontend]\nmax_ahead = 0\n' + PRINCIPAL)
    bad = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", "frontend", "--config", str(tmp_path / "bad.toml"), stderr=asyncio.subprocess.PIPE)
    _, err = await guarded(bad.communicate())
    assert bad.returncode == 2 and b"frontend.max_ahead" in err
