"""A relay restarted while an instance holds sessions to it (issue 19): the instance's
publisher (a MoqtHolder attached to the relay) and its session pool (MoqtPool) both find the
dead relay by their liveness PINGs, reconnect with backoff, the holder re-announces every
replica it still holds, and the next loads through the relay succeed.

The relay is a real ``python -m relay`` process, SIGKILLed and restarted on the same port;
the holder, pool and loads are the bridge objects an instance runs, over real QUIC on
127.0.0.1. A subscription to a block still being computed fails cleanly at the kill (the
session's close, not a hang until the QUIC idle timeout of 60 s) and a new one after the
restart reads the whole block. Waits are on events, or bounded polls that fail loudly.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bridge_support import HolderNode, client_config, make_key, make_layers, record_at
from kvsp_moq.bridge import MoqtPool, load_block, sink_for_record, subscribe_block
from kvsp_moq.control.common.engine_config import engine_config_from_mapping
from kvsp_moq.control.common.errors import ConfigError
from kvsp_moq.kvsp.naming import NAMESPACE_TAG
from kvsp_moq.pubsub import MoqtError, MoqtSession, connect
from kvsp_moq.pubsub.liveness import Reconnect
from kvsp_moq.sinks import make_sink
from kvsp_moq.transport import ConnectError
from relay_restart_support import RelayProcess, within

LAYERS = 4
#: PING every 0.3 s, dead after 1 s without its acknowledgement (room for a loaded 2-core
#: machine's event loops); reconnects after 0.05 s .. 0.3 s.
RECONNECT = Reconnect(keepalive=0.3, liveness_timeout=1.0, backoff_initial=0.05, backoff_max=0.3)
BOUND = 10.0


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[RelayProcess]:
    proc = await RelayProcess(tmp_path / "relay.log").start()
    try:
        yield proc
    finally:
        await proc.stop()


@pytest.fixture
async def holder() -> AsyncIterator[HolderNode]:
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


async def wait_listed(relay: RelayProcess, namespace: tuple[bytes, ...]) -> MoqtSession:
    """A watcher at ``relay`` that has seen ``namespace`` announced (the holder's
    PUBLISH_NAMESPACE reached this relay process)."""
    watcher = await within(connect(relay.url, client_config()))
    await within(watcher.subscribe_namespace((NAMESPACE_TAG,)))
    while True:
        kind, suffix = await within(watcher.namespace_updates.get(), BOUND)
        if kind == "namespace" and (NAMESPACE_TAG, *suffix) == namespace:
            return watcher


async def test_instance_sessions_survive_a_relay_restart(
        relay: RelayProcess, holder: HolderNode) -> None:
    key, layers = make_key(71), make_layers(LAYERS)
    holder.put(key, layers)
    await within(holder.holder.attach_relay(relay.url, client_config(), reconnect=RECONNECT))
    await within(holder.holder.wait_announced())
    record = record_at(holder.holder.replica_record(key), relay.url)
    pool = MoqtPool(client_config(), connect_timeout=2.0, reconnect=RECONNECT)

    def sink():
        return sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")

    try:
        assert (await within(load_block(record, sink(), pool=pool))).complete
        # A block still being computed, read with SUBSCRIBE through the relay.
        key2 = make_key(72)
        writer = holder.holder.begin(key2, layers.geometry, LAYERS, layers.tokens)
        await within(holder.holder.wait_announced())
        name2 = key2.block_name(writer.replica_id)
        writer.write_layer(0, *layers.arrays[0])
        streaming = make_sink(layers.geometry, layers.tokens, (0, LAYERS - 1), [None] * LAYERS,
                              backend="numpy")
        reading = asyncio.ensure_future(subscribe_block(relay.url, name2, streaming, pool=pool))
        await within(streaming.wait_for_layer(0))
        old_pool_session = await within(pool.get(relay.url))
        old_link = holder.holder.relay_session(relay.url)
        assert old_link is not None

        relay.kill()
        assert await relay.wait() == -signal.SIGKILL
        # Both ends find the dead relay by their PINGs (the QUIC idle timeout is 60 s):
        # the subscription in flight ends with the session's close, its layers missing.
        await within(old_pool_session.closed, BOUND)
        await within(old_link.closed, BOUND)
        partial = await within(reading, BOUND)
        assert not partial.complete and partial.recompute
        assert any("SessionClosedError" in (a.error or "") for a in partial.attempts), partial.attempts
        assert pool.dead == 1 and holder.holder.dead == 1
        # While the relay is down a load fails; the next one within the backoff does not
        # wait connect_timeout again.
        down = await within(load_block(record, sink(), pool=pool), BOUND)
        assert not down.complete
        fast = await within(load_block(record, sink(), pool=pool), BOUND)
        assert any("not tried again" in (a.error or "") for a in fast.attempts), fast.attempts

        await relay.start()  # the same port: every URL stays valid
        # The holder reconnects with backoff and announces its replicas there again...
        watcher = await wait_listed(relay, key.block_name(
            holder.store.info(key).replica_id).namespace_fields())
        assert holder.holder.reconnects == 1
        # ... and the next load through the relay succeeds (bounded poll: the pool's backoff
        # after the failed connects may still run for up to backoff_max).
        for _ in range(int(BOUND / RECONNECT.backoff_max)):
            result = await within(load_block(record, sink(), pool=pool), BOUND)
            if result.complete:
                break
            await asyncio.sleep(RECONNECT.backoff_max)
        else:
            raise AssertionError(f"no load succeeded after the restart: {result.attempts}")
        # The block being computed is read again from the start once its writer goes on.
        again = make_sink(layers.geometry, layers.tokens, (0, LAYERS - 1), [None] * LAYERS,
                         backend="numpy")
        resumed = asyncio.ensure_future(subscribe_block(relay.url, name2, again, pool=pool))
        await within(again.wait_for_layer(0))
        for layer in range(1, LAYERS):
            writer.write_layer(layer, *layers.arrays[layer])
        writer.finish()
        done = await within(resumed, BOUND)
        assert done.complete, done.attempts
        for layer in range(LAYERS):
            assert again.expected_digest(layer) == holder.store.info(key2).layer_digests[layer]
        await within(watcher.close())
    finally:
        await within(pool.close())


def test_engine_config_keys_of_the_reconnect(tmp_path: Path) -> None:
    cfg = engine_config_from_mapping({"moqt_keepalive_s": 1, "moqt_liveness_timeout_s": 2.5,
                                      "moqt_reconnect_initial_s": 0.2,
                                      "moqt_reconnect_max_s": 4}, tmp_path)
    assert cfg.moqt_reconnect == Reconnect(keepalive=1, liveness_timeout=2.5,
                                           backoff_initial=0.2, backoff_max=4)
    assert engine_config_from_mapping({}, tmp_path).moqt_reconnect == Reconnect()
    for bad in ({"moqt_keepalive_s": -1}, {"moqt_liveness_timeout_s": 0},
                {"moqt_reconnect_initial_s": True}, {"moqt_reconnect_max_s": "5"},
                {"moqt_reconnect_initial_s": 9, "moqt_reconnect_max_s": 1}):
        with pytest.raises(ConfigError, match="instance.engine.moqt_"):
            engine_config_from_mapping(bad, tmp_path)


async def test_pool_ignores_an_unusable_new_session_uri(holder: HolderNode) -> None:
    from bridge_support import server_config
    from relay import Relay, RelayConfig

    relay = await Relay(RelayConfig(server_transport=server_config(),
                                    goaway_uri="not a uri", drain_timeout=5.0)).start()
    pool = MoqtPool(client_config(), reconnect=RECONNECT)
    drain = None
    try:
        old = await within(pool.get(relay.url))
        drain = asyncio.ensure_future(relay.shutdown())
        assert await within(old.goaway_received) == "not a uri"
        assert pool.target(relay.url) == relay.url  # the same URL is reused
        try:  # a connect to the same URL (no ValueError), which the draining relay may refuse
            new = await within(pool.get(relay.url))
        except (MoqtError, ConnectError, OSError, TimeoutError):  # e.g. closed in the handshake: draining
            pass
        else:
            assert new is not old and new.connection.url is not None
            assert new.connection.url.port == relay.port
    finally:
        await within(pool.close())
        if drain is not None:
            await within(drain)
        await within(relay.close())
