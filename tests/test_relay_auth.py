"""Relay authorization over real QUIC on 127.0.0.1 (relay/ops/auth.py, relay/ops/gate.py): tokens
in SETUP and in request AUTHORIZATION_TOKEN parameters, REQUEST_ERROR UNAUTHORIZED, namespace
listings filtered, token aliases. No sleeps: every wait is on a protocol event.

The pubsub API takes request parameters only on ``subscribe``, so the other requests with a
token go through ``MoqtSession._request`` here, and a SETUP token through a client whose SETUP
carries it (``setup_tokens``: SessionConfig's AUTHORIZATION TOKEN options; docs/relay.md
"Clients").
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode
from kvsp_moq.moqt.messages import MessageParameters, Token
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.pubsub import Catalog, FetchStream, MoqtError, MoqtSession
from kvsp_moq.transport import TransportConfig, connect as transport_connect, parse_moqt_url
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig
from relay.ops.auth import AuthConfigError, Authorizer, parse_auth_config
from relay.ops.names import format_namespace, parse_namespace
from relay.ops.tokens import TokenCache, TokenError

GUARD = 30.0
ROOT = Path(__file__).resolve().parent.parent
DGRAM = 8192
_CERT = make_self_signed()
SCOPE = bytes(range(16))
A = (b"kvsp-1", b"\xaa" * 4, SCOPE)          # prefix "kvsp-1/0xaaaaaaaa/0x0001...0f"
B = (b"kvsp-1", b"\xbb" * 4, SCOPE)
T_PUB = "pub-token-0123456789"
T_SUBA = "suba-token-0123456789"
T_ADMIN = "admin-token-0123456789"
CONFIG = f"""
[[principals]]
name = "publisher-a"
token = "{T_PUB}"
publish = ["{format_namespace(A)}"]

[[principals]]
name = "reader-a"
token = "{T_SUBA}"
subscribe = ["{format_namespace(A)}"]

