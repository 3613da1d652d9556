"""Holder-direct authorization (binding §9; DESIGN.md §4: "the publisher must be authorized for
the scope (field 3) of every namespace it publishes; subscribers and fetchers likewise").

A MoqtHolder serving MOQT itself checks the AUTHORIZATION_TOKENs of the session's SETUP and of
each request against the control plane's principals (``control.auth.Authorizer`` through
``control.moqt_auth.ControlScopeAuthorizer``): FETCH / SUBSCRIBE / TRACK_STATUS of a scope the
requester may not use get REQUEST_ERROR UNAUTHORIZED whether or not the block exists, and
SUBSCRIBE_NAMESPACE listings show only the scopes it may use. Real QUIC on 127.0.0.1, no
sleeps.

The pubsub API takes request parameters only on ``subscribe``, so FETCH and TRACK_STATUS with
a request token go through ``MoqtSession._request`` (as tests/test_relay_auth.py does).
"""

from __future__ import annotations

import tomllib

import pytest

from bridge_support import (
    HolderNode,
    client_config,
    make_layers,
    server_config,
    within,
)
from kvsp_moq.bridge import MoqtHolder, MoqtPool, load_block, load_by_namespace, sink_for_record
from kvsp_moq.bridge.holder import ScopeGate
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.moqt_auth import ControlScopeAuthorizer
from kvsp_moq.kvsp.naming import NAMESPACE_TAG, BlockName, scope_prefix
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import MessageParameters, Token
from kvsp_moq.pubsub import FetchStream, MoqtError, MoqtSession, connect
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from relay import Relay, RelayConfig
from relay.ops.auth import parse_auth_config
from relay.ops.names import format_namespace

torch = pytest.importorskip("torch")

U = RequestErrorCode.UNAUTHORIZED
COMPAT = b"\x11" * 32
S_LOW = b"\x01" * 16
S_A = b"\x55" * 16
S_B = b"\x99" * 16
#: Open to requests without a token; sorts after every other scope, so its block is the last
#: NAMESPACE of a listing of the compat (the end marker of the listing tests).
S_PUBLIC = b"\xff" * 16
T_A = "reader-a-token-0123456789"
T_B = "reader-b-token-0123456789"
T_UNKNOWN = "unknown-token-0123456789"


def key(scope: bytes, n: int) -> RecordKey:
    return RecordKey(COMPAT, scope, bytes([n]) * 32)


K_LOW, K_A, K_A2, K_B, K_PUBLIC = (key(S_LOW, 1), key(S_A, 2), key(S_A, 3), key(S_B, 4),
                                   key(S_PUBLIC, 5))
#: A block of scope A that no holder has.
MISSING_A = BlockName(COMPAT, S_A, b"\x77" * 32, b"\x88" * 16)


def authorizer() -> ControlScopeAuthorizer:
    return ControlScopeAuthorizer(Authorizer.from_tokens({
        T_A: Principal("reader-a", scopes=Grant(frozenset({S_A}))),
        T_B: Principal("reader-b", scopes=Grant(frozenset({S_B, S_LOW}))),
    }), anonymous_scopes=[S_PUBLIC])


def tok(value: str) -> Token:
    return Token.use_value(0, value.encode())


def P(*tokens: Token) -> MessageParameters:
    return MessageParameters(authorization_tokens=tokens)


class AuthHolder(HolderNode):
    async def start(self, ttl_ms: int = 600_000) -> AuthHolder:  # type: ignore[override]
        self.store = BlockStore([HostTier(256 << 20)])
        self.holder = MoqtHolder(self.store, ttl_ms=ttl_ms, authorizer=authorizer())
        self.url = await self.holder.serve("127.0.0.1", 0, server_config())
        return self


@pytest.fixture
async def holder():
    node = await AuthHolder().start()
    layers = make_layers(4)
    for k in (K_LOW, K_A, K_A2, K_B, K_PUBLIC):
        node.put(k, layers)
    node.layers = layers
    try:
        yield node
    finally:
        await node.close()


def name_of(node: HolderNode, k: RecordKey) -> BlockName:
    return k.block_name(node.store.info(k).replica_id)


async def client(node: HolderNode, *setup_tokens: str) -> MoqtSession:
    return await within(connect(node.url, client_config(), setup_tokens=setup_tokens))


