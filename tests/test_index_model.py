"""Hypothesis: sequences of PUT, DELETE, clock advances and lookups against a reference model of
§6.1/§6.2 — the Index Service directly (many examples) and over real HTTP (fewer)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import IndexConfig
from kvsp_moq.control.common.errors import Forbidden, NotFound
from kvsp_moq.control.index.service import IndexService
from kvsp_moq.control.index.store import BlockRef, ReplicaId
from kvsp_moq.kvsp.records import LookupRequest
from test_index_support import COMPAT, H1, H2, PRINCIPALS, SCOPE_A, SCOPE_B, key, lookup_body, replica, running_index

MAX_TTL = 1_000
KEYS = 4
HOLDERS = (H1, H2)
SCOPES = (SCOPE_A, SCOPE_B)


@dataclass(frozen=True)
class Put:
    holder: int
    scope: int
    key: int
    ttl: int


@dataclass(frozen=True)
class Delete:
    holder: int
    scope: int
    key: int


@dataclass(frozen=True)
class Advance:
    ms: int


@dataclass(frozen=True)
class Lookup:
    scope: int
    keys: tuple[int, ...]
    who: str  # "root" (every scope) or "holder1" (scope A only)


ops = st.lists(
    st.one_of(
        st.builds(Put, st.integers(0, 1), st.integers(0, 1), st.integers(0, KEYS - 1), st.integers(1, 2 * MAX_TTL)),
        st.builds(Delete, st.integers(0, 1), st.integers(0, 1), st.integers(0, KEYS - 1)),
        st.builds(Advance, st.integers(0, MAX_TTL)),
        st.builds(Lookup, st.integers(0, 1), st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=KEYS + 1).map(tuple),
                  st.sampled_from(["root", "holder1"])),
    ),
    max_size=25,
)


@dataclass
class Model:
    """The reference: (scope, key, holder) -> expiry time."""

    now: int = 0
    expiry: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def live(self, scope: int, k: int) -> list[tuple[int, int]]:
        """(holder, remaining ms) of the unexpired replicas of a key, by holder URL."""
        out = [(h, self.expiry[(scope, k, h)] - self.now) for h in range(2) if self.expiry.get((scope, k, h), 0) > self.now]
        return sorted(out, key=lambda hr: HOLDERS[hr[0]])

    def put(self, op: Put) -> bool:
        created = self.expiry.get((op.scope, op.key, op.holder), 0) <= self.now
        self.expiry[(op.scope, op.key, op.holder)] = self.now + min(op.ttl, MAX_TTL)
        return created

    def delete(self, op: Delete) -> bool:
        existed = self.expiry.pop((op.scope, op.key, op.holder), 0) > self.now
        return existed

    def lookup(self, op: Lookup) -> list[list[tuple[int, int]]] | None:
        if op.who == "holder1" and op.scope != 0:
            return None  # not authorized for scope B: refused
        blocks = []
        for k in op.keys:
            live = self.live(op.scope, k)
            if not live:
                break  # §6.2: stop at the first key without a replica
            blocks.append(live)
        return blocks


def record_of(op: Put | Delete) -> object:
    return replica(key(op.key), holder=HOLDERS[op.holder], scope=SCOPES[op.scope], ttl_ms=getattr(op, "ttl", 1))


def as_model(blocks: list[dict]) -> list[list[tuple[int, int]]]:
    return [[(HOLDERS.index(r["holder"]), r["ttl_ms"]) for r in b["replicas"]] for b in blocks]


@settings(max_examples=150, deadline=None)
@given(ops)
def test_service_matches_the_model(script: list) -> None:
    async def run() -> None:
        clock = ManualClock(0)
        service = IndexService.in_memory(IndexConfig(max_ttl_ms=MAX_TTL), clock=clock)
        model = Model()
        for i, op in enumerate(script):
            if isinstance(op, Put):
                published = await service.publish(PRINCIPALS["root"], record_of(op))  # type: ignore[arg-type]
                assert published.created == model.put(op)
                assert published.record.ttl_ms == min(op.ttl, MAX_TTL)
            elif isinstance(op, Delete):
                expected = model.delete(op)
                block = BlockRef(COMPAT, SCOPES[op.scope], key(op.key))
                try:
                    await service.withdraw(PRINCIPALS["root"], block, ReplicaId(HOLDERS[op.holder]))
                    assert expected
                except NotFound:
                    assert not expected
            elif isinstance(op, Advance):
                clock.advance(op.ms)
                model.now += op.ms
            else:
                expected_blocks = model.lookup(op)
                request = LookupRequest.from_json(lookup_body([key(k) for k in op.keys], scope=SCOPES[op.scope]))
                try:
                    response = await service.lookup(PRINCIPALS[op.who], request)
                except Forbidden:
                    assert expected_blocks is None
                    continue
                assert expected_blocks is not None
                assert response.matched == len(expected_blocks)
                assert as_model([b.to_json() for b in response.blocks]) == expected_blocks
                assert all(r.scope_id == SCOPES[op.scope] for b in response.blocks for r in b.replicas)
            if i % 3 == 2:
                await service.purge()  # purging now and then changes nothing visible

    asyncio.run(run())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_http_matches_the_model(script: list) -> None:
    async def run() -> None:
        model = Model()
        async with running_index(IndexConfig(max_ttl_ms=MAX_TTL, purge_interval_ms=0)) as ix:
            for op in script:
                if isinstance(op, Put):
                    reply = await ix.put(record_of(op), who="root")  # type: ignore[arg-type]
                    assert reply.status == (201 if model.put(op) else 200)
                elif isinstance(op, Delete):
                    reply = await ix.delete(record_of(op), who="root")  # type: ignore[arg-type]
                    assert reply.status == (204 if model.delete(op) else 404)
                elif isinstance(op, Advance):
                    ix.clock.advance(op.ms)
                    model.now += op.ms
                else:
                    expected_blocks = model.lookup(op)
                    reply = await ix.lookup([key(k) for k in op.keys], who=op.who, scope=SCOPES[op.scope])
                    if expected_blocks is None:
                        assert reply.status == 403
                        continue
                    assert reply.status == 200
                    assert reply.json["matched"] == len(expected_blocks)
                    assert as_model(reply.json["blocks"]) == expected_blocks

    asyncio.run(run())