[[principals]]
name = "admin"
token = "{T_ADMIN}"
publish = ["kvsp-1"]
subscribe = ["kvsp-1"]
"""


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def tok(value: str) -> Token:
    return Token.use_value(0, value.encode())


def P(*tokens: Token) -> MessageParameters:
    return MessageParameters(authorization_tokens=tokens)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True, max_datagram_size=DGRAM)


async def connect_with(url: str, setup_tokens: tuple[Token, ...] = (),
                       catalog: Catalog | None = None) -> MoqtSession:
    parsed = parse_moqt_url(url)
    cfg = SessionConfig(path=parsed.path_and_query, authority=parsed.authority)
    made: list[MoqtSession] = []

    def factory() -> MoqtSession:
        s = MoqtSession(Role.CLIENT, catalog=catalog, session_config=cfg,
                        setup_tokens=setup_tokens)
        made.append(s)
        return s

    await within(transport_connect(parsed, factory, client_config()))
    await within(asyncio.shield(made[0].ready))
    return made[0]


class Net:
    def __init__(self) -> None:
        self.relay: Relay | None = None
        self.sessions: list[MoqtSession] = []

    async def start(self, config_text: str | None = CONFIG) -> Relay:
        auth = parse_auth_config(__import__("tomllib").loads(config_text)) if config_text else None
        server = TransportConfig(certificate_pem=_CERT.cert_pem, private_key_pem=_CERT.key_pem,
                                 max_datagram_size=DGRAM)
        self.relay = await Relay(RelayConfig(server_transport=server, auth=auth)).start()
        return self.relay

    async def client(self, *setup_tokens: Token, catalog: Catalog | None = None) -> MoqtSession:
        assert self.relay is not None
        s = await connect_with(self.relay.url, setup_tokens, catalog)
        self.sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self.sessions:
            if not s.closed.done():
                await within(s.close())
        if self.relay is not None:
            await within(self.relay.close())


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        await n.close()


async def publish_namespace(s: MoqtSession, ns, *tokens: Token) -> None:
    await within(s._request(lambda m: m.publish_namespace(ns, P(*tokens))))


async def subscribe_namespace(s: MoqtSession, prefix, *tokens: Token) -> None:
    await within(s._request(lambda m: m.subscribe_namespace(prefix, P(*tokens))))


async def track_status(s: MoqtSession, ns, name: bytes, *tokens: Token):
    return (await within(s._request(lambda m: m.track_status(ns, name, P(*tokens)))))[1]


async def fetch(s: MoqtSession, ns, name: bytes, *tokens: Token,
                start=(0, 0), end=None) -> FetchStream:
    _, _, f = await within(s._request(
        lambda m: m.fetch(ns, name, start, end, parameters=P(*tokens)),
        lambda rid: FetchStream(s, rid)))
    return f


async def refused(aw) -> int:
    with pytest.raises(MoqtError) as e:
        await within(aw)
    return e.value.code


async def publisher_a(net: Net) -> tuple[MoqtSession, Catalog]:
    catalog = Catalog()
    pub = await net.client(tok(T_PUB), catalog=catalog)  # token in SETUP
    await publish_namespace(pub, A)
    return pub, catalog


# ------------------------------------------------------------------------------------------
async def test_unauthorized_requests_get_unauthorized(net: Net) -> None:
    relay = await net.start()
    pub, catalog = await publisher_a(net)
    catalog.create(A, "raw")
    anon = await net.client()
    U = RequestErrorCode.UNAUTHORIZED
    assert await refused(publish_namespace(anon, A)) == U
    assert await refused(anon.subscribe(A, "raw")) == U
    assert await refused(fetch(anon, A, b"raw")) == U
    assert await refused(subscribe_namespace(anon, ())) == U
    assert await refused(track_status(anon, A, b"raw")) == U
    # A reader may not publish; a publisher may not read.
    assert await refused(publish_namespace(anon, A, tok(T_SUBA))) == U
    assert await refused(anon.subscribe(A, "raw", parameters=P(tok(T_PUB)))) == U
    # An unknown token in a request adds nothing.
    assert await refused(anon.subscribe(A, "raw", parameters=P(tok("x" * 20)))) == U
    assert relay.stats.auth_refusals == 8
    assert relay.stats.upstream_subscribes == 0 and relay.stats.fetches == 0


async def test_refusal_does_not_reveal_existence(net: Net) -> None:
    await net.start()
    admin_cat = Catalog()
    admin = await net.client(tok(T_ADMIN), catalog=admin_cat)
    await publish_namespace(admin, B)
    admin_cat.create(B, "raw")
    reader = await net.client(tok(T_SUBA))
    missing = (b"kvsp-1", b"\xcc" * 4, SCOPE)
    for ns in (B, missing):  # B exists, `missing` does not: the same answer
        for aw in (reader.subscribe(ns, "raw"), fetch(reader, ns, b"raw"),
                   track_status(reader, ns, b"raw")):
            assert await refused(aw) == RequestErrorCode.UNAUTHORIZED
    # Inside its own prefix a reader learns existence normally.
    assert await refused(reader.subscribe(A + (b"r",), "raw")) == RequestErrorCode.DOES_NOT_EXIST


async def test_allowed_principal_publishes_subscribes_fetches(net: Net) -> None:
    relay = await net.start()
    pub, catalog = await publisher_a(net)
    track = catalog.create(A, "raw")
    reader = await net.client()  # no SETUP token: the token comes with each request
    sub = await within(reader.subscribe(A, "raw", parameters=P(tok(T_SUBA))))
    await within(track.subscribed.wait())
    for o in range(3):
        await within(track.write_object(0, o, b"layer-%d" % o))
    for o in range(3):
        obj = await within(sub.__anext__())
        assert (obj.object_id, bytes(obj.payload)) == (o, b"layer-%d" % o)
    status = await track_status(reader, A, b"raw", tok(T_SUBA))
    assert status.parameters.largest_object == (0, 2)
    f = await fetch(reader, A, b"raw", tok(T_SUBA), start=(0, 0), end=(0, 2))
    assert [bytes(o.payload) for o in await within(f.collect())] == [b"layer-0", b"layer-1",
                                                                    b"layer-2"]
    assert relay.stats.auth_refusals == 0


async def test_namespace_listing_only_shows_allowed_prefix(net: Net) -> None:
    await net.start()
    admin = await net.client(tok(T_ADMIN))
    await publish_namespace(admin, B + (b"block-1",))
    await publish_namespace(admin, A + (b"block-1",))
    watcher = await net.client(tok(T_SUBA))
    await subscribe_namespace(watcher, ())  # the empty prefix: everything it may see
    assert await within(watcher.namespace_updates.get()) == ("namespace", A + (b"block-1",))
    # New namespaces: B's first, then A's; only A's reaches the watcher (in order, so a
    # leaked B would be the next item).
    admin2 = await net.client(tok(T_ADMIN))
    await publish_namespace(admin2, B + (b"block-2",))
    await publish_namespace(admin2, A + (b"block-2",))
    assert await within(watcher.namespace_updates.get()) == ("namespace", A + (b"block-2",))
    await within(admin2.close())  # withdraws B/block-2 then A/block-2 (or the reverse)
    assert await within(watcher.namespace_updates.get()) == ("namespace_done", A + (b"block-2",))
    assert watcher.namespace_updates.empty()
    # A prefix disjoint from every grant is refused outright.
    assert await refused(subscribe_namespace(watcher, (b"kvsp-1", b"\xbb" * 4))) == \
        RequestErrorCode.UNAUTHORIZED
    # A narrower prefix inside the grant works and lists suffixes.
    await subscribe_namespace(watcher, A)
    got = {await within(watcher.namespace_updates.get()) for _ in range(1)}
    assert got == {("namespace", (b"block-1",))}


async def test_setup_token_vs_request_token(net: Net) -> None:
    await net.start()
    pub, catalog = await publisher_a(net)
    catalog.create(A, "raw")
    by_setup = await net.client(tok(T_SUBA))
    await within(by_setup.subscribe(A, "raw"))             # SETUP token covers requests
    by_request = await net.client()
    assert await refused(by_request.subscribe(A, "raw")) == RequestErrorCode.UNAUTHORIZED
    await within(by_request.subscribe(A, "raw", parameters=P(tok(T_SUBA))))
    # An unknown token in SETUP ends the session with UNAUTHORIZED (0x2).
    parsed = parse_moqt_url(net.relay.url)  # type: ignore[union-attr]
    bad = MoqtSession(Role.CLIENT, session_config=SessionConfig(
        path=parsed.path_and_query, authority=parsed.authority),
        setup_tokens=(tok("nobody-knows-this-token"),))
    await within(transport_connect(parsed, lambda: bad, client_config()))
    code, _reason = await within(bad.closed)
    assert code == SessionErrorCode.UNAUTHORIZED


async def test_token_aliases(net: Net) -> None:
    relay = await net.start()
    pub, catalog = await publisher_a(net)
    catalog.create(A, "raw")
    catalog.create(A, "other")
    s = await net.client()
    assert s.moqt.peer_setup.max_auth_token_cache_size == 4096  # advertised by the relay
    await within(s.subscribe(A, "raw", parameters=P(Token.register(7, 0, T_SUBA.encode()))))
    await within(s.subscribe(A, "other", parameters=P(Token.use_alias(7))))
    # DELETE then USE_ALIAS of the deleted alias: the session ends UNKNOWN_AUTH_TOKEN_ALIAS.
    assert await refused(s.subscribe(A, "x", parameters=P(Token.delete(7)))) == \
        RequestErrorCode.UNAUTHORIZED  # deleting is fine; the request itself has no rights
    with pytest.raises(MoqtError):
        await within(s.subscribe(A, "raw", parameters=P(Token.use_alias(7))))
    code, _ = await within(s.closed)
    assert code == SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS
    assert relay.stats.auth_refusals >= 1


async def test_open_relay_without_config_warns(net: Net, caplog) -> None:
    with caplog.at_level("WARNING", logger="relay"):
        await net.start(None)
    assert any("OPEN" in r.getMessage() for r in caplog.records)
    anon = await net.client()
    catalog = Catalog()
    pub = await net.client(catalog=catalog)
    await publish_namespace(pub, B)
    catalog.create(B, "raw")
    await within(anon.subscribe(B, "raw"))


# -- units --------------------------------------------------------------------------------
def test_namespace_text_form() -> None:
    assert parse_namespace("") == ()
    assert parse_namespace("kvsp-1/0x00ff/abc") == (b"kvsp-1", b"\x00\xff", b"abc")
    assert format_namespace((b"kvsp-1", b"\x00\xff", b"0xab", b"a/b")) == \
        "kvsp-1/0x00ff/0x30786162/0x612f62"
    for bad in ("a//b", "0x0", "0xzz", "/".join(["a"] * 33)):
        with pytest.raises(ValueError):
            parse_namespace(bad)


def test_config_errors_name_the_key() -> None:
    import tomllib
    cases = {
        '[[principals]]\nname="a"\ntoken="short"': "principals[0].token",
        '[[principals]]\nname="a"\ntoken="0123456789abcdefg"\npublish=["a//b"]':
            "principals[0].publish[0]",
        '[[principals]]\nname="a"\ntoken="0123456789abcdefg"\nwrite=[]': "principals[0].write",
        '[[principals]]\nname="a"\ntoken="0123456789abcdefg"\n'
        '[[principals]]\nname="b"\ntoken="0123456789abcdefg"': "shared",
        '[relay]\nauth_token_cache_size=-1': "relay.auth_token_cache_size",
        'extra=1': "extra",
    }
    for text, where in cases.items():
        with pytest.raises(AuthConfigError, match=__import__("re").escape(where)):
            parse_auth_config(tomllib.loads(text))


def test_authorizer_decisions() -> None:
    import tomllib
    auth = parse_auth_config(tomllib.loads(CONFIG)).authorizer
    assert isinstance(auth, Authorizer)
    reader = auth.principals_for([T_SUBA.encode()])
    assert [p.name for p in reader] == ["reader-a"]
    from relay.ops.auth import Action
    assert auth.allows(reader, Action.SUBSCRIBE, A + (b"k",))
    assert not auth.allows(reader, Action.SUBSCRIBE, B)
    assert not auth.allows(reader, Action.PUBLISH, A)
    assert auth.allows_prefix_watch(reader, ())          # overlaps A
    assert not auth.allows_prefix_watch(reader, B)
    assert auth.principals_for([b"unknown-token-xxxxx"]) == []


def test_token_cache_rules() -> None:
    c = TokenCache(max_size=16 + 5)
    assert c.resolve([Token.register(1, 0, b"abcde"), Token.use_alias(1)]) == [b"abcde"] * 2
    with pytest.raises(TokenError) as e:
        c.resolve([Token.register(1, 0, b"x")])
    assert e.value.code == SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS
    with pytest.raises(TokenError) as e:
        c.resolve([Token.register(2, 0, b"x")])
    assert e.value.code == SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW
    # In SETUP a REGISTER that does not fit is used as USE_VALUE.
    assert c.resolve([Token.register(2, 0, b"xyz")], in_setup=True) == [b"xyz"] and len(c) == 1
    c.resolve([Token.delete(1)])
    assert c.size == 0
    with pytest.raises(TokenError) as e:
        c.resolve([Token.use_alias(1)])
    assert e.value.code == SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS


async def test_bad_config_file_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "relay.toml"
    bad.write_text('[[principals]]\nname = "x"\ntoken = "short"\n')
    for path in (bad, tmp_path / "missing.toml"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--config", str(path),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _out, err = await within(proc.communicate())
        assert proc.returncode == 2
        # one line naming the file, not the usage first (issue 25)
        assert err.decode().startswith("python -m relay: error: ") and err.decode().count("\n") == 1
        assert f"config {path}: " in err.decode()
