"""Relays that come back (issue 19): a chained relay whose upstream relay is SIGKILLed and
restarted on the same port, and one whose upstream sends GOAWAY with a New Session URI.

Every relay is a real ``python -m relay`` process; publishers and subscribers are pubsub
clients over real QUIC on 127.0.0.1. The chained relay (rack A) finds the dead upstream by
its liveness PING (``--upstream-keepalive``; the QUIC idle timeout is 60 s, every wait here
is far shorter), reconnects with backoff, and re-sends its PUBLISH_NAMESPACE, PUBLISH and
SUBSCRIBE_NAMESPACE there: observed at the restarted upstream by subscribers that get data.
Requests in flight through the dead upstream end with the error docs/relay.md names (PUBLISH_DONE
INTERNAL_ERROR "upstream session closed"); the others see none. No sleeps: every wait is on
an event, a process line or a bounded poll that fails loudly.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.messages import MessageParameters
from kvsp_moq.pubsub import Catalog, MoqtSession, Subscription, connect
from kvsp_moq.pubsub.liveness import Reconnect
from kvsp_moq.transport import TransportConfig
from relay import RelayConfig
from relay.__main__ import build_config, parse_args
from relay_restart_support import GUARD, RelayProcess, within
#: The chained relay's liveness PING period and deadline, and its reconnect backoff cap
#: (seconds; the deadline leaves room for a loaded 2-core machine's event loops).
KEEPALIVE = 0.3
LIVENESS = 1.0
BACKOFF_MAX = 0.5
#: A dead upstream is found within KEEPALIVE + LIVENESS, the restarted one reached within
#: BACKOFF_MAX more: everything below must happen well inside.
BOUND = 10.0
RENDEZVOUS = MessageParameters(rendezvous_timeout=int(BOUND * 1000))


def client() -> TransportConfig:
    return TransportConfig(insecure=True)


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[list[RelayProcess]]:
    made: list[RelayProcess] = []
    yield made
    for p in made:
        await p.stop()


async def test_an_object_in_progress_at_the_switchover_is_not_cut(
        tmp_path: Path, procs: list[RelayProcess]) -> None:
    """An object the old upstream subscription is still bringing when the new one's
    SUBSCRIBE_OK arrives (its Largest Object is the one before: the publisher counts an
    object once it is whole) is forwarded to its end, not reset downstream: the new
    subscription never carries it (a subscriber that joins mid-object gets the next one)."""
    d1, d2, a = await goaway_chain(tmp_path, procs)
    cat = Catalog()
    pub_old = await within(connect(d1.url, client(), catalog=cat))
    await within(pub_old.publish_namespace(("rg", "p")))
    live = cat.create(("rg", "p"), "live", keep=False)
    sub_a = await within(connect(a.url, client()))
    begun: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    moving = await within(sub_a.subscribe(
        ("rg", "p"), "live", on_object_begin=lambda o: begun.put_nowait(
            (o.group_id, o.object_id))))
    await within(live.subscribed.wait())
    await within(live.write_object(0, 0, b"live-0"))
    assert await next_object(moving) == b"live-0"
    # Half of object 1 reaches the subscriber through A -> D1.
    writer = await within(live.begin_object(0, 1, 12))
    await within(writer.write(b"live-1"))
    assert await within(begun.get()) == (0, 0)
    assert await within(begun.get()) == (0, 1)
    live.subscribed.clear()
    # D1 drains; the publisher and A move to D2; A's new SUBSCRIBE_OK says Largest (0, 0).
    assert d1.proc is not None
    d1.proc.send_signal(signal.SIGTERM)
    assert await within(pub_old.goaway_received) == d2.url
    pub_new = await within(connect(d2.url, client(), catalog=cat))
    await within(pub_new.publish_namespace(("rg", "p")))
    await within(live.subscribed.wait())
    await within(a.wait_log("upstream_switched"))
    # The rest of object 1 (through D1 only), then object 2 (both ways, once to A's client);
    # before the fix A cancelled D1 at its SUBSCRIBE_OK and reset object 1 downstream.
    await within(writer.write(b"-rest!"))
    await within(writer.close())
    await within(live.write_object(0, 2, b"live-2"))
    got = {}
    for _ in range(2):  # two paths: either may complete first
        o = await within(moving.__anext__(), BOUND)
        got[(o.group_id, o.object_id)] = bytes(o.payload)
    assert got == {(0, 1): b"live-1-rest!", (0, 2): b"live-2"}
    assert not moving.done and moving.publish_done is None
    for s in (sub_a, pub_old, pub_new):
        await within(s.close())


async def goaway_chain(tmp_path: Path, procs: list[RelayProcess]
                       ) -> tuple[RelayProcess, RelayProcess, RelayProcess]:
    """D1 (whose drain sends GOAWAY with D2's URI), D2, and A chained to D1: started."""
    d2 = await RelayProcess(tmp_path / "d2.log").start()
    procs.append(d2)
    d1 = await RelayProcess(tmp_path / "d1.log", "--goaway-uri", d2.url,
                            "--drain-timeout", str(GUARD)).start()
    procs.append(d1)
    a = await chained(tmp_path, "a", d1.url).start()
    procs.append(a)
    return d1, d2, a


def chained(tmp_path: Path, name: str, upstream: str) -> RelayProcess:
    return RelayProcess(tmp_path / f"{name}.log", "--upstream", upstream, "--insecure-upstream",
                        "--upstream-keepalive", str(KEEPALIVE),
                        "--upstream-liveness-timeout", str(LIVENESS),
                        "--upstream-reconnect-max", str(BACKOFF_MAX))


async def next_object(sub: Subscription) -> bytes:
    return bytes((await within(sub.__anext__(), BOUND)).payload)


async def wait_namespace(session: MoqtSession, kind: str, suffix: tuple[bytes, ...]) -> None:
    """Read NAMESPACE / NAMESPACE_DONE updates until ``(kind, suffix)`` (bounded)."""
    while True:
        got = await within(session.namespace_updates.get(), BOUND)
        if got == (kind, suffix):
            return


async def test_upstream_killed_and_restarted(tmp_path: Path, procs: list[RelayProcess]) -> None:
    d = await RelayProcess(tmp_path / "d.log").start()
    procs.append(d)
    a = await chained(tmp_path, "a", d.url).start()
    procs.append(a)

    # At rack A: a namespace publisher, a PUBLISHed track, and a subscriber of both A's own
    # track and one only the upstream D serves.
    cat_a = Catalog()
    pub_a = await within(connect(a.url, client(), catalog=cat_a))
    await within(pub_a.publish_namespace(("rc", "a")))
    t_a = cat_a.create(("rc", "a"), "t", keep=False)
    cat_p = Catalog()
    pub_p = await within(connect(a.url, client(), catalog=cat_p))
    t_p = cat_p.create(("rc", "p"), "live", keep=False)
    await within(pub_p.publish(t_p))

    cat_d = Catalog()
    pub_d = await within(connect(d.url, client(), catalog=cat_d))
    await within(pub_d.publish_namespace(("rc", "d")))
    t_d = cat_d.create(("rc", "d"), "t", keep=False)

    sub = await within(connect(a.url, client()))
    await within(sub.subscribe_namespace(("rc",)))
    await wait_namespace(sub, "namespace", (b"d",))  # A's interest went up to D
    via_d = await within(sub.subscribe(("rc", "d"), "t"))
    local = await within(sub.subscribe(("rc", "a"), "t"))
    await within(t_d.subscribed.wait())
    await within(t_a.subscribed.wait())
    await within(t_d.write_object(0, 0, b"d-before"))
    await within(t_a.write_object(0, 0, b"a-before"))
    assert await next_object(via_d) == b"d-before"
    assert await next_object(local) == b"a-before"

    # SIGKILL the upstream: nothing tells A but its unacknowledged PING.
    d.kill()
    assert await d.wait() == -signal.SIGKILL
    await within(pub_d.close())
    # The request in flight through D ends with PUBLISH_DONE INTERNAL_ERROR; D's namespace
    # leaves the watcher's list.
    with pytest.raises(StopAsyncIteration):
        await within(via_d.__anext__(), BOUND)
    assert via_d.publish_done is not None
    assert via_d.publish_done.status_code == PublishDoneCode.INTERNAL_ERROR
    await wait_namespace(sub, "namespace_done", (b"d",))
    # ... while the local subscription and the session carry on without an error.
    await within(t_a.write_object(0, 1, b"a-during"))
    assert await next_object(local) == b"a-during"

    # Restart D on the same port (clients' URLs stay valid).
    await d.start()
    # A reconnects and re-sends its PUBLISH_NAMESPACE and PUBLISH: subscribers at the new D
    # reach rack A's publishers (held by RENDEZVOUS_TIMEOUT until A's requests arrive).
    at_d = await within(connect(d.url, client()))
    from_a = await within(at_d.subscribe(("rc", "a"), "t", parameters=RENDEZVOUS), BOUND)
    from_p = await within(at_d.subscribe(("rc", "p"), "live", parameters=RENDEZVOUS), BOUND)
    # (A's subscription to its publisher is shared with the local subscriber: one upstream.)
    await within(t_a.write_object(1, 0, b"a-after"))
    assert await next_object(from_a) == b"a-after"
    assert await next_object(local) == b"a-after"
    await within(t_p.write_object(0, 0, b"p-after"))
    assert await next_object(from_p) == b"p-after"

    # ... and its SUBSCRIBE_NAMESPACE: D's publisher coming back is listed at A again, and
    # the next SUBSCRIBE and FETCH through A to D succeed.
    cat_d2 = Catalog()
    pub_d2 = await within(connect(d.url, client(), catalog=cat_d2))
    t_d2 = cat_d2.create(("rc", "d"), "t", keep=True)
    # (Object {0, 0} is held at A since before the restart, and an object never changes,
    # §"Objects": A would answer a FETCH of it itself. The FETCH below asks for one A never had.)
    await within(t_d2.write_object(0, 1, b"stored"))
    await within(pub_d2.publish_namespace(("rc", "d")))
    await wait_namespace(sub, "namespace", (b"d",))
    again = await within(sub.subscribe(("rc", "d"), "t"))
    await within(t_d2.subscribed.wait())
    await within(t_d2.write_object(1, 0, b"d-after"))
    assert await next_object(again) == b"d-after"
    fetched = await within(sub.fetch(("rc", "d"), "t", start=(0, 1), end=(0, 1)))
    assert [bytes(o.payload) async for o in fetched] == [b"stored"]
    assert not local.done and sub.moqt is not None and not sub.moqt.closed
    for s in (sub, at_d, pub_a, pub_p, pub_d2):
        await within(s.close())


async def test_upstream_goaway_moves_to_the_new_session_uri(
        tmp_path: Path, procs: list[RelayProcess]) -> None:
    d1, d2, a = await goaway_chain(tmp_path, procs)

    cat = Catalog()
    pub = await within(connect(a.url, client(), catalog=cat))
    await within(pub.publish_namespace(("rg", "a")))
    track = cat.create(("rg", "a"), "t", keep=False)
    watcher = await within(connect(d1.url, client()))
    await within(watcher.subscribe_namespace(("rg",)))
    await wait_namespace(watcher, "namespace", (b"a",))  # A announced it at D1
    # A publisher at D1, and a subscriber at A of its track (A -> D1 -> publisher).
    cat_p = Catalog()
    pub_old = await within(connect(d1.url, client(), catalog=cat_p))
    await within(pub_old.publish_namespace(("rg", "p")))
    live = cat_p.create(("rg", "p"), "live", keep=False)
    sub_a = await within(connect(a.url, client()))
    moving = await within(sub_a.subscribe(("rg", "p"), "live"))
    await within(live.subscribed.wait())
    await within(live.write_object(0, 0, b"live-0"))
    assert await next_object(moving) == b"live-0"
    live.subscribed.clear()
    live.unsubscribed.clear()  # set again once A cancels its subscription through D1

    # D1 drains (SIGTERM): GOAWAY with D2's URI to A, the publisher and the watcher.
    assert d1.proc is not None
    d1.proc.send_signal(signal.SIGTERM)
    await within(watcher.goaway_received)
    await within(watcher.close())
    # The publisher moves as draft-22 §"Graceful Publisher Relay Switchover" says: it
    # announces on a session to D2 and goes on publishing on both (one catalog).
    assert await within(pub_old.goaway_received) == d2.url
    pub_new = await within(connect(d2.url, client(), catalog=cat_p))
    await within(pub_new.publish_namespace(("rg", "p")))
    # A's subscription moves too (§"Graceful Subscriber Relay Switchover"): its SUBSCRIBE
    # reaches the publisher through D2; while both carry the track every object reaches
    # the subscriber at A once, and then A cancels the old one.
    await within(live.subscribed.wait())
    await within(live.write_object(0, 1, b"live-1"))
    assert await next_object(moving) == b"live-1"
    await within(live.unsubscribed.wait())  # A cancelled its subscription through D1
    await within(pub_old.close())
    await within(live.write_object(0, 2, b"live-2"))
    assert await next_object(moving) == b"live-2"
    # A moved its announcement to D2: a subscriber there reaches A's publisher.
    at_d2 = await within(connect(d2.url, client()))
    from_a = await within(at_d2.subscribe(("rg", "a"), "t", parameters=RENDEZVOUS), BOUND)
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"via d2"))
    assert await next_object(from_a) == b"via d2"
    # A closed its old session once nothing was left on it: D1 stops well before its drain
    # timeout (GUARD), with exit status 0.
    assert await within(d1.wait(), BOUND) == 0
    # The moved subscription outlives D1: no PUBLISH_DONE, the next object, exactly once.
    await within(live.write_object(1, 0, b"live-3"))
    assert await next_object(moving) == b"live-3"
    assert not moving.done and moving.publish_done is None
    # New requests from A's clients go up to D2: a track only D2 serves.
    cat2 = Catalog()
    pub2 = await within(connect(d2.url, client(), catalog=cat2))
    await within(pub2.publish_namespace(("rg", "d2")))
    t2 = cat2.create(("rg", "d2"), "t", keep=False)
    up = await within(sub_a.subscribe(("rg", "d2"), "t"))
    await within(t2.subscribed.wait())
    await within(t2.write_object(0, 0, b"d2 only"))
    assert await next_object(up) == b"d2 only"
    for s in (sub_a, at_d2, pub, pub2, pub_new):
        await within(s.close())


