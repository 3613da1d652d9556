"""The relay never caches an object that does not match its layer digest (relay/fetch/digests.py,
docs/relay.md "Cache and FETCH"), over real QUIC on 127.0.0.1: a real holder (BlockStore +
MoqtHolder) publishes its replicas through a real relay; one replica's layer BAD flips a
bit in the holder's tier AFTER its record and layer digests were computed, so the holder's
FETCH_OK still declares the right LAYER_DIGESTS and only hashing the payload can tell. The
consumer loads with ``load_block`` through the relay (it verifies every layer itself,
binding §4). ``until`` polls relay state with a bound that fails loudly; no sleeps.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import pytest

from bridge_support import (
    HolderNode,
    client_config,
    make_key,
    make_layers,
    server_config,
    until,
    within,
)
from kvsp_moq.bridge import binding, load_block, sink_for_record
from kvsp_moq.moqt.messages import FetchOk
from kvsp_moq.moqt.objects import ObjectBegin, ObjectEnd, ObjectPayload, ObjectStatus
from kvsp_moq.storage import RecordKey
from relay import ObjectCache, Relay, RelayConfig, RelayStats
from relay.fetch.digests import FIRST_LAYER, LAYER_COUNT, LAYER_DIGESTS, LayerDigests
from relay.fetch.inflight import FetchRange, UpstreamFetch
from relay.ops.metrics import render_metrics

LAYERS = 8
BAD = 3


# -- the property codes and their reading ------------------------------------------------------
def test_the_relay_reads_the_binding_s_property_codes() -> None:
    """relay/fetch/digests.py may not import the bridge (tests/test_layering.py): its codes are the
    binding's, and it reads the binding's own Track Properties as ``TrackInfo`` does."""
    assert (LAYER_DIGESTS, FIRST_LAYER, LAYER_COUNT) == \
        (binding.LAYER_DIGESTS, binding.FIRST_LAYER, binding.LAYER_COUNT)
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    props = binding.track_properties(token_count=16, first_layer=12, layer_count=4,
                                     layer_digests=digests, max_cache_duration_ms=1000)
    d = LayerDigests.of(props)
    assert d is not None and (d.first, d.count) == (12, 4)
    info = binding.TrackInfo.parse(props)
    assert info.layer_digests is not None
    assert {layer: d.expected(0, layer) for layer in info.layers} == info.layer_digests
    # Not covered: another group, an Object ID outside the layers, a status that has no payload.
    assert d.expected(1, 12) is None and d.expected(0, 11) is None and d.expected(0, 16) is None
    assert d.check(0, 12, ObjectStatus.END_OF_GROUP) is None
    c = d.check(0, 13, ObjectStatus.NORMAL, [memoryview(b"\x01")])
    assert c is not None and c.matches()
    # Nothing to verify against: no LAYER_DIGESTS (a replica still being computed), or one
    # that does not fit LAYER_COUNT.
    partial = binding.track_properties(token_count=16, first_layer=0, layer_count=4,
                                       layer_digests=None, max_cache_duration_ms=None)
    assert LayerDigests.of(partial) is None
    short = tuple((t, v[:-1]) if t == LAYER_DIGESTS and isinstance(v, bytes) else (t, v)
                  for t, v in props)
    assert LayerDigests.of(short) is None


async def test_objects_that_came_before_the_fetch_ok_are_checked_when_it_comes() -> None:
    """The fetch stream and the FETCH_OK travel on different QUIC streams: objects may come
    first. The upstream FETCH's state machine, fed the session's events (no socket): object 0
    (corrupted) complete and half of object 1 before FETCH_OK; at FETCH_OK both are checked
    (object 1 then goes on incrementally); at the FIN object 0 is not cached, object 1 and 2
    are, and the range is not recorded complete."""
    objs = [bytes([o]) * 3000 for o in range(3)]
    props = ((LAYER_DIGESTS, b"".join(hashlib.sha256(o).digest() for o in objs)),
             (FIRST_LAYER, 0), (LAYER_COUNT, 3))
    cache, stats, track = ObjectCache(1 << 20), RelayStats(), ((b"ns",), b"raw")
    up = UpstreamFetch(FetchRange(track, (0, 0), (0, 2)), None, cache, stats,  # type: ignore[arg-type]
                       30.0, lambda _up: None)

    def begin(o: int) -> None:
        up.on_data(0, ObjectBegin(0, 0, o, 128, ObjectStatus.NORMAL, len(objs[o])))

    def chunk(data: bytes) -> None:
        up.on_data(0, ObjectPayload(memoryview(data)))

    begin(0)
    chunk(b"\xff" + objs[0][1:])
    up.on_data(0, ObjectEnd(0, 0))
    begin(1)
    chunk(objs[1][:1000])
    assert stats.digest_checks == 0  # no digests known yet
    up.on_response(FetchOk(False, (0, 2), track_properties=props))
    assert (stats.digest_checks, stats.digest_mismatches) == (1, 1)
    chunk(objs[1][1000:])
    up.on_data(0, ObjectEnd(0, 1))
    begin(2)
    chunk(objs[2])
    up.on_data(0, ObjectEnd(0, 2))
    up.on_stream_closed(0, None)
    assert (stats.digest_checks, stats.digest_mismatches) == (3, 1)
    assert cache.get(track, 0, 0) is None
    assert [c.payload() for c in (cache.get(track, 0, 1), cache.get(track, 0, 2)) if c] == objs[1:]
    assert cache.lookup_range(track, (0, 1), (0, 2)) is None and cache.reserved == 0


# -- a holder behind the relay -------------------------------------------------------------------
class World:
    def __init__(self, holder: HolderNode, relay: Relay) -> None:
        self.holder, self.relay = holder, relay
        self.layers = make_layers(LAYERS)

    def put(self, key: RecordKey, *, flip_layer: int | None = None) -> None:
        """Store a replica; ``flip_layer``: one bit of that layer flips in the holder's tier
        after its record and digests were computed (its Track Properties stay right)."""
        self.holder.put(key, self.layers)
        if flip_layer is not None:
            tier = self.holder.store.layer_payload(key, flip_layer, touch=False).obj
            tier[len(tier) // 2] ^= 0x10

    async def load(self, key: RecordKey):
        record = self.holder.holder.replica_record(key, holder=self.relay.url)
        sink = sink_for_record(record, self.layers.geometry, self.layers.tokens,
                               backend="numpy")
        result = await within(load_block([record], sink, config=client_config()))
        # The upstream FETCH goes on to its FIN whatever the consumer did: then it is cached.
        await until(lambda: not self.relay.fetches.inflight, "the upstream FETCH over")
        return result

    def track(self, key: RecordKey):
        name = self.holder.holder.replica_record(key).block_name()
        return (name.namespace_fields(), b"raw")

    def counts(self) -> tuple[int, int, int, int]:
        s = self.relay.stats
        return s.upstream_fetches, s.cache_hits, s.digest_checks, s.digest_mismatches


@pytest.fixture
async def world() -> AsyncIterator[World]:
    holder = await HolderNode().start()
    relay = await Relay(RelayConfig(server_transport=server_config(),
                                    upstream_transport=client_config())).start()
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        await within(holder.holder.wait_announced())
        yield World(holder, relay)
    finally:
        await within(relay.close())
        await holder.close()


async def test_a_corrupted_layer_is_not_cached_and_the_next_fetch_goes_upstream(
        world: World) -> None:
    key = make_key(41)
    world.put(key, flip_layer=BAD)
    track = world.track(key)
    first = await world.load(key)
    # The consumer detects the bad layer (as before) ... (the layers before it verified;
    # on the native backend, which lands and checks every layer as it arrives, the ones
    # after it too)
    assert not first.complete and BAD not in first.verified
    assert set(range(BAD)) <= set(first.verified)
    assert first.attempts[0].error is not None and f"layer {BAD}" in first.attempts[0].error \
        and "digest mismatch" in first.attempts[0].error
    # ... and the relay checked every layer, kept the good ones, not the bad one, and did
    # not record the range complete.
    assert world.counts() == (1, 0, LAYERS, 1)
    cache = world.relay.cache
    assert cache.get(track, 0, BAD) is None
    assert all(cache.get(track, 0, layer) is not None for layer in range(LAYERS) if layer != BAD)
    assert cache.lookup_range(track, (0, 0), (0, LAYERS - 1)) is None
    assert cache.reserved == 0
    text = render_metrics(world.relay.stats.snapshot())
    assert "relay_digest_mismatches_total 1\n" in text
    assert f"relay_digest_checks_total {LAYERS}\n" in text
    # A second FETCH gets the layers held from the relay and the bad one from upstream
    # again (a gap of the range, relay/fetch/held.py), not from a poisoned cache.
    second = await world.load(key)
    assert not second.complete and BAD not in second.verified
    assert set(range(BAD)) <= set(second.verified)
    assert world.counts() == (2, 1, LAYERS + 1, 2)
    assert cache.get(track, 0, BAD) is None


async def test_a_clean_block_is_cached_and_served_warm(world: World) -> None:
    key = make_key(42)
    world.put(key)
    track = world.track(key)
    first = await world.load(key)
    assert first.complete and first.verified == tuple(range(LAYERS))
    assert world.counts() == (1, 0, LAYERS, 0)
    assert world.relay.cache.lookup_range(track, (0, 0), (0, LAYERS - 1)) is not None
    warm = await world.load(key)
    assert warm.complete and warm.verified == tuple(range(LAYERS))
    assert world.counts() == (1, 1, LAYERS, 0)  # no upstream FETCH: from the cache
