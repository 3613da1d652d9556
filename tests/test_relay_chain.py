"""Relay chaining with namespace propagation (relay/subscribe/namespaces.py; docs/relay.md
"Chaining"), over real QUIC on 127.0.0.1:

    origin ── rack relay A ──▶ datacenter relay D ◀── rack relay B ── subscribers
                    (A and B have ``upstream = D``)

A forwards the origin's PUBLISH_NAMESPACE to D; B forwards its clients' SUBSCRIBE_NAMESPACE
interest to D and relays D's NAMESPACE / NAMESPACE_DONE; SUBSCRIBE and FETCH from B reach
the origin via D and A, one upstream subscription per track at each hop. No sleeps: every
wait is on a protocol event (``within`` only turns a hang into a failure).
"""

from __future__ import annotations

import asyncio
import tomllib

import pytest
from test_relay import (  # noqa: F401  (net is a fixture)
    NS,
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
from kvsp_moq.pubsub import MoqtError, MoqtSession, connect
from relay import Relay
from relay.ops.auth import parse_auth_config
from relay.subscribe.namespaces import UpstreamInterest

NSB = tuple(f.encode() for f in NS)


async def chain(net: Net, **d_kw) -> tuple[Relay, Relay, Relay]:
    """D, then A and B under it."""
    d = await net.relay(**d_kw)
    a = await net.relay(upstream=d.url)
    b = await net.relay(upstream=d.url)
    return a, d, b


async def next_update(s: MoqtSession) -> tuple[str, tuple[bytes, ...]]:
    return await within(s.namespace_updates.get())


def upstream_has(monkeypatch, relay: Relay, prefix: tuple[bytes, ...],
                 ns: tuple[bytes, ...], present: bool = True) -> asyncio.Future[None]:
    """Resolves once ``relay``'s upstream interest in ``prefix`` does (or, with
    ``present=False``, no longer does) hold ``ns`` (an event hook, not polling)."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    real = UpstreamInterest.on_message

    def check() -> None:
        if not fut.done() and (ns in relay.propagation.upstream_names(prefix)) == present:
            fut.set_result(None)

    def hooked(self, msg):
        real(self, msg)
        check()

    monkeypatch.setattr(UpstreamInterest, "on_message", hooked)
    check()
    return fut


async def test_chain_namespace_subscribe_fetch(net: Net) -> None:
    a, d, b = await chain(net)
    origin, catalog = await net.publisher(a)
    track = catalog.create(NS, "chain")

    # discovery: the origin's namespace reaches a watcher at B through A → D → B
    watcher = await net.client(b)
    await within(watcher.subscribe_namespace(()))
    assert await next_update(watcher) == ("namespace", NSB)
    assert d.routing.lookup(NSB) is not None  # D routes NS down to A
    assert a.stats.upstream_announces == 1 and b.stats.upstream_namespace_subscribes == 1
    assert d.stats.upstream_announces == 0  # D has no upstream

    # two subscribers at B, one at D: ONE subscription at the origin, one per hop
    subs = [await within((await net.client(b)).subscribe(NS, "chain")) for _ in range(2)]
    subs.append(await within((await net.client(d)).subscribe(NS, "chain")))
    await within(track.subscribed.wait())
    assert track.subscriber_count == 1
    assert (a.stats.upstream_subscribes, d.stats.upstream_subscribes,
            b.stats.upstream_subscribes) == (1, 1, 1)
    sent = []
    for g in range(2):
        for o in range(3):
            data, props = payload(g, o, 1000 + 700 * o), [(0x3806, g * 10 + o)]
            await within(track.write_object(g, o, data, properties=props, priority=20 + g))
            sent.append((g, o, data, props, 20 + g))
    await within(track.finish())
    for sub in subs:
        objs = await within(sub.collect())
        assert [(x.group_id, x.object_id, bytes(x.payload), [tuple(p) for p in x.properties],
                 x.publisher_priority) for x in objs] == sent
        assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
    assert track.subscriber_count <= 1

    # FETCH from B through D and A to the origin, then from B's cache
    stored = catalog.create(NS, "stored")
    want = await publish_stored(stored)
    calls = count_fetches(stored)
    c = await net.client(b)
    f1 = await within((await within(c.fetch(NS, "stored", start=(0, 0), end=(1, 4)))).collect())
    assert calls[0] == 1
    f2 = await within((await within(c.fetch(NS, "stored", start=(0, 1), end=(1, 3)))).collect())
    assert calls[0] == 1, "the second FETCH reached the origin"
    assert b.stats.cache_hits == 1
    full = {k: (dt, [tuple(p) for p in props], 10 + k[1]) for k, (dt, props) in want.items()}
    assert as_map(f1) == full
    assert as_map(f2) == {k: v for k, v in full.items() if (0, 1) <= k <= (1, 3)}

    # the origin leaves: A withdraws upstream, D tells B, B tells its watcher
    await within(origin.close())
    assert await next_update(watcher) == ("namespace_done", NSB)
    assert watcher.namespace_updates.empty()
    assert a.propagation.announced == {}
    with pytest.raises(MoqtError) as e:
        await within(c.subscribe(NS, "chain2"))
    assert e.value.code == RequestErrorCode.DOES_NOT_EXIST


async def test_one_upstream_namespace_subscription_per_prefix(net: Net) -> None:
    a, d, b = await chain(net)
    _origin, _ = await net.publisher(a)
    w1, w2 = await net.client(b), await net.client(b)
    await within(w1.subscribe_namespace(("relay-test",)))
    assert await next_update(w1) == ("namespace", (b"ns",))
    await within(w2.subscribe_namespace(("relay-test",)))  # known: in its initial list
    assert await next_update(w2) == ("namespace", (b"ns",))
    assert b.stats.upstream_namespace_subscribes == 1
    assert len(b.propagation.interests) == 1
    # a later namespace upstream reaches both
    await net.publisher(a, ("relay-test", "more"))
    assert await next_update(w1) == ("namespace", (b"more",))
    assert await next_update(w2) == ("namespace", (b"more",))
    # the last watcher leaving cancels the upstream SUBSCRIBE_NAMESPACE: D sees its
    # watcher go (event hook on D's routing table)
    gone = asyncio.get_running_loop().create_future()
    real_unwatch = d.routing.unwatch

    def unwatch(w) -> None:
        real_unwatch(w)
        if d.routing.watcher_count == 0 and not gone.done():
            gone.set_result(None)

    d.routing.unwatch = unwatch  # type: ignore[method-assign]
    await within(w1.close())
    assert d.routing.watcher_count == 1 and b.propagation.interests
    await within(w2.close())
    await within(gone)
    assert b.propagation.interests == {}


async def test_local_and_upstream_namespace_reported_once(net: Net, monkeypatch) -> None:
    """B's own publisher's namespace is announced upstream and echoed back by D: the
    watcher at B hears NAMESPACE once, and NAMESPACE_DONE only when both sides lost it."""
    a, d, b = await chain(net)
    local_ns = (b"local", b"x")
    watcher = await net.client(b)
    await within(watcher.subscribe_namespace(()))
    echoed = upstream_has(monkeypatch, b, (), local_ns)
    pub_b, cat_b = await net.publisher(b, ("local", "x"))
    assert await next_update(watcher) == ("namespace", local_ns)
    await within(echoed)  # D reported it back to B as well
    # a subscriber at A (another rack) reaches B's publisher through D
    t = cat_b.create(("local", "x"), "t")
    sub = await within((await net.client(a)).subscribe(("local", "x"), "t"))
    await within(t.write_object(0, 0, b"from rack B"))
    assert bytes((await within(sub.__anext__())).payload) == b"from rack B"
    # B's publisher leaves: one NAMESPACE_DONE, after D withdrew it too
    await within(pub_b.close())
    assert await next_update(watcher) == ("namespace_done", local_ns)
    assert b.propagation.upstream_names(()) == set()
    assert watcher.namespace_updates.empty()


async def test_local_publisher_covering_prefix_needs_no_upstream_interest(net: Net) -> None:
    a, d, b = await chain(net)
    cover, _ = await net.publisher(b, ("cover",))
    w = await net.client(b)
    await within(w.subscribe_namespace(("cover", "deep")))
    await within(w.subscribe_namespace(("cover",)))  # reply: NAMESPACE ()
    assert await next_update(w) == ("namespace", ())
    # both prefixes lie under the local ("cover",): every track there routes to that
    # publisher, so nothing is asked upstream
    assert set(b.propagation.interests) == {(b"cover",), (b"cover", b"deep")}
    assert not any(i.active for i in b.propagation.interests.values())
    # the local publisher leaves: now the upstream is asked, and its namespaces reported
    await within(cover.close())
    assert await next_update(w) == ("namespace_done", ())
    assert all(i.active for i in b.propagation.interests.values())
    await net.publisher(a, ("cover", "deep", "z"))
    assert {await next_update(w), await next_update(w)} == {
        ("namespace", (b"deep", b"z")), ("namespace", (b"z",))}
    assert b.stats.upstream_namespace_subscribes == 2


T_RACK_A = "rack-a-token-0123456789"
T_RACK_B = "rack-b-token-0123456789"
T_OPS = "ops-token-0123456789ab"
AUTH_D = f"""
[[principals]]
name = "rack-a"
token = "{T_RACK_A}"
publish = ["relay-test", "secret", "zz"]

[[principals]]
name = "rack-b"
token = "{T_RACK_B}"
subscribe = [""]
"""
AUTH_A = f"""
[anonymous]
publish = [""]

[relay]
upstream_token = "{T_RACK_A}"
"""
AUTH_B = f"""
[[principals]]
name = "ops"
token = "{T_OPS}"
subscribe = [""]

[anonymous]
subscribe = ["relay-test", "zz"]

[relay]
upstream_token = "{T_RACK_B}"
"""


def _auth(text: str):
    return parse_auth_config(tomllib.loads(text))


async def test_chain_authorization(net: Net) -> None:
    """D admits only tokens: A announces with its upstream_token (rack-a), B asks with its
    own (rack-b). B filters what it relays per principal, as for local namespaces."""
    d = await net.relay(auth=_auth(AUTH_D))
    a = await net.relay(upstream=d.url, auth=_auth(AUTH_A))
    b = await net.relay(upstream=d.url, auth=_auth(AUTH_B))
    names = [("relay-test", "ns"), ("secret", "x"), ("zz", "top")]
    catalogs = [(await net.publisher(a, ns))[1] for ns in names]
    full = {tuple(f.encode() for f in ns) for ns in names}
    ops = await within(connect(b.url, client_config(), setup_tokens=[T_OPS]))
    net.sessions.append(ops)
    await within(ops.subscribe_namespace(()))
    assert {(await next_update(ops))[1] for _ in names} == full
    # an anonymous watcher at B: its initial list comes sorted in one go, so "secret/x"
    # would sit between these two
    anon = await net.client(b)
    await within(anon.subscribe_namespace(()))
    assert await next_update(anon) == ("namespace", (b"relay-test", b"ns"))
    assert await next_update(anon) == ("namespace", (b"zz", b"top"))
    with pytest.raises(MoqtError) as e:
        await within(anon.subscribe(("secret", "x"), "t"))
    assert e.value.code == RequestErrorCode.UNAUTHORIZED
    # ops may: B subscribes at D as rack-b, D at A as itself (trusted upstream of A)
    t = catalogs[1].create(("secret", "x"), "t")
    sub = await within(ops.subscribe(("secret", "x"), "t"))
    await within(t.write_object(0, 0, b"classified"))
    assert bytes((await within(sub.__anext__())).payload) == b"classified"
    assert a.stats.upstream_announces == 3 and d.stats.auth_refusals == 0
