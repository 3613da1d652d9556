"""Shared helpers of the session tests (no tests here): a small real :class:`SessionEngine`
that generates deterministic tokens, a PC + front end + instances world on 127.0.0.1, and
readers of the front end's NDJSON stream. Everything waits on events, never on sleeps."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvsp_moq.control.common.config import ControlConfig, FrontEndConfig, InstanceConfig, PcConfig, TierConfig
from kvsp_moq.control.common.session_records import SessionOrder
from kvsp_moq.control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from kvsp_moq.control.frontend.service import FrontEnd
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.instance.serve import serve_instance
from kvsp_moq.control.instance.sessions import SessionOutput
from kvsp_moq.kvsp.records import InstanceStatusRecord
from test_instance_support import AUTH, COMPAT, SCOPE_A, TOKENS, World, world

GUARD = 30.0  # a safety net against hangs, never a way to wait for something


def token_at(seed: int, index: int) -> int:
    """The deterministic output token ``index`` of a session with ``seed``."""
    return (seed * 7919 + index * 31 + 5) % 32_000


@dataclass
class CountingEngine:
    """A real engine: emits ``token_at(seed, i)`` for i = next index .. max_tokens - 1.

    ``hang_at``: on reaching that index, it sets ``reached`` and waits for ``unhang`` (a hung or
    partitioned instance). ``pause_at``: the same with ``paused``/``proceed``, then it checkpoints
    explicitly (a non-deterministic sampler's batch).
    """

    name: str
    hang_at: int | None = None
    pause_at: int | None = None
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    unhang: asyncio.Event = field(default_factory=asyncio.Event)
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    proceed: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    orders: list[tuple[str, SessionOrder]] = field(default_factory=list)
    outputs: list[SessionOutput] = field(default_factory=list)

    async def start(self, order: SessionOrder, output: SessionOutput) -> None:
        self.orders.append(("start", order))
        self.started.set()
        await self._run(order, output)

    async def resume(self, order: SessionOrder, output: SessionOutput) -> None:
        self.orders.append(("resume", order))
        self.resumed.set()
        await self._run(order, output)

    async def _run(self, order: SessionOrder, output: SessionOutput) -> None:
        self.outputs.append(output)
        seed = order.checkpoint.sampler.seed
        assert order.max_tokens is not None
        try:
            while output.next_index < order.max_tokens:
                if self.hang_at is not None and output.next_index == self.hang_at:
                    self.reached.set()
                    await self.unhang.wait()
                if self.pause_at is not None and output.next_index == self.pause_at:
                    self.paused.set()
                    await self.proceed.wait()
                    await output.checkpoint()
                await output.token(token_at(seed, output.next_index))
        finally:
            self.ended.set()


def sampler(seed: int = 7, *, deterministic: bool = True) -> dict[str, Any]:
    return {"method": "greedy" if deterministic else "top-p", "params": {} if deterministic else {"p": 0.9},
            "seed": seed, "step": 0, "deterministic": deterministic}


def client_request(max_tokens: int = 10, *, seed: int = 7, deterministic: bool = True) -> dict[str, Any]:
    return {"compat_id": COMPAT.hex(), "scope_id": SCOPE_A.hex(), "prompt_blocks": [], "prompt_tail": [374, 264, 11],
            "tokens": 3, "sampler": sampler(seed, deterministic=deterministic), "max_tokens": max_tokens}


def status(instance: str, *, epoch: int = 1, prefill: float = 10_000, ttl_ms: int = 60_000) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance, epoch=epoch, state="active", running=0, queued=0, batch_size=8, kv_utilization=0.1,
        prefill_tokens_per_s=prefill, decode_tokens_per_s=100, links=(), requested_state=None, ttl_ms=ttl_ms,
    )


@dataclass
class SessionWorld:
    w: World
    fe: RunningServer
    instances: dict[str, RunningServer]
    engines: dict[str, CountingEngine]

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.w.session

    @property
    def fe_service(self) -> FrontEnd:
        return self.fe.app[FRONTEND_SERVICE]

    async def report(self, name: str, **kw: Any) -> None:
        """A status report of instance ``name`` to the PC, over HTTP."""
        from test_instance_support import call
        reply = await call(self.session, "PUT", f"{self.w.pc.url}instance-status", who="inst",
                           body=status(self.instances[name].url, **kw))
        assert reply.status == 200, reply.body


@asynccontextmanager
async def session_world(engines: dict[str, CountingEngine], *, checkpoint_every: int = 4,
                        pc: PcConfig | None = None, fe: dict[str, Any] | None = None) -> AsyncIterator[SessionWorld]:
    """A PC (and IS), a front end pointed at it (``fe``: more of its settings), and one
    instance per engine."""
    async with world(holders=0, pc=pc) as w:
        fc = FrontEndConfig(pc_url=w.pc.url, pc_token=TOKENS["pc"], **(fe or {}))
        fe = await w.stack.enter_async_context(await serve_frontend(ControlConfig(auth=AUTH, frontend=fc)))
        servers = {}
        for name, engine in engines.items():
            ic = InstanceConfig(pc_url=w.pc.url, token=TOKENS["inst"], tiers=(TierConfig("host", 1 << 16),),
                                checkpoint_every=checkpoint_every)
            servers[name] = await w.stack.enter_async_context(
                await serve_instance(ControlConfig(auth=AUTH, instance=ic), clock=w.clock, epoch=1, report=False, session_engine=engine))
        yield SessionWorld(w, fe, servers, engines)


async def read_stream(session: aiohttp.ClientSession, url: str, who: str = "client-a") -> list[dict[str, Any]]:
    """Every NDJSON line of a token stream, up to and including its end."""
    lines = []
    async with session.get(url, headers={"Authorization": f"Bearer {TOKENS[who]}"}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/x-ndjson"
        async for raw in resp.content:
            lines.append(json.loads(raw))
    return lines


def expect_output(lines: list[dict[str, Any]], n: int, seed: int = 7) -> None:
    """Every index 0..n-1 exactly once, in order, with its deterministic token, then the end."""
    assert lines[-1] == {"end": n}
    assert [(l["index"], l["token"]) for l in lines[:-1]] == [(i, token_at(seed, i)) for i in range(n)]


async def guarded(aw: Any) -> Any:
    return await asyncio.wait_for(aw, GUARD)


def session_id(reply_json: dict[str, Any]) -> uuid.UUID:
    return uuid.UUID(reply_json["session"])