def test_reconnect_backoff_and_its_settings() -> None:
    r = Reconnect(backoff_initial=0.1, backoff_max=0.5, jitter=0.0)
    waits = [w for w, _ in zip(r.delays(), range(5))]
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert [r.delay(n) for n in (1, 2, 3, 4, 1000)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    jittered = [w for w, _ in zip(Reconnect(backoff_initial=1, backoff_max=1, jitter=0.5).delays(),
                                  range(50))]
    assert all(0.5 <= w <= 1 for w in jittered) and len(set(jittered)) > 1
    for bad in ({"keepalive": -1}, {"liveness_timeout": 0}, {"backoff_initial": 0},
                {"backoff_initial": 2, "backoff_max": 1}, {"backoff_factor": 0.5},
                {"jitter": 1}):
        with pytest.raises(ValueError):
            Reconnect(**bad)
    with pytest.raises(ValueError, match="upstream_keepalive"):
        RelayConfig(upstream_keepalive=-1)
    with pytest.raises(ValueError, match="upstream_keepalive"):
        RelayConfig(upstream_reconnect_initial=10, upstream_reconnect_max=1)


def test_cli_flags_of_the_upstream_link() -> None:
    cfg = build_config(parse_args([
        "--upstream", "moqt://up:4443/moq", "--upstream-keepalive", "0.5",
        "--upstream-liveness-timeout", "0.5",
        "--upstream-reconnect-initial", "0.2", "--upstream-reconnect-max", "3",
        "--goaway-uri", "moqt://next:4443/moq"]))
    assert (cfg.upstream_keepalive, cfg.upstream_liveness_timeout) == (0.5, 0.5)
    assert cfg.upstream_reconnect == Reconnect(keepalive=0.5, liveness_timeout=0.5,
                                               backoff_initial=0.2, backoff_max=3)
    assert cfg.goaway_uri == "moqt://next:4443/moq"
    default = build_config(parse_args([]))
    assert default.upstream_reconnect == Reconnect() and default.goaway_uri == ""
    off = build_config(parse_args(["--upstream-keepalive", "0"]))
    assert off.upstream_keepalive == 0 and off.upstream_liveness_timeout == 5.0


async def test_an_upstream_that_comes_up_later(tmp_path: Path, procs: list[RelayProcess]) -> None:
    # D's port, with nothing listening on it when A first needs it.
    d = await RelayProcess(tmp_path / "d.log").start()
    procs.append(d)
    d.kill()
    await d.wait()
    a = chained(tmp_path, "a", d.url)
    a.args += ("--request-timeout", "2")  # bounds each connect attempt
    await a.start()
    procs.append(a)
    cat = Catalog()
    pub = await within(connect(a.url, client(), catalog=cat))
    await within(pub.publish_namespace(("rl", "a")))
    track = cat.create(("rl", "a"), "t", keep=False)
    await a.wait_log("unreachable")  # A's first connect to D failed: it keeps trying
    await d.start()
    at_d = await within(connect(d.url, client()))
    from_a = await within(at_d.subscribe(("rl", "a"), "t", parameters=RENDEZVOUS), BOUND)
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"late upstream"))
    assert await next_object(from_a) == b"late upstream"
    for s in (at_d, pub):
        await within(s.close())


