"""Relay operations over real sockets: the Prometheus ``/metrics`` endpoint (parsed here),
JSON logs of ``python -m relay --log-format json`` (a subprocess), and a client that
reconnects and resubscribes after the relay restarts. No sleeps: every wait is on an event.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.pubsub import Catalog, MoqtError, MoqtSession, connect
from kvsp_moq.transport import ConnectError, TransportConfig, TransportError
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig
from relay.ops.metrics import render_metrics

GUARD = 30.0
ROOT = Path(__file__).resolve().parent.parent
DGRAM = 8192
NS = ("ops", "ns")
_CERT = make_self_signed()


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM)


def relay_config(**kw) -> RelayConfig:
    server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                             max_datagram_size=DGRAM)
    return RelayConfig(server_transport=server, **kw)


async def http_get(port: int, request: bytes) -> tuple[int, str]:
    reader, writer = await within(asyncio.open_connection("127.0.0.1", port))
    writer.write(request)
    await writer.drain()
    data = await within(reader.read())  # the server closes after one response
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body.decode()


def parse_prometheus(text: str) -> dict[str, float]:
    """The text exposition format: ``# HELP`` / ``# TYPE`` comments and ``name value``."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            name, value = line.split(" ")
            assert name in types, f"{name} has no # TYPE"
            out[name] = float(value)
    assert all(n.endswith("_total") for n, k in types.items() if k == "counter")
    return out


async def scrape(port: int) -> dict[str, float]:
    status, body = await http_get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    return parse_prometheus(body)


