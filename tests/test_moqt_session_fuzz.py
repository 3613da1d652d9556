"""Fuzzing the sans-IO session (DESIGN.md §7): any input sequence gives events, or closes
/ resets with the codes the draft names — never another exception."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt.data import SubgroupStreamEncoder
from kvsp_moq.moqt.errors import SessionErrorCode, StreamResetCode
from kvsp_moq.moqt.messages import (
    FetchOk,
    GoAway,
    PublishDone,
    RequestOk,
    Setup,
    Subscribe,
    SubscribeOk,
    encode_message,
)
from kvsp_moq.moqt.objects import SubgroupHeader, SubgroupIdMode
from kvsp_moq.moqt.session import Role, SessionConfig, SessionMachine, events as ev
from kvsp_moq.moqt.version import Version

V = Version.DRAFT_22
NS = (b"a", b"b")
_ENC = SubgroupStreamEncoder(SubgroupHeader(0, 1, 0, None, SubgroupIdMode.ZERO), V)

# Valid fragments, so that fuzzing reaches past the first byte.
FRAGMENTS = [
    encode_message(V, Setup(path="/")),
    encode_message(V, Subscribe(0, NS, b"t")),
    encode_message(V, Subscribe(2, NS, b"u")),
    encode_message(V, SubscribeOk(0)),
    encode_message(V, RequestOk()),
    encode_message(V, FetchOk(False, (0, 0))),
    encode_message(V, PublishDone(2, 1)),
    encode_message(V, GoAway()),
    _ENC.header() + _ENC.object(0, b"xyz"),
    b"\x05\x00", b"\x05\x01", b"\xaf\x00",
]

chunk = st.one_of(st.binary(max_size=40), st.sampled_from(FRAGMENTS),
                  st.tuples(st.sampled_from(FRAGMENTS), st.integers(0, 40)).map(
                      lambda t: t[0][: t[1]]))
op = st.one_of(
    st.tuples(st.just("data"), st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11]), chunk,
              st.booleans()),
    st.tuples(st.just("reset"), st.sampled_from([0, 2, 4, 6, 7, 11]), st.integers(0, 20)),
    st.tuples(st.just("stop"), st.sampled_from([0, 1, 3, 4, 7]), st.integers(0, 20)),
    st.tuples(st.just("dgram"), st.binary(max_size=30)),
)

SESSION_CODES = {int(c) for c in SessionErrorCode}
STREAM_CODES = {int(c) for c in StreamResetCode}


def _check(actions: list[ev.Action]) -> None:
    for a in actions:
        if isinstance(a, ev.CloseSession):
            assert a.error_code in SESSION_CODES
        elif isinstance(a, ev.ResetStream | ev.StopSending):
            assert a.error_code in STREAM_CODES


def _run(session: SessionMachine, ops: list[tuple]) -> None:
    for o in ops:
        if o[0] == "data":
            session.stream_data(o[1], o[2], o[3])
        elif o[0] == "reset":
            session.stream_reset(o[1], o[2])
        elif o[0] == "stop":
            session.stop_sending(o[1], o[2])
        else:
            session.datagram_received(o[1])
        _check(session.actions())
        session.events()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=12), st.booleans())
@example([("data", 0, FRAGMENTS[1], True), ("data", 0, b"x", False)], True)
@example([("data", 6, FRAGMENTS[8][:3], False), ("data", 6, b"", True)], True)
def test_server_session_fuzz(ops: list[tuple], set_up: bool) -> None:
    s = SessionMachine(Role.SERVER, V)
    s.start()
    if set_up:
        s.stream_data(2, encode_message(V, Setup(path="/")))
    s.actions()
    _run(s, ops)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=12))
def test_client_session_with_requests_fuzz(ops: list[tuple]) -> None:
    s = SessionMachine(Role.CLIENT, V)
    s.start()
    s.stream_data(3, encode_message(V, Setup()))
    s.subscribe(NS, b"t")          # request 0 on stream 0
    s.fetch(NS, b"t", (0, 0))      # request 2 on stream 4
    s.actions()
    s.events()
    _run(s, ops)


# Tight limits (issue 18): with a cap of 1 request, 1 tracked gap and a namespace field of
# exactly "." among the fragments, any input still gives events or the named errors
# (EXCESSIVE_LOAD, DOES_NOT_EXIST, INVALID_REQUEST_ID, ...), never another exception, and the
# session's structures stay within the limits.
_TIGHT_FRAGMENTS = FRAGMENTS + [
    encode_message(V, Subscribe(4, (b".",), b"t")),
    encode_message(V, Subscribe(6, (b".session",), b"")),
    encode_message(V, Subscribe(40, NS, b"far")),  # skips Request IDs
]
_tight_chunk = st.one_of(st.binary(max_size=20), st.sampled_from(_TIGHT_FRAGMENTS))
_tight_op = st.one_of(
    st.tuples(st.just("data"), st.sampled_from([0, 4, 8, 12, 16, 40, 2, 6, 10, 14]),
              _tight_chunk, st.booleans()),
    st.tuples(st.just("reset"), st.sampled_from([0, 4, 6, 10]), st.integers(0, 20)),
    st.tuples(st.just("stop"), st.sampled_from([1, 5]), st.integers(0, 20)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_tight_op, max_size=14))
def test_server_session_fuzz_tight_limits(ops: list[tuple]) -> None:
    s = SessionMachine(Role.SERVER, V, SessionConfig(max_concurrent_requests=1, max_id_gaps=1,
                                                    max_incomplete_requests=1,
                                                    max_pending_stream_bytes=64))
    s.start()
    s.stream_data(2, encode_message(V, Setup(path="/")))
    s.actions()
    _run(s, ops)
    sizes = s.state_sizes()
    assert sizes["requests"] <= 1 and sizes["partial_first"] <= 1
    assert sizes["peer_request_id_ranges"] <= 2
    assert sizes["closed_bidi_ranges"] <= 2 and sizes["closed_uni_ranges"] <= 2
