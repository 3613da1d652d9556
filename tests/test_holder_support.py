"""Shared helpers of the holder tests (no tests here): a real Index Service and a real holder on
127.0.0.1 (port 0), one manual clock for both, a real aiohttp client, and an event log into
which the IS's store (real, recording) and the holder's store (an evict listener) write, so
tests assert the order of withdrawals and evictions, never timing."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from kvsp_moq.control.common.media import KVSP_JSON
from kvsp_moq.control.holder.serve import HOLDER_SERVICE, serve_holder
from kvsp_moq.control.holder.service import HolderService
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.index.store import BlockRef, MemoryIndexStore, ReplicaId
from kvsp_moq.kvsp.container import encode_container
from kvsp_moq.kvsp.records import Record, ReplicaRecord, dump_json
from kvsp_moq.storage import RecordKey

COMPAT = hashlib.sha256(b"holder test compat").digest()
SCOPE_A = bytes.fromhex("a1" * 16)
SCOPE_B = bytes.fromhex("b1" * 16)
LAYERS = 4
SECTION = 32  # octets of one K or V section
BLOCK_SIZE = LAYERS * 2 * SECTION  # octets a replica takes in a tier
CONTAINER_SIZE = 20 + 16 * LAYERS + BLOCK_SIZE

PRINCIPALS: dict[str, Principal] = {
    "holder-svc": Principal("holder-svc", scopes=Grant(everything=True), holders=Grant(everything=True)),
    "client-a": Principal("client-a", scopes=Grant(frozenset({SCOPE_A}))),
    "client-a2": Principal("client-a2", scopes=Grant(frozenset({SCOPE_A}))),
    "client-b": Principal("client-b", scopes=Grant(frozenset({SCOPE_B}))),
}
TOKENS: dict[str, str] = {name: f"tok-{name}-".ljust(32, "x") for name in PRINCIPALS}
AUTH = Authorizer.from_tokens({TOKENS[name]: p for name, p in PRINCIPALS.items()})


def bkey(i: int) -> bytes:
    return hashlib.sha256(f"holder block {i}".encode()).digest()


def rkey(i: int, scope: bytes = SCOPE_A) -> RecordKey:
    return RecordKey(COMPAT, scope, bkey(i))


def container(seed: int, *, layers: int = LAYERS, first: int = 0) -> bytes:
    """A codec-raw KVB1 container with distinct, seed-dependent sections."""
    sections = []
    for layer in range(first, first + layers):
        k = hashlib.sha256(f"k{seed}/{layer}".encode()).digest()[:SECTION]
        v = hashlib.sha256(f"v{seed}/{layer}".encode()).digest()[:SECTION]
        sections.append((k, v))
    return encode_container(1, first, 2, sections)


def block_path(i: int, scope: bytes = SCOPE_A) -> str:
    return f"blocks/{rkey(i, scope).path}"


class RecordingIndexStore(MemoryIndexStore):
    """The IS's real in-memory store, logging each put and delete into the shared event log."""

    def __init__(self, clock: ManualClock, events: list[tuple[str, str]]) -> None:
        super().__init__(clock)
        self.events = events

    async def put(self, record: ReplicaRecord, ttl_ms: int) -> bool:
        self.events.append(("is-put", record.block_key.hex()))
        return await super().put(record, ttl_ms)

    async def delete(self, block: BlockRef, replica: ReplicaId) -> bool:
        self.events.append(("is-delete", block.block_key.hex()))
        return await super().delete(block, replica)


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").split(";")[0].strip()

    @property
    def problem(self) -> str:
        assert self.content_type == "application/problem+json", (self.status, self.body)
        assert self.json["status"] == self.status
        return self.json["type"].removeprefix("urn:kvsp:problem:")


@dataclass
class H:
    """A running IS and holder sharing one manual clock, and a client."""

    index: RunningServer
    holder: RunningServer
    clock: ManualClock
    session: aiohttp.ClientSession
    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.holder.url

    @property
    def service(self) -> HolderService:
        return self.holder.app[HOLDER_SERVICE]

    async def request(
        self,
        method: str,
        path: str,
        *,
        who: str | None = "client-a",
        body: Record | Mapping[str, Any] | bytes | None = None,
        content_type: str | None = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        base: str | None = None,
    ) -> Reply:
        hdrs = dict(headers or {})
        if who is not None:
            hdrs["Authorization"] = f"Bearer {TOKENS[who]}"
        data: Any
        if isinstance(body, Record):
            data, content_type = dump_json(body), content_type or KVSP_JSON
        elif isinstance(body, Mapping):
            data, content_type = json.dumps(body).encode(), content_type or KVSP_JSON
        else:
            data = body
        if data is not None and content_type is not None:
            hdrs["Content-Type"] = content_type
        url = (base or self.url) + path
        async with self.session.request(method, url, data=data, params=params, headers=hdrs) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def put_block(self, i: int, data: bytes | None = None, *, who: str = "client-a", scope: bytes = SCOPE_A, **kw: Any) -> Reply:
        headers = kw.pop("headers", {"If-None-Match": "*"})
        return await self.request(
            "PUT", block_path(i, scope), who=who, body=container(i) if data is None else data,
            content_type=kw.pop("content_type", "application/kvsp-block"), headers=headers, **kw,
        )

    async def get_block(self, i: int, *, who: str = "client-a", scope: bytes = SCOPE_A, **kw: Any) -> Reply:
        return await self.request("GET", block_path(i, scope), who=who, **kw)

    async def lease(self, keys: list[int], ttl_ms: int = 10_000, *, who: str = "client-a", scope: bytes = SCOPE_A, **extra: Any) -> Reply:
        body = {"block_keys": [bkey(i).hex() for i in keys], "compat_id": COMPAT.hex(), "scope_id": scope.hex(), "ttl_ms": ttl_ms, **extra}
        return await self.request("POST", "leases", who=who, body=body)

    async def index_replicas(self, i: int) -> list[ReplicaRecord]:
        """The IS's unexpired records of block ``i`` (GET on the IS)."""
        reply = await self.request("GET", f"replicas/{rkey(i).path}", who="holder-svc", base=self.index.url)
        if reply.status == 404:
            return []
        assert reply.status == 200, reply.body
        return [ReplicaRecord.from_json(r) for r in reply.json["replicas"]]


def holder_config(**holder: Any) -> ControlConfig:
    tiers = holder.pop("tiers", (TierConfig("host", 16 * BLOCK_SIZE),))
    return ControlConfig(
        auth=AUTH,
        index=IndexConfig(purge_interval_ms=0),
        holder=HolderConfig(tiers=tiers, **holder),
    )


@asynccontextmanager
async def running_holder(*, index_url: str | None = None, **holder: Any) -> AsyncIterator[H]:
    """A real IS and a real holder publishing to it (``index_url`` overrides where)."""
    clock = ManualClock(5_000_000)
    events: list[tuple[str, str]] = []
    index_config = ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0))
    async with await serve_index(index_config, "127.0.0.1", 0, clock=clock, store=RecordingIndexStore(clock, events)) as index:
        config = holder_config(index_url=index_url or index.url, index_token=TOKENS["holder-svc"], **holder)
        async with await serve_holder(config, "127.0.0.1", 0, clock=clock) as server:
            service = server.app[HOLDER_SERVICE]
            service.store.add_evict_listener(lambda key, rid: events.append(("evict", key.block_key.hex())))
            async with aiohttp.ClientSession() as session:
                yield H(index, server, clock, session, events)
