"""Soliciting namespaces from publishers (relay/subscribe/solicit.py; docs/relay.md "Soliciting"), over
real QUIC on 127.0.0.1: the relay sends SUBSCRIBE_NAMESPACE to every downstream session allowed
to publish (``solicit_namespaces``, default on) and routes the NAMESPACE answers like
PUBLISH_NAMESPACE. The publisher is a pubsub client with a
Catalog: pubsub answers a SUBSCRIBE_NAMESPACE with NAMESPACE for every catalog namespace under
the prefix. No sleeps: every wait is on a protocol event or a relay observer.
"""

from __future__ import annotations

import asyncio
import tomllib

import pytest
from test_relay import (  # noqa: F401  (net is a fixture)
    Net,
    as_map,
    client_config,
    count_fetches,
    net,
    payload,
    publish_stored,
    within,
)

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import Token
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from relay import Relay, RelayConfig
from relay.__main__ import build_config, parse_args
from relay.ops.auth import parse_auth_config
from relay.ops.names import format_namespace

NS = ("solicit-test", "live")
NSB = tuple(f.encode() for f in NS)
OTHER = ("elsewhere", "x")
OTHERB = tuple(f.encode() for f in OTHER)


def observed(relay: Relay, kind: str, ns: tuple[bytes, ...]) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    relay.observers.append(
        lambda k, obj: k == kind and obj == ns and not fut.done() and fut.set_result(obj))
    return fut


async def solicited_publisher(net: Net, relay: Relay, *names: tuple[str, ...],
                              setup_tokens=(), wait: tuple[bytes, ...] | None = NSB
                              ) -> tuple[MoqtSession, Catalog, dict]:
    """A pubsub publisher with tracks ``names`` (namespace, track) that announces nothing;
    returns once the relay routed ``wait``."""
    catalog = Catalog()
    tracks = {(ns, name): catalog.create(ns, name) for ns, name in names or ((NS, "cam"),)}
    routed = observed(relay, "solicited_namespace", wait) if wait is not None else None
    s = await within(connect(relay.url, client_config(), catalog=catalog,
                             setup_tokens=setup_tokens))
    net.sessions.append(s)
    if routed is not None:
        await within(routed)
    return s, catalog, tracks


async def setup_seen(relay: Relay, s: MoqtSession) -> None:
    """A round trip that the relay answers only after handling ``s``'s SETUP (a request is
    never processed before SETUP)."""
    with pytest.raises(MoqtError):
        await within(s.subscribe(("no", "such"), "t"))


def peer_of(relay: Relay, count: int):  # noqa: ANN201
    downstream = [p for p in relay.sessions if not p.upstream]
    assert len(downstream) == count
    return downstream


# ==========================================================================================
async def test_solicited_publisher_is_routed_listed_and_withdrawn(net: Net) -> None:
    relay = await net.relay()
    watcher = await net.client(relay)
    await within(watcher.subscribe_namespace(NS[:1]))
    pub, catalog, tracks = await solicited_publisher(net, relay, (NS, "cam"), (NS, "stored"))
    assert relay.routing.lookup(NSB + (b"deeper",)) is not None
    # Listed to the watcher like a PUBLISH_NAMESPACE.
    assert await within(watcher.namespace_updates.get()) == ("namespace", NSB[1:])
    # SUBSCRIBE from two clients: ONE subscription at the publisher, exact bytes.
    a, b = await net.client(relay), await net.client(relay)
    sa = await within(a.subscribe(NS, "cam"))
    sb = await within(b.subscribe(NS, "cam"))
    cam = tracks[NS, "cam"]
    await within(cam.subscribed.wait())
    assert cam.subscriber_count == 1 and relay.stats.upstream_subscribes == 1
    sent = {}
    for g in range(2):
        for o in range(3):
            sent[(g, o)] = payload(g, o)
            await within(cam.write_object(g, o, sent[(g, o)]))
    await within(cam.finish())
    for sub in (sa, sb):
        got = {(x.group_id, x.object_id): bytes(x.payload) for x in await within(sub.collect())}
        assert got == sent
        assert sub.publish_done is not None
        assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
    # FETCH is routed to it too (and the second one is served from the relay's cache).
    stored = await publish_stored(tracks[NS, "stored"])
    calls = count_fetches(tracks[NS, "stored"])
    f1 = await within(a.fetch(NS, "stored", start=(0, 0), end=(1, 4)))
    got = as_map(await within(f1.collect()))
    assert got == {k: (d, [tuple(p) for p in props], 10 + k[1])
                   for k, (d, props) in stored.items()}
    f2 = await within(b.fetch(NS, "stored", start=(0, 1), end=(1, 2)))
    assert len(await within(f2.collect())) == 7
    assert calls[0] == 1
    # The publisher leaves: NAMESPACE_DONE to the watcher, the route is gone.
    await within(pub.close())
    assert await within(watcher.namespace_updates.get()) == ("namespace_done", NSB[1:])
    assert relay.routing.namespaces() == []
    with pytest.raises(MoqtError) as info:
        await within(a.subscribe(NS, "cam"))
    assert info.value.code == RequestErrorCode.DOES_NOT_EXIST