async def test_metrics_endpoint_moves_with_traffic() -> None:
    relay = await Relay(relay_config(metrics=("127.0.0.1", 0))).start()
    sessions: list[MoqtSession] = []
    try:
        assert relay.metrics is not None
        port = relay.metrics.port
        before = await scrape(port)
        assert before["relay_bytes_in_total"] == 0 and before["relay_subscribers"] == 0
        assert before["relay_cache_hit_ratio"] == 0
        assert (await http_get(port, b"GET /other HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await http_get(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await http_get(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000))[0] == 400
        catalog = Catalog()
        pub = await within(connect(relay.url, client_config(), catalog=catalog))
        sub_s = await within(connect(relay.url, client_config()))
        sessions += [pub, sub_s]
        await within(pub.publish_namespace(NS))
        track = catalog.create(NS, "t")
        sub = await within(sub_s.subscribe(NS, "t"))
        await within(track.subscribed.wait())
        for o in range(4):
            await within(track.write_object(0, o, bytes(1000)))
        for _ in range(4):
            await within(sub.__anext__())
        mid = await scrape(port)
        assert mid["relay_sessions"] == 2 and mid["relay_subscribers"] == 1
        assert mid["relay_tracks"] == 1 and mid["relay_upstream_subscribes_total"] == 1
        assert mid["relay_bytes_in_total"] == 4000 and mid["relay_bytes_out_total"] == 4000
        assert mid["relay_cache_bytes"] > 4000  # live objects are cached too
        # FETCH of what the subscription brought, twice: hits (no upstream request); a track
        # nobody subscribed: a miss (upstream).
        for _ in range(2):
            f = await within(sub_s.fetch(NS, "t", start=(0, 0), end=(0, 3)))
            assert len(await within(f.collect())) == 4
        cold = catalog.create(NS, "cold")
        for o in range(4):
            await within(cold.write_object(0, o, bytes(1000)))
        f = await within(sub_s.fetch(NS, "cold", start=(0, 0), end=(0, 3)))
        assert len(await within(f.collect())) == 4
        after = await scrape(port)
        assert after["relay_cache_misses_total"] == 1 and after["relay_cache_hits_total"] == 2
        assert after["relay_upstream_fetches_total"] == 1
        assert after["relay_cache_hit_ratio"] == pytest.approx(2 / 3, abs=1e-6)
        assert after["relay_bytes_in_total"] == 4000 + 4000
        assert after["relay_bytes_out_total"] == 4000 + 3 * 4000
        assert after["relay_requests_total"] >= 4
    finally:
        for s in sessions:
            await within(s.close())
        await within(relay.close())


def test_render_metrics_text_format() -> None:
    text = render_metrics({"bytes_in": 5, "sessions": 2, "cache_hits": 3, "cache_misses": 1})
    parsed = parse_prometheus(text)
    assert parsed == {"relay_sessions": 2, "relay_bytes_in_total": 5,
                      "relay_cache_hits_total": 3, "relay_cache_misses_total": 1,
                      "relay_cache_hit_ratio": 0.75}
    assert text.endswith("\n")


async def test_json_logs_and_metrics_of_python_m_relay(tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text('[[principals]]\nname = "ops"\ntoken = "ops-token-0123456789"\n'
                   'publish = ["ops"]\nsubscribe = ["ops"]\n'
                   '[anonymous]\nsubscribe = ["ops/ns"]\n')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--config", str(cfg),
        "--metrics", "0", "--log-format", "json", "--max-datagram-size", str(DGRAM),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        url = (await within(proc.stdout.readline())).decode().split()[-1]
        wt_line = (await within(proc.stdout.readline())).decode()  # WebTransport on the same port (on by default)
        assert wt_line.startswith("relay webtransport on https://127.0.0.1:"), wt_line
        metrics_line = (await within(proc.stdout.readline())).decode()
        assert metrics_line.startswith("relay metrics on http://127.0.0.1:")
        mport = int(metrics_line.rsplit(":", 1)[1].split("/")[0])
        from kvsp_moq.moqt.messages import MessageParameters, Token
        catalog = Catalog()
        pub = await within(connect(url, client_config(), catalog=catalog))
        token = MessageParameters(authorization_tokens=(
            Token.use_value(0, b"ops-token-0123456789"),))
        await within(pub._request(lambda m: m.publish_namespace((b"ops", b"ns"), token)))
        track = catalog.create(NS, "t")
        sub_s = await within(connect(url, client_config()))
        with pytest.raises(MoqtError) as e:
            await within(sub_s.subscribe(("ops", "secret"), "t"))  # anonymous: ops/ns only
        assert e.value.code == RequestErrorCode.UNAUTHORIZED
        await within(track.write_object(0, 0, b"x" * 100))  # before the subscription
        sub = await within(sub_s.subscribe(NS, "t"))
        await within(track.subscribed.wait())
        await within(track.write_object(0, 1, b"y" * 100))
        await within(sub.__anext__())
        for _ in range(2):  # object 1 held, object 0 FETCHed upstream; then both held
            f = await within(sub_s.fetch(NS, "t", start=(0, 0), end=(0, 1)))
            assert len(await within(f.collect())) == 2
        await within(sub.cancel())
        await within(track.unsubscribed.wait())
        m = await scrape(mport)
        # 100 bytes live + 100 by the upstream FETCH of the gap
        assert m["relay_auth_refusals_total"] == 1 and m["relay_bytes_in_total"] == 200
        assert m["relay_cache_hits_total"] == 2 and m["relay_cache_misses_total"] == 1
        proc.send_signal(signal.SIGTERM)
        await within(sub_s.goaway_received)
        await within(pub.goaway_received)
        await within(sub_s.close())
        await within(pub.close())
        assert await within(proc.wait()) == 0
        lines = (await within(proc.stderr.read())).decode().splitlines()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    docs = [json.loads(line) for line in lines]  # every line is one JSON object
    events = [d["event"] for d in docs]
    for name in ("session_open", "request", "upstream_subscribe", "upstream_cancel",
                 "cache_partial_hit", "cache_miss", "upstream_fetch", "cache_hit",
                 "session_close"):
        assert name in events, (name, events)
    opened = next(d for d in docs if d["event"] == "session_open")
    assert opened["peer"].startswith("127.0.0.1:") and opened["version"].startswith("moqt-")
    refused = [d for d in docs if d["event"] == "request" and d["decision"] == "refused"]
    assert len(refused) == 1 and refused[0]["namespace"] == "ops/secret"
    assert refused[0]["code"] == RequestErrorCode.UNAUTHORIZED
    allowed = [d for d in docs if d["event"] == "request" and d["decision"] == "allowed"]
    assert {d["type"] for d in allowed} >= {"PUBLISH_NAMESPACE", "SUBSCRIBE", "FETCH"}
    assert all({"ts", "level", "logger", "msg"} <= d.keys() for d in docs)


async def _connect_retrying(url: str, attempts: int = 20, **kw) -> MoqtSession:
    """The reconnect of a client: a bounded number of attempts, each bounded in time."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return await asyncio.wait_for(connect(url, client_config(), **kw), 2.0)
        except (ConnectError, TransportError, ConnectionError, OSError,
                asyncio.TimeoutError) as exc:
            last = exc
    raise AssertionError(f"no reconnect after {attempts} attempts: {last!r}")


async def _subscribe_retrying(url: str, attempts: int = 20):
    """Reconnect, then SUBSCRIBE until the publisher's namespace is routed again."""
    for _ in range(attempts):
        s = await _connect_retrying(url)
        for _ in range(attempts):
            try:
                return s, await within(s.subscribe(NS, "t"))
            except MoqtError as exc:
                if exc.code != RequestErrorCode.DOES_NOT_EXIST:
                    raise
                # not announced yet: wait for the route to appear (the relay's NAMESPACE)
                await within(s.subscribe_namespace(NS[:1]))
                await within(s.namespace_updates.get())
    raise AssertionError("no resubscription")


async def test_relay_restart_client_reconnects_and_resubscribes() -> None:
    relay = await Relay(relay_config(drain_timeout=5)).start()
    port = relay.port
    catalog = Catalog()
    pub = await within(connect(relay.url, client_config(), catalog=catalog))
    await within(pub.publish_namespace(NS))
    track = catalog.create(NS, "t", keep=False)
    sub_s = await within(connect(relay.url, client_config()))
    sub = await within(sub_s.subscribe(NS, "t"))
    await within(track.subscribed.wait())
    await within(track.write_object(0, 0, b"before"))
    assert bytes((await within(sub.__anext__())).payload) == b"before"

    # Restart: GOAWAY to both clients; they leave; a new relay binds the same port.
    shutdown = asyncio.ensure_future(relay.shutdown())
    await within(sub_s.goaway_received)
    await within(pub.goaway_received)
    await within(sub_s.close())
    await within(pub.close())
    assert await within(shutdown) is True
    relay2 = await Relay(relay_config(port=port)).start()
    try:
        url = relay2.url
        assert url.endswith(f":{port}/moq")
        sub_task = asyncio.ensure_future(_subscribe_retrying(url))
        catalog2 = Catalog()
        pub2 = await _connect_retrying(url, catalog=catalog2)
        track2 = catalog2.create(NS, "t", keep=False)
        await within(pub2.publish_namespace(NS))
        sub_s2, sub2 = await within(sub_task)
        await within(track2.subscribed.wait())
        for o in range(3):
            await within(track2.write_object(1, o, b"after-%d" % o))
        for o in range(3):
            obj = await within(sub2.__anext__())
            assert (obj.group_id, obj.object_id, bytes(obj.payload)) == (1, o, b"after-%d" % o)
        await within(sub_s2.close())
        await within(pub2.close())
    finally:
        await within(relay2.close())