async def fetch(s: MoqtSession, name: BlockName, *tokens: Token) -> FetchStream:
    _, _, f = await within(s._request(
        lambda m: m.fetch(name.namespace_fields(), b"raw", (0, 0), None, parameters=P(*tokens)),
        lambda rid: FetchStream(s, rid)))
    return f


async def track_status(s: MoqtSession, name: BlockName, *tokens: Token):
    return (await within(s._request(
        lambda m: m.track_status(name.namespace_fields(), b"raw", P(*tokens)))))[1]


async def subscribe(s: MoqtSession, name: BlockName, *tokens: Token):
    return await within(s.subscribe(name.namespace_fields(), "raw", parameters=P(*tokens)))


async def refusal(aw) -> tuple[int, str]:
    with pytest.raises(MoqtError) as e:
        await within(aw)
    return e.value.code, e.value.reason


async def listing(s: MoqtSession, prefix: tuple[bytes, ...], *tokens: Token) -> list[tuple[bytes, ...]]:
    """The NAMESPACE suffixes of a SUBSCRIBE_NAMESPACE on ``prefix``, up to and including the
    public block (the holder lists its namespaces in ascending order on one request stream,
    so nothing that sorts before the public block can still be on its way)."""
    await within(s._request(lambda m: m.subscribe_namespace(prefix, P(*tokens))))
    out: list[tuple[bytes, ...]] = []
    while True:
        kind, suffix = await within(s.namespace_updates.get())
        assert kind == "namespace"
        out.append(suffix)
        if (prefix + suffix)[2] == S_PUBLIC:
            return out


# ------------------------------------------------------------------------------------------
async def test_no_token_and_wrong_scope_are_unauthorized_whether_or_not_the_block_exists(
        holder: HolderNode) -> None:
    existing = name_of(holder, K_A)
    anon = await client(holder)
    wrong = await client(holder, T_B)  # SETUP token of a principal of scopes B and LOW
    unknown = await client(holder, T_UNKNOWN)  # a token nobody has: no rights
    try:
        for s, tokens in ((anon, ()), (wrong, ()), (unknown, ()), (anon, (tok(T_B),)),
                          (anon, (tok(T_UNKNOWN),))):
            answers = set()
            for name in (existing, MISSING_A):
                answers.add(await refusal(fetch(s, name, *tokens)))
                answers.add(await refusal(subscribe(s, name, *tokens)))
                answers.add(await refusal(track_status(s, name, *tokens)))
            # One answer for all: UNAUTHORIZED, with nothing that tells the two names apart.
            assert answers == {(U, "not authorized")}
        # A name that is no block at all gets the same answer.
        assert await refusal(anon.subscribe((b"kvsp-1", b"x"), "raw")) == (U, "not authorized")
        # The wrong principal's own scope is served on the same session.
        f = await fetch(wrong, name_of(holder, K_B))
        assert [o.object_id for o in await within(f.collect())] == [0, 1, 2, 3]
        # And the public scope needs no token.
        await track_status(anon, name_of(holder, K_PUBLIC))
    finally:
        for s in (anon, wrong, unknown):
            await within(s.close())


async def test_right_token_loads_the_block(holder: HolderNode) -> None:
    layers = holder.layers
    record = holder.holder.replica_record(K_A)
    # SETUP token (MoqtPool): the load succeeds, bit for bit, into torch CPU tensors.
    async with MoqtPool(client_config(), setup_tokens=[T_A]) as pool:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        result = await within(load_block(record, sink, pool=pool))
        assert result.complete and result.verified == (0, 1, 2, 3)
        for layer in range(4):
            k, v = sink.layer(layer)
            octets = (k.contiguous().view(torch.uint8).numpy().tobytes()
                      + v.contiguous().view(torch.uint8).numpy().tobytes())
            assert octets == holder.payload(K_A, layer)
        # By namespace alone (TRACK_STATUS, then FETCH) too.
        sink2, res2 = await within(load_by_namespace(holder.url, name_of(holder, K_A),
                                                     layers.geometry, pool=pool,
                                                     backend="numpy"))
        assert res2.complete
        # Authorized, the requester may learn that a block does not exist.
        session = await pool.get(holder.url)
        assert (await refusal(fetch(session, MISSING_A)))[0] == RequestErrorCode.DOES_NOT_EXIST

    # Without the token the same load is a miss: UNAUTHORIZED, every layer to recompute.
    async with MoqtPool(client_config()) as pool:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
        result = await within(load_block(record, sink, pool=pool))
        assert result.recompute == (0, 1, 2, 3)
        assert f"{int(U):#x}" in result.attempts[0].error

    # A request token instead of a SETUP token works as well.
    anon = await client(holder)
    try:
        sub = await subscribe(anon, name_of(holder, K_A), tok(T_A))
        assert sub.response.track_properties  # SUBSCRIBE_OK with the Track Properties
        f = await fetch(anon, name_of(holder, K_A), tok(T_A))
        assert len(await within(f.collect())) == 4
        await track_status(anon, name_of(holder, K_A), tok(T_A))
    finally:
        await within(anon.close())