async def test_namespace_done_and_cancel_withdraw_one_route(net: Net) -> None:
    relay = await net.relay()
    watcher = await net.client(relay)
    await within(watcher.subscribe_namespace(()))
    catalog = Catalog()
    catalog.create(NS, "cam")
    catalog.create(OTHER, "cam")
    routed = [observed(relay, "solicited_namespace", n) for n in (NSB, OTHERB)]
    pub = await within(connect(relay.url, client_config(), catalog=catalog))
    net.sessions.append(pub)
    await within(asyncio.gather(*routed))
    seen = {await within(watcher.namespace_updates.get()) for _ in range(2)}
    assert seen == {("namespace", NSB), ("namespace", OTHERB)}
    # The same session also announces OTHER with PUBLISH_NAMESPACE: two routes, one session.
    await within(pub.publish_namespace(OTHER))
    (peer,) = [p for p in peer_of(relay, 2) if p.solicitation and p.solicitation.names]
    sol = peer.solicitation
    assert sol is not None and sol.names == {NSB, OTHERB}
    # NAMESPACE_DONE from the publisher withdraws exactly that namespace.
    assert pub.moqt is not None
    pub.moqt.namespace_done(sol.rid, NSB)
    pub.pump()
    assert await within(watcher.namespace_updates.get()) == ("namespace_done", NSB)
    assert relay.routing.namespaces() == [OTHERB]
    # Cancelling the solicitation withdraws its routes; the PUBLISH_NAMESPACE one stays.
    pub.moqt.cancel(sol.rid)
    pub.pump()
    gone = observed(relay, "solicited_namespace_done", OTHERB)
    await within(gone)
    assert relay.routing.namespaces() == [OTHERB]  # still announced by PUBLISH_NAMESPACE
    assert relay.routing.publishers_of(OTHERB) == [peer]
    assert sol.ended and sol.names == set()


async def test_soliciting_can_be_turned_off(net: Net) -> None:
    relay = await net.relay(solicit_namespaces=False)
    s, _c, _t = await solicited_publisher(net, relay, wait=None)
    await setup_seen(relay, s)
    (peer,) = peer_of(relay, 1)
    assert peer.solicitation is None and relay.routing.namespaces() == []


async def test_a_subscriber_that_publishes_nothing_answers_empty(net: Net) -> None:
    """A session with nothing to publish answers REQUEST_OK and no NAMESPACE: no route."""
    relay = await net.relay()
    s = await net.client(relay)
    await setup_seen(relay, s)
    (peer,) = peer_of(relay, 1)
    assert peer.solicitation is not None and peer.solicitation.names == set()
    assert relay.routing.namespaces() == []