async def test_an_unusable_new_session_uri_keeps_the_target() -> None:
    # In-process relays: D's GOAWAY names a URI nobody can connect to (hostile or broken).
    from kvsp_moq.transport.tls import make_self_signed
    from relay import Relay

    cert = make_self_signed()

    def cfg(**kw) -> RelayConfig:
        return RelayConfig(server_transport=TransportConfig(certificate_pem=cert.cert_pem,
                                                            private_key_pem=cert.key_pem),
                           upstream_transport=client(), **kw)

    d = await Relay(cfg(goaway_uri="not a uri", drain_timeout=0.3)).start()
    port, d_url = d.port, d.url
    a = await Relay(cfg(upstream=d_url, upstream_keepalive=KEEPALIVE,
                        upstream_liveness_timeout=LIVENESS,
                        upstream_reconnect_max=BACKOFF_MAX)).start()
    d2: Relay | None = None
    try:
        cat = Catalog()
        pub = await within(connect(a.url, client(), catalog=cat))
        await within(pub.publish_namespace(("rj", "a")))
        track = cat.create(("rj", "a"), "t", keep=False)
        watcher = await within(connect(d_url, client()))
        await within(watcher.subscribe_namespace(("rj",)))
        await wait_namespace(watcher, "namespace", (b"a",))
        drained = asyncio.ensure_future(d.shutdown())
        await within(watcher.goaway_received)
        await within(watcher.close())
        await within(drained)
        assert a.uplink.target == d_url  # the junk URI was not taken
        d2 = await Relay(cfg(port=port)).start()
        at_d2 = await within(connect(d2.url, client()))
        got = await within(at_d2.subscribe(("rj", "a"), "t", parameters=RENDEZVOUS), BOUND)
        await within(track.subscribed.wait())
        await within(track.write_object(0, 0, b"same url"))
        assert await next_object(got) == b"same url"
        for s in (at_d2, pub):
            await within(s.close())
    finally:
        await within(a.close())
        if d2 is not None:
            await within(d2.close())
