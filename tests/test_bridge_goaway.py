"""GOAWAY and the instance's connection pool (kvsp_moq/bridge/pool.py), over loopback QUIC:
a relay that drains (relay/ sends GOAWAY with its New Session URI) and a publisher that
sends GOAWAY while requests are crossing it. The pool stops handing out the session, opens
a new one (the New Session URI if given, else the same URL), retries once what was refused
with GOING_AWAY, and closes the old session once it has no request of ours in flight
(draft-ietf-moq-transport-22 §"GOAWAY", §"Session Migration")."""

from __future__ import annotations

import asyncio

import pytest

from bridge_support import (
    HolderNode,
    client_config,
    make_key,
    make_layers,
    record_at,
    server_config,
    within,
)
from kvsp_moq.bridge import LAYER_DIGEST, MoqtPool, load_block, sink_for_record
from kvsp_moq.pubsub import Catalog, MoqtSession, serve
from relay import Relay, RelayConfig

LAYERS = 4


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


async def test_relay_drain_moves_the_pool_to_the_new_session_uri(holder: HolderNode) -> None:
    key, layers = make_key(41), make_layers(LAYERS)
    holder.put(key, layers)
    second = await Relay(RelayConfig(server_transport=server_config(),
                                     upstream_transport=client_config())).start()
    first = await Relay(RelayConfig(server_transport=server_config(),
                                    upstream_transport=client_config(),
                                    goaway_uri=second.url, drain_timeout=2.0)).start()
    pool = MoqtPool(client_config())
    drain = None
    try:
        for r in (first, second):
            await within(holder.holder.attach_relay(r.url, client_config()))
        await within(holder.holder.wait_announced())
        record = record_at(holder.holder.replica_record(key), first.url)

        def sink():
            return sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")

        assert (await within(load_block(record, sink(), pool=pool))).complete
        old = await within(pool.get(first.url))
        drain = asyncio.ensure_future(first.shutdown())
        assert await within(old.goaway_received) == second.url  # the New Session URI
        # The next load goes through a new session to the second relay and succeeds.
        result = await within(load_block(record, sink(), pool=pool))
        assert result.complete and all(a.error is None for a in result.attempts)
        new = await within(pool.get(first.url))
        assert new is not old and pool.target(first.url) == second.url
        assert new.connection.url is not None and new.connection.url.port == second.port
        assert pool.goaways == 1
        # The old session had nothing of ours in flight: the pool closed it itself.
        await within(old.wait_closed())
    finally:
        await within(pool.close())
        if drain is not None:
            await within(drain)
        await within(first.close())
        await within(second.close())


class GoawayOnFirstRequest:
    """A RequestGate that sends GOAWAY (no New Session URI: reconnect to the same URL) as
    the first request of a session arrives, and serves that request: requests already on
    their way are refused by the session with REQUEST_ERROR GOING_AWAY."""

    def __init__(self) -> None:
        self.sessions: list[MoqtSession] = []

    def allows(self, session: MoqtSession, message: object) -> bool:
        if not self.sessions or self.sessions[-1] is not session:
            self.sessions.append(session)
            if len(self.sessions) == 1:
                assert session.moqt is not None
                session.moqt.goaway("", 5000)
        return True

    def shows(self, session: MoqtSession, message: object, namespace: object) -> bool:
        return True


