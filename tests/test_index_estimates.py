"""Placement estimates (kvsp-draft §6.4) as pure functions, and in lookups with targets (§6.2).

Expected values are computed in each test from the formula,

    fetch_us(i) = max over sources s of ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)

with the sources that the documented choice (fastest finish, ties to the smaller URL) picks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.control.common.config import IndexConfig
from kvsp_moq.control.common.estimates import (
    estimate_target,
    layer_count,
    needed_layers,
    plan_fetch,
    recompute_us,
    transfer_us,
)
from kvsp_moq.kvsp.records import Link, LookupResponse
from test_index_support import (
    BLOCK_TOKENS,
    COMPAT,
    DESCRIPTOR,
    H1,
    H2,
    H3,
    II7,
    II8,
    II9,
    LAYERS,
    OTHER_COMPAT,
    Ix,
    key,
    replica,
    running_index,
    status,
)

SIZE = 4096  # octets of a whole block
PER_LAYER = SIZE / LAYERS


def links(**by_holder: tuple[float, float]) -> dict[str, Link]:
    names = {"h1": H1, "h2": H2, "h3": H3}
    return {names[h]: Link(holder=names[h], mbit_per_s=m, rtt_us=r) for h, (m, r) in by_holder.items()}


# ---------------------------------------------------------------------------------------------
# Pure functions


def test_recompute_us() -> None:
    assert recompute_us(32, 40_000) == 1e6 * 32 / 40_000
    assert recompute_us(0, 40_000) == 0.0
    assert recompute_us(0, 0) == 0.0
    assert recompute_us(16, 0) is None  # no prefill rate: unbounded, not estimable


def test_transfer_us_is_bits_over_mbit_per_s() -> None:
    assert transfer_us(1_000_000, 8) == 1_000_000.0  # 8 Mbit at 8 Mbit/s: one second
    assert transfer_us(125, 1) == 1000.0


def test_one_source_with_a_storage_tier() -> None:
    # Layers 0-1 in device memory (link rate), 2-3 in host memory read at 400 Mbit/s,
    # below the 1000 Mbit/s link: those layers move at 400.
    rec = [replica(key(i), holder=H1, size=SIZE, residency=[("device", 0, 1, None), ("host", 2, 3, 400.0)]) for i in range(2)]
    plan = plan_fetch(II7, links(h1=(1000, 50)), [[r] for r in rec], layers=LAYERS)
    assert plan is not None
    per_block = 8 * (2 * PER_LAYER) / 1000 + 8 * (2 * PER_LAYER) / 400
    assert plan.fetch_us == pytest.approx(50 + 2 * per_block)
    assert [(a.holder, a.layers) for a in plan.assignments] == [(H1, (range(0, 4),))] * 2


def test_a_tier_faster_than_the_link_does_not_raise_the_rate() -> None:
    rec = replica(key(0), size=SIZE, residency=[("host", 0, 3, 5000.0)])
    plan = plan_fetch(II7, links(h1=(1000, 5)), [[rec]], layers=LAYERS)
    assert plan is not None and plan.fetch_us == pytest.approx(5 + 8 * SIZE / 1000)


def test_two_equal_sources_load_in_parallel() -> None:
    blocks = [[replica(key(i), holder=H1, size=SIZE), replica(key(i), holder=H2, size=SIZE)] for i in range(2)]
    plan = plan_fetch(II7, links(h1=(1000, 10), h2=(1000, 10)), blocks, layers=LAYERS)
    assert plan is not None
    # Block 0 to h1 (tie, smaller URL), block 1 to h2 (finishes sooner than a second on h1).
    assert [a.holder for a in plan.assignments] == [H1, H2]
    assert plan.fetch_us == pytest.approx(max(10 + 8 * SIZE / 1000, 10 + 8 * SIZE / 1000))
    assert dict(plan.source_us) == pytest.approx({H1: 10 + 8 * SIZE / 1000, H2: 10 + 8 * SIZE / 1000})


def test_a_slow_source_is_not_used_when_the_fast_one_finishes_first() -> None:
    blocks = [[replica(key(i), holder=H1, size=SIZE), replica(key(i), holder=H2, size=SIZE)] for i in range(2)]
    plan = plan_fetch(II7, links(h1=(1000, 10), h2=(100, 10)), blocks, layers=LAYERS)
    assert plan is not None
    assert [a.holder for a in plan.assignments] == [H1, H1]
    assert plan.fetch_us == pytest.approx(10 + 8 * (2 * SIZE) / 1000)


def test_the_smaller_replica_is_fetched() -> None:
    small = replica(key(0), holder=H2, size=1024)  # another codec, fewer octets
    plan = plan_fetch(II7, links(h1=(1000, 10), h2=(1000, 10)), [[replica(key(0), holder=H1, size=SIZE), small]], layers=LAYERS)
    assert plan is not None and plan.fetch_us == pytest.approx(10 + 8 * 1024 / 1000)


def test_blocks_resident_at_the_instance_are_not_fetched() -> None:
    at_ii7 = replica(key(0), holder=II7, size=SIZE)
    blocks = [[at_ii7, replica(key(0), holder=H1, size=SIZE)], [replica(key(1), holder=H1, size=SIZE)]]
    plan = plan_fetch(II7, links(h1=(1000, 10)), blocks, layers=LAYERS)
    assert plan is not None
    assert [a.block_key for a in plan.assignments] == [key(1)]
    assert plan.fetch_us == pytest.approx(10 + 8 * SIZE / 1000)
    # Everything resident: nothing to fetch, and no link needed.
    assert plan_fetch(II7, {}, [[at_ii7]], layers=LAYERS).fetch_us == 0.0  # type: ignore[union-attr]


def test_layers_resident_at_the_instance_are_not_fetched() -> None:
    part = replica(key(0), holder=II7, size=SIZE, residency=[("device", 0, 1, None)])
    plan = plan_fetch(II7, links(h1=(1000, 10)), [[part, replica(key(0), holder=H1, size=SIZE)]], layers=LAYERS)
    assert plan is not None
    assert plan.assignments[0].layers == (range(2, 4),)
    assert plan.fetch_us == pytest.approx(10 + 8 * (2 * PER_LAYER) / 1000)


def test_layers_split_across_partial_replicas() -> None:
    # No source has every layer: layers 0-1 only at h1, 2-3 only at h2.
    blocks = [[replica(key(0), holder=H1, size=SIZE, residency=[("device", 0, 1, None)]),
               replica(key(0), holder=H2, size=SIZE, residency=[("device", 2, 3, None)])]]
    plan = plan_fetch(II7, links(h1=(1000, 10), h2=(1000, 20)), blocks, layers=LAYERS)
    assert plan is not None
    assert sorted((a.holder, a.layers) for a in plan.assignments) == [(H1, (range(0, 2),)), (H2, (range(2, 4),))]
    assert plan.fetch_us == pytest.approx(max(10 + 8 * (2 * PER_LAYER) / 1000, 20 + 8 * (2 * PER_LAYER) / 1000))


def test_not_estimable_without_a_link_to_a_holder_of_every_layer() -> None:
    only_h2 = [[replica(key(0), holder=H2, size=SIZE)]]
    assert plan_fetch(II7, links(h1=(1000, 10)), only_h2, layers=LAYERS) is None
    half = [[replica(key(0), holder=H1, size=SIZE, residency=[("device", 0, 1, None)])]]
    assert plan_fetch(II7, links(h1=(1000, 10)), half, layers=LAYERS) is None


def test_no_blocks_cost_nothing() -> None:
    plan = plan_fetch(II7, {}, [], layers=LAYERS)
    assert plan is not None and plan.fetch_us == 0.0 and plan.assignments == ()


def test_layer_count_without_a_descriptor() -> None:
    with_digests = replica(key(0), layers=6, residency=[("device", 0, 1, None)])
    assert layer_count([with_digests]) == 6
    without = replica(key(0), layers=None, residency=[("device", 0, 2, None), ("host", 5, 7, None)])
    assert layer_count([without]) == 8
    assert layer_count([without], 40) == 40
    assert needed_layers(II7, [replica(key(0), holder=II7, residency=[("device", 1, 2, None)])], 4) == (range(0, 1), range(3, 4))


def test_estimate_target() -> None:
    blocks = [[replica(key(i), holder=H1, size=SIZE)] for i in range(3)]
    est = estimate_target(status(II7, {H1: (2000, 7)}, prefill_tokens_per_s=25_000), blocks, block_tokens=16, layers=LAYERS)
    assert est is not None and est.instance == II7
    assert est.fetch_us == pytest.approx(7 + 8 * (3 * SIZE) / 2000)
    assert est.recompute_us == pytest.approx(1e6 * 3 * 16 / 25_000)
    assert estimate_target(status(II7, {H1: (2000, 7)}, prefill_tokens_per_s=0), blocks, block_tokens=16) is None
    assert estimate_target(status(II7, {}), blocks, block_tokens=16) is None


HOLDERS = [H1, H2, H3]


@st.composite
def scenario(draw: st.DrawFn) -> tuple[dict[str, Link], list[list]]:
    linked = draw(st.lists(st.sampled_from(HOLDERS), unique=True))
    link_map = {h: Link(holder=h, mbit_per_s=draw(st.integers(1, 10_000)), rtt_us=draw(st.integers(0, 1000))) for h in linked}
    blocks = []
    for i in range(draw(st.integers(0, 4))):
        replicas = []
        for holder in draw(st.lists(st.sampled_from(HOLDERS + [II7]), min_size=1, max_size=3, unique=True)):
            first = draw(st.integers(0, LAYERS - 1))
            last = draw(st.integers(first, LAYERS - 1))
            split = draw(st.integers(first, last))
            entries: list[tuple[str, int, int, float | None]] = [("device", first, split, None)]
            if split < last:
                entries.append(("disk", split + 1, last, float(draw(st.integers(1, 5000)))))
            replicas.append(replica(key(i), holder=holder, size=draw(st.integers(0, 10**6)), residency=entries))
        blocks.append(replicas)
    return link_map, blocks


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_plan_is_consistent_with_the_formula(case: tuple[dict[str, Link], list[list]]) -> None:
    link_map, blocks = case
    plan = plan_fetch(II7, link_map, blocks, layers=LAYERS)
    needed = [needed_layers(II7, b, LAYERS) for b in blocks]
    linked_layers = [
        {layer for r in b if r.holder in link_map for rng in r.resident_layers() for layer in rng} for b in blocks
    ]
    estimable = all({l for rng in n for l in rng} <= have for n, have in zip(needed, linked_layers))
    assert (plan is not None) == estimable
    if plan is None:
        return
    # Every needed layer is loaded exactly once, from a linked holder that has it.
    for i, block in enumerate(blocks):
        loaded = [l for a in plan.assignments if a.block_key == key(i) for rng in a.layers for l in rng]
        assert sorted(loaded) == sorted(l for rng in needed[i] for l in rng)
        for a in plan.assignments:
            if a.block_key == key(i):
                assert a.holder in link_map and a.holder != II7
                assert any(r.holder == a.holder and all(r.holds_layers(g.start, g.stop - 1) for g in a.layers) for r in block)
    # fetch_us is the formula's max over the sources used.
    for holder, total in plan.source_us.items():
        assert total == pytest.approx(link_map[holder].rtt_us + sum(a.transfer_us for a in plan.assignments if a.holder == holder))
    assert plan.fetch_us == pytest.approx(max(plan.source_us.values(), default=0.0))


# ---------------------------------------------------------------------------------------------
# Lookup with targets (§6.2)


@pytest.fixture
async def ix() -> AsyncIterator[Ix]:
    async with running_index(IndexConfig(descriptors=(DESCRIPTOR,), purge_interval_ms=0)) as ix:
        yield ix


async def test_lookup_with_targets(ix: Ix) -> None:
    await ix.put(replica(key(0), holder=H1, size=SIZE, residency=[("device", 0, 1, None), ("host", 2, 3, 400.0)]))
    await ix.put(replica(key(1), holder=H1, size=SIZE))
    await ix.put(replica(key(1), holder=H2, size=SIZE), who="holder2")
    for record in (status(II7, {H1: (1000, 50), H2: (1000, 80)}, prefill_tokens_per_s=32_000),
                   status(II8, {}, prefill_tokens_per_s=10_000)):
        assert (await ix.request("PUT", "instance-status", who="pc", body=record)).status == 200

    reply = await ix.lookup([key(0), key(1), key(2)], targets=[II7, II8, II9, II7])
    assert reply.status == 200
    response = LookupResponse.from_json(reply.json)
    assert response.matched == 2
    # II8 reports no links (not estimable), II9 no status: both left out; II7 once.
    assert [t.instance for t in response.targets or ()] == [II7]
    (est,) = response.targets or ()
    # Block 0 only at h1: 2 layers at the link rate, 2 read from host at 400 Mbit/s.
    block0 = 8 * (2 * PER_LAYER) / 1000 + 8 * (2 * PER_LAYER) / 400
    block1_h1, block1_h2 = 8 * SIZE / 1000, 8 * SIZE / 1000
    # Block 0 (the longer) goes to h1 first; block 1 then finishes sooner on h2 (80 + 32.8)
    # than after block 0 on h1 (50 + 57.3 + 32.8).
    assert 80 + block1_h2 < 50 + block0 + block1_h1
    assert est.fetch_us == pytest.approx(max(50 + block0, 80 + block1_h2))
    assert est.recompute_us == pytest.approx(1e6 * 2 * BLOCK_TOKENS / 32_000)

    ix.clock.advance(3_000)  # the status records expire: no estimates
    reply = await ix.lookup([key(0)], targets=[II7])
    assert reply.json["targets"] == [] and reply.json["matched"] == 1


async def test_lookup_with_targets_and_no_match(ix: Ix) -> None:
    await ix.request("PUT", "instance-status", who="pc", body=status(II7, {}, prefill_tokens_per_s=32_000))
    reply = await ix.lookup([key(5)], targets=[II7])
    assert reply.json == {"matched": 0, "blocks": [], "targets": [{"instance": II7, "fetch_us": 0.0, "recompute_us": 0.0}]}


async def test_lookup_with_targets_for_an_unknown_compat(ix: Ix) -> None:
    await ix.put(replica(key(0), compat=OTHER_COMPAT))
    await ix.request("PUT", "instance-status", who="pc", body=status(II7, {H1: (1000, 1)}))
    reply = await ix.lookup([key(0)], compat=OTHER_COMPAT, targets=[II7])
    assert reply.json["matched"] == 1 and reply.json["targets"] == []  # no block_tokens known


async def test_lookup_estimates_after_a_descriptor_is_registered() -> None:
    async with running_index(IndexConfig(purge_interval_ms=0)) as ix:
        await ix.put(replica(key(0), size=SIZE))
        await ix.request("PUT", "instance-status", who="pc", body=status(II7, {H1: (1000, 1)}, prefill_tokens_per_s=16_000))
        assert (await ix.lookup([key(0)], targets=[II7])).json["targets"] == []
        assert (await ix.request("PUT", f"descriptors/{key(0).hex()}", body=DESCRIPTOR)).status == 400
        assert (await ix.request("PUT", f"descriptors/{COMPAT.hex()}", body=DESCRIPTOR)).status == 201
        (est,) = (await ix.lookup([key(0)], targets=[II7])).json["targets"]
        assert est == {"instance": II7, "fetch_us": pytest.approx(1 + 8 * SIZE / 1000), "recompute_us": pytest.approx(1e6 * 16 / 16_000)}
