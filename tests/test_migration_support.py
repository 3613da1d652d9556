"""Shared helpers of the model-backed migration tests (no tests here).

A real cluster on 127.0.0.1: an Index Service, an HTTP holder, a PC and a front end served in
this process (so the tests can observe the front end's deliveries and the PC's checkpoints at
the instant they happen), and inference instances as real ``python -m kvsp_moq instance``
processes running the tiny reference model, which the tests kill with SIGKILL. Nothing waits
by sleeping: every wait is on a process line, an HTTP answer, a stream or an event.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import MonotonicClock
from kvsp_moq.control.common.config import (
    ControlConfig,
    FrontEndConfig,
    HolderConfig,
    IndexConfig,
    PcConfig,
    TierConfig,
)
from kvsp_moq.control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from kvsp_moq.control.frontend.service import FrontEnd
from kvsp_moq.control.holder.serve import serve_holder
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.pc.serve import PC_SERVICE, serve_pc
from kvsp_moq.control.pc.service import PlacementController
from kvsp_moq.kvsp import scope

GUARD = 60.0  # a safety net against hangs, never a way to wait for something
B = 16  # block_tokens: several blocks per context, a fast suite
MiB = 1 << 20
TOKEN = "migration-test-token-" + secrets.token_hex(8)
SCOPE_KEY = secrets.token_bytes(32)
SCOPE_ID = scope.scope_id(SCOPE_KEY)
PROMPT = "System: answer briefly. User: what is KVSP? Assistant:"
PRINCIPALS_TOML = (f'[[principals]]\nname = "all"\ntoken = "{TOKEN}"\nscopes = ["*"]\nholders = ["*"]\n'
                   'instances = ["*"]\n')


def everyone() -> Authorizer:
    return Authorizer.from_tokens({TOKEN: Principal("all", scopes=Grant(everything=True), holders=Grant(everything=True),
                                                    instances=Grant(everything=True))})


async def guarded(aw: Any) -> Any:
    return await asyncio.wait_for(aw, GUARD)


@dataclass
class Reply:
    status: int
    body: bytes
    json: Any
    problem: str | None


@dataclass
class InstanceProcess:
    url: str
    proc: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Cluster:
    """The roles of one test and the instance processes it started."""

    tmp: Path
    model_dir: Path
    compat_id: bytes
    http: aiohttp.ClientSession
    index: RunningServer
    holder: RunningServer
    pc: RunningServer | None  # None: the PCs are processes (``pc_urls``, tests/test_pc_failover.py)
    fe: RunningServer
    instances: dict[str, InstanceProcess] = field(default_factory=dict)
    pc_urls: tuple[str, ...] = ()

    @property
    def pc_service(self) -> PlacementController:
        assert self.pc is not None
        return self.pc.app[PC_SERVICE]

    def pc_keys(self) -> str:
        """The ``[instance]`` keys naming the PC(s)."""
        if self.pc_urls:
            return f"pc_urls = {json.dumps(list(self.pc_urls))}\npc_failover_ms = 30000\n"
        assert self.pc is not None
        return f'pc_url = "{self.pc.url}"\n'

    @property
    def fe_service(self) -> FrontEnd:
        return self.fe.app[FRONTEND_SERVICE]

    async def start_instance(self, name: str, *, status_ttl_ms: int = 30_000, checkpoint_every: int = 64,
                             engine: bool = True, load_timeout_ms: int = 10_000, block_tokens: int = B) -> str:
        """``python -m kvsp_moq instance``, with ``[instance.engine]`` (the model; sessions run on
        it) unless ``engine`` is false; ``block_tokens`` other than ``B`` makes it another model
        (another Compatibility ID, §4.1). It reports to the PC before it prints its URL, so the PC
        knows it (active) once this returns."""
        (self.tmp / "scope.key").write_text(SCOPE_KEY.hex() + "\n")
        config = self.tmp / f"{name}.toml"
        text = (PRINCIPALS_TOML
                + f'[instance]\n{self.pc_keys()}index_url = "{self.index.url}"\ntoken = "{TOKEN}"\n'
                f"status_ttl_ms = {status_ttl_ms}\ncheckpoint_every = {checkpoint_every}\n"
                f"session_load_timeout_ms = {load_timeout_ms}\n")
        if engine:
            text += (f'[instance.engine]\nmodel_dir = "{self.model_dir}"\nblock_tokens = {block_tokens}\ntorch_threads = 1\n'
                     f'holder_url = "{self.holder.url}"\nscope_key_files = ["scope.key"]\n')
        config.write_text(text)
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvsp_moq", "instance", "--listen", "127.0.0.1:0", "--config", str(config),
                stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        line = (await guarded(proc.stdout.readline())).decode()
        prefix = "kvsp instance: listening on "
        assert line.startswith(prefix), (line, log.read_text()[-4000:])
        url = line[len(prefix):].strip()
        self.instances[url] = InstanceProcess(url, proc, log)
        return url

    def kill(self, url: str) -> None:
        """SIGKILL: the instance ends at once, mid-whatever, with no goodbye."""
        os.kill(self.instances[url].pid, signal.SIGKILL)

    async def wait_dead(self, url: str) -> int:
        return int(await guarded(self.instances[url].proc.wait()))

    async def call(self, method: str, url: str, body: Any = None, *, content_type: str = "application/kvsp+json",
                   params: dict[str, str] | None = None) -> Reply:
        data = body if isinstance(body, (bytes, bytearray)) or body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {TOKEN}"}
        if data is not None:
            headers["Content-Type"] = content_type
        async with self.http.request(method, url, data=data, headers=headers, params=params) as resp:
            raw = await resp.read()
            try:
                parsed = json.loads(raw) if raw and resp.content_type != "application/kvsp-block" else None
            except ValueError:
                parsed = None
            problem = parsed["type"].rsplit("/", 1)[-1].rsplit(":", 1)[-1] if isinstance(parsed, dict) and "type" in parsed else None
            return Reply(resp.status, raw, parsed, problem)

    async def open_session(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.call("POST", f"{self.fe.url}sessions", body)
        assert reply.status == 201, reply.body
        return reply.json

    async def stream(self, tokens_url: str) -> list[dict[str, Any]]:
        """Every NDJSON line of the client's stream, up to and including its end."""
        lines = []
        async with self.http.get(tokens_url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                lines.append(json.loads(raw))
        return lines

    def logs(self) -> str:
        return "\n".join(f"--- {p.url}\n{p.log.read_text()[-3000:]}" for p in self.instances.values())


@asynccontextmanager
async def cluster(tmp: Path, model_dir: Path, descriptor: dict[str, Any], compat_id: bytes, *,
                  pc_urls: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """The roles in this process; with ``pc_urls`` the PCs are the caller's processes (the
    front end and the instances fail over between them)."""
    auth = everyone()
    clock = MonotonicClock()
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        index = await stack.enter_async_context(await serve_index(
            ControlConfig(auth=auth, index=IndexConfig(descriptors=(descriptor,))), clock=clock))
        hc = HolderConfig(index_url=index.url, index_token=TOKEN, tiers=(TierConfig("host", 64 * MiB),))
        holder = await stack.enter_async_context(await serve_holder(ControlConfig(auth=auth, holder=hc), clock=clock))
        pc = None
        if not pc_urls:
            pcc = PcConfig(index_url=index.url, index_token=TOKEN, instance_token=TOKEN)
            pc = await stack.enter_async_context(await serve_pc(ControlConfig(auth=auth, pc=pcc), clock=clock))
        fc = (FrontEndConfig(pc_urls=pc_urls, pc_token=TOKEN, pc_failover_ms=30_000) if pc_urls
              else FrontEndConfig(pc_url=pc.url if pc else None, pc_token=TOKEN))
        fe = await stack.enter_async_context(await serve_frontend(ControlConfig(auth=auth, frontend=fc)))
        c = Cluster(tmp, model_dir, compat_id, http, index, holder, pc, fe, pc_urls=pc_urls)
        try:
            yield c
        finally:
            for p in c.instances.values():
                if p.proc.returncode is None:
                    p.proc.send_signal(signal.SIGCONT)  # one a test paused, were it to fail meanwhile
                    p.proc.send_signal(signal.SIGTERM)
            for p in c.instances.values():
                await asyncio.wait_for(p.proc.wait(), GUARD)


def sampler_json(method: str = "greedy", *, seed: int = 0, p: float = 0.9, deterministic: bool = True) -> dict[str, Any]:
    params: dict[str, Any] = {} if method == "greedy" else {"p": p, "temperature": 1.0}
    return {"method": method, "params": params, "seed": seed, "step": 0, "deterministic": deterministic}
