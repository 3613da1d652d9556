"""KVSP over MOQT, binding v1 (docs/binding.md), end to end over loopback QUIC: a real
MoqtHolder (BlockStore), a real relay (relay.core.Relay), instances loading into torch CPU
tensors and numpy arrays. No mocks; no sleeps: every wait is on an event the protocol, the
sink or the store completes (``within`` only turns a hang into a failure)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from bridge_support import (
    HolderNode,
    TamperingPublisher,
    client_config,
    closed_port_url,
    make_key,
    make_layers,
    record_at,
    start_relay,
    within,
)
from kvsp_moq.bridge import (
    LAYER_DIGEST,
    MoqtPool,
    Source,
    TrackInfo,
    block_info,
    load_block,
    load_by_namespace,
    sink_for_record,
)
from kvsp_moq.bridge.load import BlockLoad
from kvsp_moq.kvsp.naming import BlockName, scope_prefix
from kvsp_moq.pubsub import MoqtError, connect
from kvsp_moq.sinks import LayerFailed, LayerState
from receive_path_support import lands_natively

torch = pytest.importorskip("torch")

LAYERS = 8


def tensor_octets(sink, layer: int) -> bytes:
    """K || V octets of a verified layer, read through the torch tensors (uint8 views)."""
    k, v = sink.layer(layer)
    return (k.contiguous().view(torch.uint8).numpy().tobytes()
            + v.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


@pytest.fixture
async def relay():
    r = await start_relay()
    try:
        yield r
    finally:
        await within(r.close())


async def test_holder_relay_two_instances_bit_identical(holder: HolderNode, relay) -> None:
    key, layers = make_key(1), make_layers(LAYERS)
    holder.put(key, layers)
    await within(holder.holder.attach_relay(relay.url, client_config()))
    await within(holder.holder.wait_announced())
    record = holder.holder.replica_record(key)
    assert record.holder == relay.url and record.moqt_namespace is not None
    assert BlockName.from_moqt_namespace(record.moqt_namespace).block_key == key.block_key

    async def instance():
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        result = await within(load_block(record, sink, config=client_config()))
        return sink, result

    (s1, r1), (s2, r2) = await within(asyncio.gather(instance(), instance()))
    for sink, result in ((s1, r1), (s2, r2)):
        assert result.complete and result.verified == tuple(range(LAYERS))
        for layer in range(LAYERS):
            assert tensor_octets(sink, layer) == holder.payload(key, layer)  # bit for bit
    # A third instance is served from the relay's cache (the range was fetched completely).
    before = relay.stats.snapshot()["cache_hits"]
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
    assert (await within(load_block(record, sink, config=client_config()))).complete
    assert relay.stats.snapshot()["cache_hits"] > before

    # SUBSCRIBE_NAMESPACE on ("kvsp-1", compat_id, scope_id) lists the scope's blocks.
    lister = await within(connect(relay.url, client_config()))
    try:
        await within(lister.subscribe_namespace(scope_prefix(key.compat_id, key.scope_id)))
        kind, suffix = await within(lister.namespace_updates.get())
        assert kind == "namespace"
        assert suffix == (key.block_key, BlockName.from_moqt_namespace(
            record.moqt_namespace).replica_id)
    finally:
        await within(lister.close())


async def test_layer_range_and_properties(holder: HolderNode) -> None:
    key, layers = make_key(2), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key, ttl_ms=5000)
    sink = sink_for_record(record, layers.geometry, layers.tokens, (2, 5), backend="torch")
    result = await within(load_block(record, sink, config=client_config()))
    assert result.verified == (2, 3, 4, 5) and result.recompute == ()
    assert [a.layers for a in result.attempts] == [(2, 5)]
    for layer in range(2, 6):
        assert tensor_octets(sink, layer) == holder.payload(key, layer)

    # The wire: object ID = layer, LAYER_DIGEST object property = SHA-256(payload);
    # FETCH_OK Track Properties: token count, all layer digests, MAX_CACHE_DURATION <= TTL.
    name = record.block_name()
    session = await within(connect(holder.url, client_config()))
    try:
        fetch = await within(session.fetch(name.namespace_fields(), "raw", start=(0, 6),
                                           end=(0, 7)))
        objs = await within(fetch.collect())
        assert [o.object_id for o in objs] == [6, 7]
        for o in objs:
            digest = dict(o.properties)[LAYER_DIGEST]
            assert digest == hashlib.sha256(o.payload).digest() == record.layer_digests[o.object_id]
        info = TrackInfo.parse(fetch.response.track_properties)
        assert info.token_count == layers.tokens and info.layers == range(LAYERS)
        assert info.layer_digests == dict(enumerate(record.layer_digests))
        assert info.max_cache_duration_ms is not None and 0 < info.max_cache_duration_ms <= 5000
        status = await within(block_info(session, name))  # TRACK_STATUS: same properties
        assert (status.token_count, status.layer_digests) == (info.token_count, info.layer_digests)
    finally:
        await within(session.close())

    # Found by namespace alone: verified against the Track Properties.
    sink2, res2 = await within(load_by_namespace(holder.url, name, layers.geometry,
                                                 config=client_config(), backend="numpy"))
    assert res2.complete and sink2.tokens == layers.tokens


async def test_tampering_source_detected_and_good_source_used(holder: HolderNode) -> None:
    key, layers = make_key(3), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    payloads = {layer: holder.payload(key, layer) for layer in range(LAYERS)}
    liar = await TamperingPublisher().start(record.block_name(), payloads,
                                            list(record.layer_digests), bad_layer=3)
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        result = await within(load_block([record_at(record, liar.url), record], sink,
                                         config=client_config()))
    finally:
        await liar.close()
    assert result.complete
    bad, good = result.attempts
    assert bad.url == liar.url and "layer 3" in bad.error and "digest mismatch" in bad.error
    # The layers before layer 3 are verified, layer 3 is not; the Python receive path stops
    # there, the native data plane verifies the layers after it as they land.
    after = tuple(range(4, LAYERS)) if lands_natively(sink) else ()
    assert bad.verified == (0, 1, 2, *after)
    # The holder is asked for exactly what was missing, and delivers it.
    missing = tuple(layer for layer in range(LAYERS) if layer not in bad.verified)
    assert good.url == holder.url and good.layers == (3, 3 if after else LAYERS - 1)
    assert good.verified == missing and good.error is None
    for layer in range(LAYERS):
        assert tensor_octets(sink, layer) == payloads[layer]


async def test_dead_source_falls_back(holder: HolderNode) -> None:
    key, layers = make_key(4), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
    result = await within(load_block([record_at(record, closed_port_url()), record], sink,
                                     config=client_config(), connect_timeout=0.5))
    assert result.complete
    assert "connect" in result.attempts[0].error and result.attempts[1].url == holder.url


async def test_all_sources_bad_reports_layers_to_recompute(holder: HolderNode) -> None:
    key, layers = make_key(5), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    payloads = {layer: holder.payload(key, layer) for layer in range(LAYERS)}
    liar = await TamperingPublisher().start(record.block_name(), payloads,
                                            list(record.layer_digests), bad_layer=5)
    # The holder evicts the replica: its track is withdrawn (DOES_NOT_EXIST from now on).
    holder.store.remove(key)
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        load = BlockLoad(sink, [Source.from_record(r) for r in (
            record_at(record, closed_port_url()), record, record_at(record, liar.url))],
            pool=MoqtPool(client_config(), connect_timeout=0.5))
        waiters = {layer: asyncio.ensure_future(load.wait_for_layer(layer)) for layer in (5, 6)}
        result = await within(load.run())
        await load.pool.close()
    finally:
        await liar.close()
    dead, missing, lying = result.attempts
    assert "connect" in dead.error
    assert "0x10" in missing.error  # REQUEST_ERROR DOES_NOT_EXIST
    assert "layer 5" in lying.error and "digest mismatch" in lying.error
    # Layer 5 fails at the last source; the Python receive path stops there (6 and 7 are
    # never delivered), the native data plane verifies them as they land.
    after = (6, 7) if lands_natively(sink) else ()
    assert lying.verified == (0, 1, 2, 3, 4, *after) == result.verified
    assert result.recompute == ((5,) if after else (5, 6, 7)) == sink.missing_layers()
    for layer, waiter in waiters.items():
        if layer in result.recompute:
            with pytest.raises(LayerFailed):  # the waiter learns it only once no source is left
                await within(waiter)
        else:
            await within(waiter)
            assert tensor_octets(sink, layer) == payloads[layer]
    assert all(sink.state(layer) is LayerState.FAILED for layer in result.recompute)


async def test_layers_become_ready_in_ascending_order_one_by_one(holder: HolderNode) -> None:
    key, layers = make_key(6), make_layers(32, tokens=64)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
    order: list[int] = []
    loop = asyncio.get_running_loop()
    for layer in range(32):
        fut = asyncio.ensure_future(sink.wait_for_layer(layer))
        fut.add_done_callback(lambda _f, layer=layer: order.append(layer))
    seen_partial: asyncio.Future[tuple[int, bool]] = loop.create_future()
    load = asyncio.ensure_future(load_block(record, sink, config=client_config()))

    async def consumer() -> None:
        # Compute on layer 0 as soon as it is verified: the rest of the block is not.
        await sink.wait_for_layer(0)
        seen_partial.set_result((len(sink.ready_layers), load.done()))

    result, _ = await within(asyncio.gather(load, consumer()))
    assert result.complete
    await within(asyncio.sleep(0))  # let the done callbacks of the last waiters run
    assert order == list(range(32))
    ready, loaded = seen_partial.result()
    assert not loaded  # layer 0 was usable before the load returned
    if not lands_natively(sink):
        # Python hears each object in a loop iteration of its own: layer 0 was usable before
        # the block was complete. The native data plane hands over every object that landed
        # since the loop last drained its events at once (docs/transport.md, native gaps): on
        # a loaded machine all 32 may land first.
        assert ready < 32


async def test_eviction_withdraws_the_track(holder: HolderNode) -> None:
    key, layers = make_key(7), make_layers(2)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    holder.store.remove(key)
    session = await within(connect(holder.url, client_config()))
    try:
        with pytest.raises(MoqtError) as err:
            await within(session.fetch(record.block_name().namespace_fields(), "raw"))
        assert err.value.code == 0x10
    finally:
        await within(session.close())