async def test_listings_show_only_the_scopes_of_the_principal(holder: HolderNode) -> None:
    def suffixes(*keys: RecordKey) -> list[tuple[bytes, ...]]:
        return [(k.scope_id, k.block_key, holder.store.info(k).replica_id) for k in keys]

    a = await client(holder, T_A)
    b = await client(holder, T_B)
    anon = await client(holder)
    try:
        compat = (NAMESPACE_TAG, COMPAT)
        assert await listing(a, compat) == suffixes(K_A, K_A2, K_PUBLIC)
        assert await listing(b, compat) == suffixes(K_LOW, K_B, K_PUBLIC)
        assert await listing(anon, compat) == suffixes(K_PUBLIC)
        # A request token widens the listing of its request only.
        assert await listing(anon, compat, tok(T_A)) == suffixes(K_A, K_A2, K_PUBLIC)
        # A prefix that names a scope needs that scope.
        assert await refusal(within(anon._request(
            lambda m: m.subscribe_namespace(scope_prefix(COMPAT, S_A), P())))) == (
                U, "not authorized")
        assert await refusal(within(b._request(
            lambda m: m.subscribe_namespace(scope_prefix(COMPAT, S_A), P())))) == (
                U, "not authorized")
        await within(a.subscribe_namespace(scope_prefix(COMPAT, S_A)))
        got = {await within(a.namespace_updates.get()) for _ in range(2)}
        assert got == {("namespace", s[1:]) for s in suffixes(K_A, K_A2)}
    finally:
        for s in (a, b, anon):
            await within(s.close())


def test_scope_gate_refuses_names_that_are_not_blocks() -> None:
    gate = ScopeGate(authorizer())

    class _S:
        peer_setup_tokens = (T_A.encode(),)

    from kvsp_moq.moqt.messages import Subscribe
    ok = Subscribe(1, MISSING_A.namespace_fields(), b"raw", MessageParameters())
    other = Subscribe(1, (NAMESPACE_TAG, COMPAT, S_A), b"raw", MessageParameters())
    assert gate.allows(_S(), ok)  # type: ignore[arg-type]
    assert not gate.allows(_S(), other)  # type: ignore[arg-type]


async def test_holder_publishes_through_an_authorizing_relay_with_its_setup_token() -> None:
    """attach_relay(setup_tokens=...): the relay (relay/ops/auth.py) accepts the holder's
    PUBLISH_NAMESPACE only with a token allowed to publish the scope, and serves readers of
    that scope only."""
    prefix = format_namespace((NAMESPACE_TAG, COMPAT, S_A))
    auth = parse_auth_config(tomllib.loads(f"""
[[principals]]
name = "holder"
token = "holder-token-0123456789"
publish = ["{prefix}"]

[[principals]]
name = "reader"
token = "{T_A}"
subscribe = ["{prefix}"]
"""))
    relay = await Relay(RelayConfig(server_transport=server_config(),
                                    upstream_transport=client_config(), auth=auth)).start()
    node = await HolderNode().start()
    try:
        layers = make_layers(4)
        node.put(K_A, layers)
        await within(node.holder.attach_relay(relay.url, client_config(),
                                              setup_tokens=["holder-token-0123456789"]))
        await within(node.holder.wait_announced())
        record = node.holder.replica_record(K_A)
        assert record.holder == relay.url
        async with MoqtPool(client_config(), setup_tokens=[T_A]) as pool:
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            assert (await within(load_block(record, sink, pool=pool))).complete
        async with MoqtPool(client_config()) as pool:
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            result = await within(load_block(record, sink, pool=pool))
            assert result.recompute == (0, 1, 2, 3) and "0x1" in result.attempts[0].error
    finally:
        await node.close()
        await within(relay.close())