async def test_solicit_prefix_and_upstream_chain(net: Net) -> None:
    """A configured prefix is what is solicited; solicited namespaces are announced to the
    --upstream relay, so a subscriber there reaches the publisher through the chain."""
    d = await net.relay()
    a = await net.relay(upstream=d.url, solicit_prefix=NSB[:1])
    watcher_d = await net.client(d)
    await within(watcher_d.subscribe_namespace(NS[:1]))
    pub, _catalog, tracks = await solicited_publisher(net, a, (NS, "cam"), (OTHER, "cam"))
    assert pub is not None
    (peer,) = peer_of(a, 1)
    assert peer.solicitation.prefix == NSB[:1]
    assert a.routing.namespaces() == [NSB]  # OTHER is not under the solicited prefix
    assert await within(watcher_d.namespace_updates.get()) == ("namespace", NSB[1:])
    # D solicited A's session too (A is a downstream session of D): A answers with its
    # downstream publisher's namespace only, and opens no interest of its own at D (no loop).
    up_at_d = [p for p in d.sessions if p.solicitation is not None]
    assert up_at_d and a.propagation.interests == {}
    assert d.routing.namespaces() == [NSB]
    far = await net.client(d)
    sub = await within(far.subscribe(NS, "cam"))
    cam = tracks[NS, "cam"]
    await within(cam.subscribed.wait())
    await within(cam.write_object(0, 0, b"through the chain"))
    await within(cam.finish())
    got = [bytes(x.payload) for x in await within(sub.collect())]
    assert got == [b"through the chain"]
    await within(pub.close())
    assert await within(watcher_d.namespace_updates.get()) == ("namespace_done", NSB[1:])


# -- authorization ---------------------------------------------------------------------------
T_PUB = "pub-token-0123456789"
T_READ = "read-token-0123456789"
AUTH = f"""
[[principals]]
name = "publisher"
token = "{T_PUB}"
publish = ["{format_namespace(NSB)}"]
subscribe = ["{format_namespace(NSB)}"]

[[principals]]
name = "reader"
token = "{T_READ}"
subscribe = [""]
"""


async def test_solicit_only_principals_allowed_to_publish(net: Net) -> None:
    relay = await net.relay(auth=parse_auth_config(tomllib.loads(AUTH)))
    refused = observed(relay, "solicited_namespace_refused", OTHERB)
    pub, _c, tracks = await solicited_publisher(
        net, relay, (NS, "cam"), (OTHER, "cam"),
        setup_tokens=(Token.use_value(0, T_PUB.encode()),))
    await within(refused)  # outside "publisher"'s publish prefixes: ignored
    assert relay.routing.namespaces() == [NSB]
    reader = await net.client(relay)
    with pytest.raises(MoqtError) as info:  # no token: not allowed to subscribe at all
        await within(reader.subscribe(NS, "cam"))
    assert info.value.code == RequestErrorCode.UNAUTHORIZED
    # A session of a principal with no publish grant is not solicited.
    catalog = Catalog()
    catalog.create(NS, "cam")
    r = await within(connect(relay.url, client_config(), catalog=catalog,
                             setup_tokens=(Token.use_value(0, T_READ.encode()),)))
    net.sessions.append(r)
    sub = await within(r.subscribe(NS, "cam"))  # routed to the allowed publisher
    await within(tracks[NS, "cam"].subscribed.wait())
    others = [p for p in relay.sessions if p.solicitation is None]
    assert len(others) == 2  # the reader-with-SOLICIT and the tokenless reader
    assert relay.routing.publishers_of(NSB) == [p for p in relay.sessions
                                               if p.solicitation is not None]
    await within(tracks[NS, "cam"].write_object(0, 0, b"ok"))
    await within(tracks[NS, "cam"].finish())
    assert [bytes(x.payload) for x in await within(sub.collect())] == [b"ok"]
    assert pub is not None


# -- configuration ---------------------------------------------------------------------------
def test_cli_and_config() -> None:
    cfg = build_config(parse_args(["--listen", "127.0.0.1:0"]))
    assert cfg.solicit_namespaces is True and cfg.solicit_prefix == ()
    cfg = build_config(parse_args(["--listen", "127.0.0.1:0", "--no-solicit-namespaces",
                                   "--solicit-prefix", "kvsp-1/0xab01"]))
    assert cfg.solicit_namespaces is False and cfg.solicit_prefix == (b"kvsp-1", b"\xab\x01")
    assert RelayConfig(solicit_prefix=[bytearray(b"a")]).solicit_prefix == (b"a",)
    with pytest.raises(SystemExit):
        parse_args(["--solicit-prefix", "a//b"])