async def test_requests_refused_after_goaway_are_retried_on_a_new_session(
        holder: HolderNode) -> None:
    """Two loads at once through one pool; the publisher sends GOAWAY as the first FETCH
    arrives, so the second is refused (GOING_AWAY): it is retried on a new session to the
    same URL and both loads complete."""
    key, layers = make_key(42), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    name = record.block_name()
    catalog = Catalog()
    track = catalog.create(name.namespace_fields(), "raw", keep=True)
    for layer in range(LAYERS):
        await track.write_object(0, layer, holder.payload(key, layer),
                                 properties=((LAYER_DIGEST, record.layer_digests[layer]),))
    gate = GoawayOnFirstRequest()
    server = await serve("127.0.0.1", 0, server_config(), catalog=catalog, gate=gate)
    url = f"moqt://127.0.0.1:{server.port}/moq"
    pool = MoqtPool(client_config())
    try:
        await within(pool.get(url))  # connected: both FETCHes leave in the same turn
        rec = record_at(record, url)
        sinks = [sink_for_record(rec, layers.geometry, layers.tokens, backend="numpy")
                 for _ in range(2)]
        results = await within(asyncio.gather(*(load_block(rec, s, pool=pool) for s in sinks)))
        assert all(r.complete for r in results), [r.attempts for r in results]
        refused = [a for r in results for a in r.attempts if a.error is not None]
        assert len(refused) == 1 and "0x6" in (refused[0].error or "")  # GOING_AWAY
        assert pool.goaways == 1 and len(gate.sessions) == 2
        for s in sinks:
            for layer in range(LAYERS):
                k, v = s.layer(layer)
                assert k.tobytes() + v.tobytes() == holder.payload(key, layer)
    finally:
        await within(pool.close())
        for s in list(server.sessions):
            await within(s.close())
        server.close()
        await within(server.wait_closed())


async def test_pool_call_retries_once(holder: HolderNode) -> None:
    """MoqtPool.call: a TRACK_STATUS refused because of GOAWAY is retried once."""
    catalog = Catalog()
    catalog.create(("g",), "t")
    gate = GoawayOnFirstRequest()
    server = await serve("127.0.0.1", 0, server_config(), catalog=catalog, gate=gate)
    url = f"moqt://127.0.0.1:{server.port}/moq"
    pool = MoqtPool(client_config())
    try:
        await within(pool.get(url))
        answers = await within(asyncio.gather(
            *(pool.call(url, lambda s: s.track_status(("g",), "t")) for _ in range(3))))
        assert len(answers) == 3 and pool.goaways == 1 and len(gate.sessions) == 2
    finally:
        await within(pool.close())
        for s in list(server.sessions):
            await within(s.close())
        server.close()
        await within(server.wait_closed())


async def test_holder_follows_a_draining_relay_to_the_new_session_uri(holder: HolderNode) -> None:
    """MoqtHolder.attach_relay and the relay's GOAWAY: the holder connects to the New Session
    URI, PUBLISH_NAMESPACEs its replicas there and closes the old session itself once idle (the
    draining relay sees every session leave before its drain timeout). A block published before
    the GOAWAY and one published after it are fetched through the new relay."""
    before, after = make_key(43), make_key(44)
    layers = make_layers(LAYERS)
    holder.put(before, layers)
    second = await Relay(RelayConfig(server_transport=server_config(),
                                     upstream_transport=client_config())).start()
    first = await Relay(RelayConfig(server_transport=server_config(),
                                    upstream_transport=client_config(),
                                    goaway_uri=second.url, drain_timeout=20.0)).start()
    pool = MoqtPool(client_config())
    drain = None
    try:
        old = await within(holder.holder.attach_relay(first.url, client_config()))
        await within(holder.holder.wait_announced())
        assert holder.holder.replica_record(before).holder == first.url
        drain = asyncio.ensure_future(first.shutdown())
        assert await within(old.goaway_received) == second.url
        await within(holder.holder.wait_announced())  # the new session, its PUBLISH_NAMESPACEs
        [new] = holder.holder.relay_sessions()
        assert new is not old and holder.holder.goaways == 1
        assert new.connection.url is not None and new.connection.url.port == second.port
        # The old session had no request of ours in flight: the holder closed it itself, so
        # the relay's drain ended with every session gone by itself (no GOAWAY_TIMEOUT).
        assert await within(drain) is True
        assert old.closed.done()
        holder.put(after, layers)
        await within(holder.holder.wait_announced())
        for key in (before, after):
            record = holder.holder.replica_record(key)
            assert record.holder == second.url  # new records name the New Session URI
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            result = await within(load_block(record, sink, pool=pool))
            assert result.complete and all(a.error is None for a in result.attempts)
            for layer in range(LAYERS):
                k, v = sink.layer(layer)
                assert k.tobytes() + v.tobytes() == holder.payload(key, layer)
        assert second.stats.snapshot()["upstream_fetches"] == 2
    finally:
        await within(pool.close())
        if drain is not None:
            await within(drain)
        await within(first.close())
        await within(second.close())
