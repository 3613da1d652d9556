"""Prefill streaming over binding v1 (docs/binding.md §6): a block still being computed is
read with SUBSCRIBE; each layer is published the moment the store has it. Proven with events:
the producer writes layer l + 1 only after the consumer has verified layer l (it would hang,
caught by ``within``, if layers were held back). Real QUIC, real relay, no sleeps."""

from __future__ import annotations

import asyncio

import pytest

from bridge_support import HolderNode, client_config, make_key, make_layers, start_relay, within
from kvsp_moq.bridge import subscribe_block
from kvsp_moq.sinks import LayerState, make_sink

torch = pytest.importorskip("torch")

LAYERS = 6


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


def streaming_sink(layers):
    # Digests are unknown while the block is computed: announced per object (LAYER_DIGEST).
    return make_sink(layers.geometry, layers.tokens, (0, LAYERS - 1), [None] * LAYERS,
                     backend="torch")


async def test_consumer_verifies_layer_l_before_producer_writes_l_plus_1(holder: HolderNode) -> None:
    key, layers = make_key(11), make_layers(LAYERS)
    writer = holder.holder.begin(key, layers.geometry, LAYERS, layers.tokens)
    track = holder.holder.track(key)
    name = key.block_name(writer.replica_id)
    sink = streaming_sink(layers)
    consumer = asyncio.ensure_future(subscribe_block(holder.url, name, sink,
                                                     config=client_config()))
    await within(track.subscribed.wait())
    for layer, (k, v) in enumerate(layers.arrays):
        assert sink.state(layer) is LayerState.EXPECTED  # layer l does not exist yet
        writer.write_layer(layer, k, v)
        await within(sink.wait_for_layer(layer))  # verified before l + 1 is computed
    writer.finish()
    result = await within(consumer)
    assert result.complete and result.verified == tuple(range(LAYERS))
    for layer in range(LAYERS):
        k, v = sink.layer(layer)
        octets = k.contiguous().view(torch.uint8).numpy().tobytes() + \
            v.contiguous().view(torch.uint8).numpy().tobytes()
        assert octets == holder.payload(key, layer)
        assert sink.expected_digest(layer) == holder.store.info(key).layer_digests[layer]


async def test_late_subscriber_through_relay_fetches_past_layers(holder: HolderNode) -> None:
    relay = await start_relay()
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        key, layers = make_key(12), make_layers(LAYERS)
        writer = holder.holder.begin(key, layers.geometry, LAYERS, layers.tokens)
        await within(holder.holder.wait_announced())
        name = key.block_name(writer.replica_id)
        for layer in range(3):  # computed before anybody subscribed
            writer.write_layer(layer, *layers.arrays[layer])
        sink = streaming_sink(layers)
        consumer = asyncio.ensure_future(subscribe_block(relay.url, name, sink,
                                                         config=client_config()))
        track = holder.holder.track(key)
        await within(track.subscribed.wait())  # the relay's upstream subscription
        await within(sink.wait_for_layer(2))   # past layers arrive by FETCH
        for layer in range(3, LAYERS):
            writer.write_layer(layer, *layers.arrays[layer])
            await within(sink.wait_for_layer(layer))
        writer.finish()
        result = await within(consumer)
        assert result.complete
        for layer in range(LAYERS):
            assert sink.expected_digest(layer) == holder.store.info(key).layer_digests[layer]
    finally:
        await within(holder.holder.close())
        await within(relay.close())


async def test_a_late_decoder_is_served_by_the_relay_from_what_it_holds(holder: HolderNode) -> None:
    """Prefill→decode with a late decoder (docs/vllm.md): the first consumer FETCHes the
    layers computed before it subscribed and gets the rest live; a second one subscribing
    once every layer passed through the relay FETCHes them all from the relay (what the
    first FETCH and the subscription brought): every layer entered the relay once, and the
    producer saw one FETCH."""
    relay = await start_relay()
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        key, layers = make_key(14), make_layers(LAYERS)
        writer = holder.holder.begin(key, layers.geometry, LAYERS, layers.tokens)
        await within(holder.holder.wait_announced())
        name = key.block_name(writer.replica_id)
        for layer in range(2):
            writer.write_layer(layer, *layers.arrays[layer])
        sinks = [streaming_sink(layers), streaming_sink(layers)]
        first = asyncio.ensure_future(subscribe_block(relay.url, name, sinks[0],
                                                      config=client_config()))
        await within(sinks[0].wait_for_layer(1))  # by FETCH through the relay
        for layer in range(2, LAYERS):
            writer.write_layer(layer, *layers.arrays[layer])
            await within(sinks[0].wait_for_layer(layer))  # live, through the relay
        late = asyncio.ensure_future(subscribe_block(relay.url, name, sinks[1],
                                                     config=client_config()))
        await within(sinks[1].wait_for_layer(LAYERS - 1))
        writer.finish()
        for consumer, sink in zip((first, late), sinks):
            result = await within(consumer)
            assert result.complete
            for layer in range(LAYERS):
                assert sink.expected_digest(layer) == holder.store.info(key).layer_digests[layer]
        s = relay.stats
        assert (s.objects_in, s.upstream_fetches, s.objects_out) == (LAYERS, 1, 2 * LAYERS)
    finally:
        await within(holder.holder.close())
        await within(relay.close())


