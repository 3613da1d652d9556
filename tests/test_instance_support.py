"""Shared helpers of the PC and instance tests (no tests here): a real IS, real holders with
real BlockStores, a real PC and real instances on 127.0.0.1, one ManualClock for all, and a
slow holder double (a real aiohttp server whose block GET awaits an asyncio.Event)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvsp_moq.control.client.http import HttpPcClient
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import (
    ControlConfig,
    HolderConfig,
    IndexConfig,
    InstanceConfig,
    LinkConfig,
    PcConfig,
    TierConfig,
)
from kvsp_moq.control.common.media import KVSP_JSON
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.control.holder.serve import serve_holder
from kvsp_moq.control.http.server import RunningServer, serve_app
from kvsp_moq.control.index.serve import INDEX_SERVICE, serve_index
from kvsp_moq.control.index.service import IndexService
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE, serve_instance
from kvsp_moq.control.instance.service import InstanceService
from kvsp_moq.control.pc.serve import PC_SERVICE, serve_pc
from kvsp_moq.control.pc.service import PlacementController
from kvsp_moq.kvsp.compat import compat_id
from kvsp_moq.kvsp.container import decode_container, encode_container
from kvsp_moq.kvsp.records import Record, ReplicaRecord, Residency, dump_json

DESCRIPTOR: dict[str, Any] = {
    "model": "test/pc", "model_digest": "sha-256:" + "33" * 32, "tokenizer_digest": "sha-256:" + "44" * 32,
    "layers": 4, "kv_heads": 2, "head_dim": 8, "kv_dtype": "fp16", "positional": "none",
    "block_tokens": 16, "layout": "kvsp-layout-1",
}
COMPAT = compat_id(DESCRIPTOR)
BLOCK_TOKENS = 16
SCOPE_A = bytes.fromhex("a2" * 16)
SCOPE_B = bytes.fromhex("b2" * 16)
SECTION = 32

PRINCIPALS: dict[str, Principal] = {
    # the PC: reads scope A at the IS, reports statuses for every instance, calls instances
    "pc": Principal("pc", scopes=Grant(frozenset({SCOPE_A})), instances=Grant(everything=True)),
    # an instance: reports for itself, leases and reads blocks, publishes its replicas
    "inst": Principal("inst", scopes=Grant(everything=True), holders=Grant(everything=True), instances=Grant(everything=True)),
    "holder-svc": Principal("holder-svc", scopes=Grant(everything=True), holders=Grant(everything=True)),
    "client-a": Principal("client-a", scopes=Grant(frozenset({SCOPE_A}))),
    "pc-b": Principal("pc-b", scopes=Grant(frozenset({SCOPE_B})), instances=Grant(everything=True)),
    "stranger": Principal("stranger", scopes=Grant(frozenset({SCOPE_A}))),
}
TOKENS = {name: f"tok-{name}-".ljust(32, "x") for name in PRINCIPALS}
AUTH = Authorizer.from_tokens({TOKENS[n]: p for n, p in PRINCIPALS.items()})


def bkey(i: int) -> bytes:
    return hashlib.sha256(f"pc block {i}".encode()).digest()


def container(seed: int) -> bytes:
    sections = []
    for layer in range(4):
        k = hashlib.sha256(f"k{seed}/{layer}".encode()).digest()[:SECTION]
        v = hashlib.sha256(f"v{seed}/{layer}".encode()).digest()[:SECTION]
        sections.append((k, v))
    return encode_container(1, 0, BLOCK_TOKENS, sections)


def record_for(i: int, holder: str, *, scope: bytes = SCOPE_A, read_mbit_per_s: float | None = None) -> ReplicaRecord:
    """The Replica Record of ``container(i)`` at ``holder`` (for doubles, published directly)."""
    c = decode_container(container(i))
    return ReplicaRecord(
        block_key=bkey(i), compat_id=COMPAT, scope_id=scope, holder=holder, codec=1,
        size=len(container(i)), digest=c.replica_digest(), layer_digests=tuple(c.layer_digests()),
        residency=(Residency(tier="host", layers=(0, 3), read_mbit_per_s=read_mbit_per_s),), ttl_ms=600_000,
    )


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def problem(self) -> str:
        assert self.headers.get("Content-Type", "").startswith("application/problem+json"), (self.status, self.body)
        return self.json["type"].removeprefix("urn:kvsp:problem:")


async def call(
    session: aiohttp.ClientSession, method: str, url: str, *, who: str | None = "pc",
    body: Record | Mapping[str, Any] | bytes | None = None, content_type: str = KVSP_JSON,
    extra: Mapping[str, str] | None = None,
) -> Reply:
    headers = {"Authorization": f"Bearer {TOKENS[who]}"} if who else {}
    headers.update(extra or {})
    data: bytes | None = None
    if isinstance(body, Record):
        data = dump_json(body)
    elif isinstance(body, Mapping):
        data = json.dumps(body).encode()
    else:
        data = body
    if data is not None:
        headers["Content-Type"] = content_type
    async with session.request(method, url, data=data, headers=headers) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


@dataclass
class SlowHolder:
    """A real HTTP holder double: leases always granted; block GETs wait for ``release``
    (an asyncio.Event, never a sleep); ``tamper`` flips a byte (with a matching Repr-Digest)."""

    url: str
    release: asyncio.Event
    entered: asyncio.Event
    events: list[str]
    tamper: bool = False


@asynccontextmanager
async def slow_holder(blocks: dict[bytes, bytes], *, stalled: bool = True, tamper: bool = False,
                      entered_after: int = 1) -> AsyncIterator[SlowHolder]:
    """A holder whose block GETs wait for ``release``; ``entered`` is set once
    ``entered_after`` GETs are waiting at the same time or have passed."""
    release, entered = asyncio.Event(), asyncio.Event()
    if not stalled:
        release.set()
    events: list[str] = []
    counter = iter(range(1_000_000))

    async def post_lease(request: web.Request) -> web.Response:
        body = await request.json()
        lease = f"lease{next(counter)}"
        events.append(f"lease {body['block_keys'][0][:8]} {body['ttl_ms']}")
        return web.json_response({"lease": lease, "ttl_ms": body["ttl_ms"]}, status=201, content_type=KVSP_JSON)

    async def delete_lease(request: web.Request) -> web.Response:
        events.append(f"release {request.match_info['lease']}")
        return web.Response(status=204)

    async def get_block(request: web.Request) -> web.Response:
        key = bytes.fromhex(request.match_info["key"])
        events.append(f"get {key.hex()[:8]}")
        if sum(e.startswith("get ") for e in events) >= entered_after:
            entered.set()
        await release.wait()
        body = bytearray(blocks[key])
        if tamper:
            body[-3] ^= 0x01
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        return web.Response(body=bytes(body), headers={"Content-Type": "application/kvsp-block", "Repr-Digest": f"sha-256=:{digest}:"})

    app = web.Application()
    app.router.add_post("/leases", post_lease)
    app.router.add_delete("/leases/{lease}", delete_lease)
    app.router.add_get("/blocks/{compat}/{scope}/{key}", get_block)
    server = await serve_app(app, "127.0.0.1", 0)
    try:
        yield SlowHolder(server.url, release, entered, events, tamper)
    finally:
        release.set()
        await server.close()


@dataclass
class World:
    clock: ManualClock
    index: RunningServer
    holders: list[RunningServer]
    pc: RunningServer
    session: aiohttp.ClientSession
    stack: AsyncExitStack
    instances: list[RunningServer] = field(default_factory=list)

    @property
    def is_service(self) -> IndexService:
        return self.index.app[INDEX_SERVICE]

    @property
    def pc_service(self) -> PlacementController:
        return self.pc.app[PC_SERVICE]

    async def put_block(self, holder: int, i: int) -> None:
        reply = await call(self.session, "PUT", f"{self.holders[holder].url}blocks/{COMPAT.hex()}/{SCOPE_A.hex()}/{bkey(i).hex()}",
                           who="holder-svc", body=container(i), content_type="application/kvsp-block",
                           extra={"If-None-Match": "*"})
        reply_ok = reply.status == 201
        assert reply_ok, reply.body

    async def publish(self, record: ReplicaRecord) -> None:
        reply = await call(self.session, "PUT", f"{self.index.url}replicas/{COMPAT.hex()}/{record.scope_id.hex()}/{record.block_key.hex()}",
                           who="holder-svc", body=record)
        assert reply.status in (200, 201), reply.body

    async def start_instance(self, *, report: bool = False, **overrides: Any) -> RunningServer:
        epoch = overrides.pop("epoch", 1)
        links = overrides.pop("links", tuple(LinkConfig(h.url, 8000.0, 10.0) for h in self.holders))
        tls = overrides.pop("tls", TlsConfig())  # [tls]: e.g. the CA of a test's MOQT holder
        ic = InstanceConfig(index_url=self.index.url, pc_url=self.pc.url, token=TOKENS["inst"], links=links,
                            tiers=(TierConfig("host", 1 << 20),), **overrides)
        config = ControlConfig(auth=AUTH, instance=ic, tls=tls)
        server = await self.stack.enter_async_context(await serve_instance(config, clock=self.clock, epoch=epoch, report=report))
        self.instances.append(server)
        return server


def instance_service(server: RunningServer) -> InstanceService:
    return server.app[INSTANCE_SERVICE]


async def _leading(leader: Any) -> None:
    while not leader.leading:
        await leader.changed.wait()  # set, then replaced, at every change


@asynccontextmanager
async def world(*, holders: int = 2, pc: PcConfig | None = None, **pc_kw: Any) -> AsyncIterator[World]:
    clock = ManualClock(10_000_000)
    async with AsyncExitStack() as stack:
        index_cfg = ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0, descriptors=(DESCRIPTOR,)))
        index = await stack.enter_async_context(await serve_index(index_cfg, clock=clock))
        servers = []
        for _ in range(holders):
            hc = ControlConfig(auth=AUTH, holder=HolderConfig(index_url=index.url, index_token=TOKENS["holder-svc"],
                                                            tiers=(TierConfig("host", 1 << 20),)))
            servers.append(await stack.enter_async_context(await serve_holder(hc, clock=clock)))
        pcc = pc or PcConfig(index_url=index.url, index_token=TOKENS["pc"], instance_token=TOKENS["pc"])
        pc_server = await stack.enter_async_context(await serve_pc(ControlConfig(auth=AUTH, pc=pcc), clock=clock, **pc_kw))
        # With a shared store the PC answers once it holds the leader lock: its first try may
        # miss (a slow Redis or replica WAIT), the next comes a third of a lease later.
        await asyncio.wait_for(_leading(pc_server.app[PC_SERVICE].leader), 30)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield World(clock, index, servers, pc_server, session, stack)


__all__ = ["HttpPcClient"]
