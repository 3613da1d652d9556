"""Shared helpers of the Index Service tests (no tests here): principals, records, and a real
aiohttp server on 127.0.0.1 port 0 driven by a real aiohttp client and a manual clock."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import ControlConfig, IndexConfig
from kvsp_moq.control.common.media import KVSP_JSON
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import INDEX_SERVICE, serve_index
from kvsp_moq.control.index.service import IndexService
from kvsp_moq.kvsp.compat import compat_id
from kvsp_moq.kvsp.container import replica_digest
from kvsp_moq.kvsp.naming import BlockName
from kvsp_moq.kvsp.records import InstanceStatusRecord, Link, Record, ReplicaRecord, Residency, dump_json

DESCRIPTOR: dict[str, Any] = {
    "model": "test/tiny",
    "model_digest": "sha-256:" + "11" * 32,
    "tokenizer_digest": "sha-256:" + "22" * 32,
    "layers": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "kv_dtype": "fp16",
    "positional": "none",
    "block_tokens": 16,
    "layout": "kvsp-layout-1",
}
COMPAT = compat_id(DESCRIPTOR)
LAYERS = DESCRIPTOR["layers"]
BLOCK_TOKENS = DESCRIPTOR["block_tokens"]
OTHER_COMPAT = hashlib.sha256(b"another compat").digest()

SCOPE_A = bytes.fromhex("a0" * 16)
SCOPE_B = bytes.fromhex("b0" * 16)

H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
H3 = "https://h3.example/kvsp/"
RELAY = "moqt://relay.example:4443/moq"
II7 = "https://ii7.example/kvsp/"
II8 = "https://ii8.example/kvsp/"
II9 = "https://ii9.example/kvsp/"

#: Principal name -> (token, principal). Tokens are 32 URL-safe characters.
PRINCIPALS: dict[str, Principal] = {
    "holder1": Principal("holder1", scopes=Grant(frozenset({SCOPE_A})), holders=Grant(frozenset({H1}))),
    "holder2": Principal("holder2", scopes=Grant(frozenset({SCOPE_A, SCOPE_B})), holders=Grant(frozenset({H2}))),
    "delegate": Principal("delegate", scopes=Grant(frozenset({SCOPE_A})), holders=Grant(frozenset({H1, H2, RELAY}))),
    "tenant-b": Principal("tenant-b", scopes=Grant(frozenset({SCOPE_B})), holders=Grant(frozenset({H1}))),
    "pc": Principal("pc", scopes=Grant(frozenset({SCOPE_A})), instances=Grant(everything=True)),
    "root": Principal("root", scopes=Grant(everything=True), holders=Grant(everything=True), instances=Grant(everything=True)),
    "nobody": Principal("nobody"),
}
TOKENS: dict[str, str] = {name: f"tok-{name}-".ljust(32, "x") for name in PRINCIPALS}
AUTH = Authorizer.from_tokens({TOKENS[name]: p for name, p in PRINCIPALS.items()})


def key(i: int) -> bytes:
    """A Block Key (any 32 octets will do for the index)."""
    return hashlib.sha256(f"block {i}".encode()).digest()


def replica(
    block_key: bytes,
    *,
    holder: str = H1,
    scope: bytes = SCOPE_A,
    compat: bytes = COMPAT,
    ttl_ms: int = 60_000,
    size: int = 4096,
    residency: Sequence[tuple[str, int, int, float | None]] | None = None,
    layers: int | None = LAYERS,
    replica_id: bytes = b"\x01" * 16,
) -> ReplicaRecord:
    """A valid Replica Record; ``residency`` entries are (tier, first, last, read_mbit_per_s)."""
    entries = residency if residency is not None else [("device", 0, LAYERS - 1, None)]
    digests = tuple(hashlib.sha256(block_key + bytes([i])).digest() for i in range(layers)) if layers else None
    namespace = None
    if holder.startswith("moqt:"):
        namespace = BlockName(compat_id=compat, scope_id=scope, block_key=block_key, replica_id=replica_id).moqt_namespace()
    return ReplicaRecord(
        block_key=block_key,
        compat_id=compat,
        scope_id=scope,
        holder=holder,
        codec=1,
        size=size,
        digest=replica_digest(digests) if digests else hashlib.sha256(block_key).digest(),
        layer_digests=digests,
        residency=tuple(Residency(tier=t, layers=(a, b), read_mbit_per_s=r) for t, a, b, r in entries),
        ttl_ms=ttl_ms,
        moqt_namespace=namespace,
    )


def status(
    instance: str,
    links: Mapping[str, tuple[float, float]] = {},
    *,
    prefill_tokens_per_s: float = 40_000,
    epoch: int = 1,
    ttl_ms: int = 3_000,
) -> InstanceStatusRecord:
    """An Instance Status Record; ``links`` maps holder -> (mbit_per_s, rtt_us)."""
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state="active",
        running=1,
        queued=0,
        batch_size=8,
        kv_utilization=0.5,
        prefill_tokens_per_s=prefill_tokens_per_s,
        decode_tokens_per_s=1000,
        links=tuple(Link(holder=h, mbit_per_s=m, rtt_us=r) for h, (m, r) in links.items()),
        ttl_ms=ttl_ms,
    )


def block_path(block_key: bytes, *, scope: bytes = SCOPE_A, compat: bytes = COMPAT) -> str:
    return f"replicas/{compat.hex()}/{scope.hex()}/{block_key.hex()}"


def lookup_body(keys: Sequence[bytes], *, scope: bytes = SCOPE_A, compat: bytes = COMPAT, targets: Sequence[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"scope_id": scope.hex(), "compat_id": compat.hex(), "block_keys": [k.hex() for k in keys]}
    if targets is not None:
        body["targets"] = list(targets)
    return body


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
        """The KVSP problem name, or the type URI if it is not a KVSP type."""
        assert self.content_type == "application/problem+json", (self.status, self.body)
        body = self.json
        assert body["status"] == self.status
        return body["type"].removeprefix("urn:kvsp:problem:")


@dataclass
class Ix:
    """A running Index Service and a client for it."""

    server: RunningServer
    clock: ManualClock
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def service(self) -> IndexService:
        return self.server.app[INDEX_SERVICE]

    async def request(
        self,
        method: str,
        path: str,
        *,
        who: str | None = "holder1",
        body: Record | Mapping[str, Any] | bytes | None = None,
        content_type: str | None = KVSP_JSON,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        hdrs = dict(headers or {})
        if who is not None:
            hdrs["Authorization"] = f"Bearer {TOKENS[who]}"
        data: bytes | None
        if isinstance(body, Record):
            data = dump_json(body)
        elif isinstance(body, Mapping):
            data = json.dumps(body).encode()
        else:
            data = body
        if data is not None and content_type is not None:
            hdrs["Content-Type"] = content_type
        async with self.session.request(method, self.url + path, data=data, params=params, headers=hdrs) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def put(self, record: ReplicaRecord, *, who: str = "holder1") -> Reply:
        return await self.request("PUT", block_path(record.block_key, scope=record.scope_id, compat=record.compat_id), who=who, body=record)

    async def delete(self, record: ReplicaRecord, *, who: str = "holder1") -> Reply:
        params = {"holder": record.holder}
        if record.moqt_namespace is not None:
            params["moqt_namespace"] = record.moqt_namespace
        return await self.request("DELETE", block_path(record.block_key, scope=record.scope_id, compat=record.compat_id), who=who, params=params)

    async def lookup(self, keys: Sequence[bytes], *, who: str = "holder1", **kw: Any) -> Reply:
        return await self.request("POST", "lookup", who=who, body=lookup_body(keys, **kw))


@asynccontextmanager
async def running_index(config: IndexConfig | None = None, *, auth: Authorizer = AUTH) -> AsyncIterator[Ix]:
    """An Index Service on 127.0.0.1, port 0, with a manual clock, and a client session."""
    clock = ManualClock(1_000_000)
    config = config if config is not None else IndexConfig(purge_interval_ms=0)
    async with await serve_index(ControlConfig(auth=auth, index=config), "127.0.0.1", 0, clock=clock) as server:
        async with aiohttp.ClientSession() as session:
            yield Ix(server, clock, session)