async def test_subscribe_to_a_complete_block_fetches_it(holder: HolderNode) -> None:
    key, layers = make_key(13), make_layers(LAYERS)
    holder.put(key, layers)
    info = holder.store.info(key)
    sink = make_sink(layers.geometry, layers.tokens, (0, LAYERS - 1), info.layer_digests,
                     backend="numpy")
    result = await within(subscribe_block(holder.url, key.block_name(info.replica_id), sink,
                                          config=client_config()))
    assert result.complete


def test_sink_digest_announced_later_rules() -> None:
    from kvsp_moq.sinks import SinkError

    layers = make_layers(2)
    sink = make_sink(layers.geometry, layers.tokens, (0, 1), [None, None], backend="numpy")
    with pytest.raises(SinkError):  # nothing to verify against yet
        sink.begin_layer(0, sink.payload_bytes)
    sink.set_expected_digest(0, b"\x01" * 32)
    sink.set_expected_digest(0, b"\x01" * 32)  # the same again: no-op
    with pytest.raises(SinkError):  # a digest never changes once announced
        sink.set_expected_digest(0, b"\x02" * 32)
    assert sink.begin_layer(0, sink.payload_bytes).nbytes == sink.payload_bytes


async def test_eviction_withdraws_the_namespace_at_the_relay(holder: HolderNode) -> None:
    from kvsp_moq.kvsp.naming import scope_prefix
    from kvsp_moq.pubsub import connect

    relay = await start_relay()
    watcher = None
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        key, layers = make_key(14), make_layers(2)
        holder.put(key, layers)
        await within(holder.holder.wait_announced())
        rid = holder.store.info(key).replica_id
        watcher = await within(connect(relay.url, client_config()))
        await within(watcher.subscribe_namespace(scope_prefix(key.compat_id, key.scope_id)))
        assert await within(watcher.namespace_updates.get()) == ("namespace", (key.block_key, rid))
        holder.store.remove(key)  # §6.1: withdrawn before or when evicted
        assert await within(watcher.namespace_updates.get()) == ("namespace_done",
                                                                 (key.block_key, rid))
    finally:
        if watcher is not None:
            await within(watcher.close())
        await within(holder.holder.close())
        await within(relay.close())


async def test_a_subscribe_before_the_producer_began_is_held_by_the_relay_until_it_publishes(
        holder: HolderNode) -> None:
    # prefill→decode (binding §6.1): the consumer names the track before the producer exists;
    # RENDEZVOUS_TIMEOUT makes the relay hold its SUBSCRIBE until the PUBLISH_NAMESPACE.
    relay = await start_relay()
    try:
        await within(holder.holder.attach_relay(relay.url, client_config()))
        key, layers = make_key(14), make_layers(LAYERS)
        replica_id = bytes(range(40, 56))
        name = key.block_name(replica_id)
        sink = streaming_sink(layers)
        held = asyncio.get_running_loop().create_future()
        relay.observers.append(
            lambda kind, obj: kind == "rendezvous_hold" and not held.done() and held.set_result(obj))
        consumer = asyncio.ensure_future(subscribe_block(relay.url, name, sink, config=client_config(),
                                                         rendezvous_ms=20_000))
        await within(held)  # held: nobody publishes the namespace yet
        writer = holder.holder.begin(key, layers.geometry, LAYERS, layers.tokens, replica_id=replica_id)
        for layer in range(LAYERS):
            writer.write_layer(layer, *layers.arrays[layer])
            await within(sink.wait_for_layer(layer))
        writer.finish()
        result = await within(consumer)
        assert result.complete
        for layer in range(LAYERS):
            assert sink.expected_digest(layer) == holder.store.info(key).layer_digests[layer]
    finally:
        await within(holder.holder.close())
        await within(relay.close())


async def test_without_a_rendezvous_a_subscribe_before_the_producer_began_misses() -> None:
    relay = await start_relay()
    try:
        key, layers = make_key(15), make_layers(LAYERS)
        sink = streaming_sink(layers)
        result = await within(subscribe_block(relay.url, key.block_name(bytes(16)), sink, config=client_config()))
        assert not result.complete and result.recompute == tuple(range(LAYERS))
        assert result.attempts and result.attempts[0].error is not None
    finally:
        await within(relay.close())
