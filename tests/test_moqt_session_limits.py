"""Hostile peers against the sans-IO session's limits (issue 18): every limit gives the error
the draft names, never an exception, and the state it lets a peer build is bounded.

* ``max_concurrent_requests`` — REQUEST_ERROR EXCESSIVE_LOAD with a Retry Interval
  (draft-ietf-moq-transport-22 §"Subscription Amplification", §"REQUEST_ERROR"); request
  streams whose first message never completes are reset with EXCESSIVE_LOAD.
* ``max_id_gaps`` — the range sets of the peer's Request IDs and streams stay bounded when a
  peer skips IDs; a reused Request ID is INVALID_REQUEST_ID (§"Request ID"), however old.
* Reserved namespaces — a first field of exactly ``.``, or ``.session``, is answered
  REQUEST_ERROR DOES_NOT_EXIST by the session and never reaches the application
  (§"Reserved Namespaces", §"Session-Level Tracks and Namespaces").
"""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode, StreamResetCode
from kvsp_moq.moqt.messages import (
    Location,
    MessageParameters,
    PublishNamespace,
    PublishOk,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    TrackStatus,
    encode_message,
)
from kvsp_moq.moqt.reserved import (
    is_reserved_namespace,
    is_session_level_namespace,
    rejected_namespace,
)
from kvsp_moq.moqt.session import Role, SessionConfig, SessionMachine
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.version import Version
from kvsp_moq.wire.errors import WireError

V = Version.DRAFT_22
NS = (b"kvsp-1", b"scope")
CLIENT_CONTROL = 2  # the client's first unidirectional stream


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def server(**cfg: object) -> SessionMachine:
    """A server session after the (hostile) client's SETUP; raw bytes are fed to it."""
    s = SessionMachine(Role.SERVER, V, SessionConfig(**cfg))  # type: ignore[arg-type]
    s.start()
    s.stream_data(CLIENT_CONTROL, encode_message(V, Setup(path="/")))
    s.actions()
    assert [type(e) for e in s.events()] == [ev.SetupComplete]
    return s


def bidi(n: int) -> int:
    """The client's n-th bidirectional stream."""
    return 4 * n


def errors_sent(actions: list[ev.Action]) -> list[tuple[int, RequestError]]:
    """(stream, REQUEST_ERROR) for each REQUEST_ERROR the session wrote."""
    out = []
    for a in actions:
        if isinstance(a, ev.SendStream) and a.data[:1] == b"\x05":
            from kvsp_moq.moqt.messages import decode_message

            got = decode_message(V, a.data)
            assert got is not None
            assert isinstance(got[0], RequestError)
            out.append((a.stream_id, got[0]))
    return out


# ==========================================================================================
# max_concurrent_requests
def test_request_flood_gets_excessive_load_and_state_stays_bounded() -> None:
    s = server(max_concurrent_requests=8)
    flood = 50_000
    before = rss_kib()
    refused = 0
    for n in range(flood):
        s.stream_data(bidi(n), encode_message(V, Subscribe(2 * n, NS, b"t%d" % n)))
        for _, err in errors_sent(s.actions()):
            assert err.code is RequestErrorCode.EXCESSIVE_LOAD
            assert err.retry_interval == 1000 + 1  # excessive_load_retry_ms, on the wire +1
            refused += 1
    grew = rss_kib() - before
    received = [e for e in s.events() if isinstance(e, ev.RequestReceived)]
    # The application saw the first 8 only; the session answered the rest itself.
    assert [e.request_id for e in received] == [2 * n for n in range(8)]
    assert refused == flood - 8 and not s.closed
    sizes = s.state_sizes()
    assert sizes["requests"] == 8 and sizes["peer_request_id_ranges"] == 1
    assert sizes["closed_bidi_ranges"] == 1
    # Bound: 8 live requests and a few ranges; 4 MiB is allocator noise (the old sets held
    # ~150 bytes per refused request: ~7 MiB here).
    assert grew < 4 * 1024, f"RSS grew {grew} KiB for {flood} refused requests"
    # One finishes: the next request is served again.
    s.reject(0, RequestErrorCode.DOES_NOT_EXIST)
    s.actions()
    s.stream_data(bidi(flood), encode_message(V, Subscribe(2 * flood, NS, b"again")))
    assert errors_sent(s.actions()) == []
    assert [e.request_id for e in s.events() if isinstance(e, ev.RequestReceived)] == [2 * flood]


def test_refused_request_late_bytes_are_ignored() -> None:
    s = server(max_concurrent_requests=1)
    s.stream_data(bidi(0), encode_message(V, Subscribe(0, NS, b"a")))
    s.stream_data(bidi(1), encode_message(V, Subscribe(2, NS, b"b")))
    [(sid, err)] = errors_sent(s.actions())
    assert sid == bidi(1) and err.code is RequestErrorCode.EXCESSIVE_LOAD
    s.stream_data(bidi(1), b"\x00garbage after the refusal", True)
    assert not s.closed and s.actions() == []


def test_incomplete_first_messages_are_capped() -> None:
    s = server(max_incomplete_requests=4)
    head = encode_message(V, Subscribe(0, NS, b"t"))[:5]  # never completes
    for n in range(1000):
        s.stream_data(bidi(n), head)
    actions = s.actions()
    resets = [a for a in actions if isinstance(a, ev.ResetStream)]
    stops = [a for a in actions if isinstance(a, ev.StopSending)]
    assert len(resets) == len(stops) == 996
    assert {a.error_code for a in resets + stops} == {StreamResetCode.EXCESSIVE_LOAD}
    assert s.state_sizes()["partial_first"] == 4 and not s.closed
    s.stream_data(bidi(999), b"more")  # a refused stream's later bytes: ignored
    assert s.actions() == [] and not s.closed


def test_no_cap_when_none() -> None:
    s = server(max_concurrent_requests=None)
    for n in range(2000):
        s.stream_data(bidi(n), encode_message(V, TrackStatus(2 * n, NS, b"t")))
    assert errors_sent(s.actions()) == []
    assert s.state_sizes()["requests"] == 2000


# ==========================================================================================
# Request IDs and streams: range sets with bounded gaps
def test_reused_request_id_is_invalid_however_old() -> None:
    s = server()
    for n in range(3000):
        s.stream_data(bidi(n), encode_message(V, TrackStatus(2 * n, NS, b"t")), True)
        s.request_ok(2 * n, end=True)
    s.actions()
    assert s.state_sizes()["peer_request_id_ranges"] == 1
    assert s.state_sizes()["requests"] == 0
    s.stream_data(bidi(3000), encode_message(V, TrackStatus(2 * 17, NS, b"t")))
    assert s.close_code == SessionErrorCode.INVALID_REQUEST_ID


def test_skipped_request_ids_and_streams_are_bounded() -> None:
    gaps = 16
    s = server(max_id_gaps=gaps, max_concurrent_requests=None)
    # A hostile client skips every other Request ID and every other stream.
    for n in range(5000):
        s.stream_data(bidi(2 * n), encode_message(V, TrackStatus(4 * n, NS, b"t")))
        s.request_ok(4 * n, end=True)
        s.stream_data(bidi(2 * n), b"", True)
    s.actions()
    sizes = s.state_sizes()
    assert sizes["peer_request_id_ranges"] <= gaps + 1
    assert sizes["closed_bidi_ranges"] <= gaps + 1
    assert sizes["requests"] == 0 and not s.closed
    s.events()
    # Stream 1, a skipped stream below the tracked gaps, counts as closed: ignored.
    s.stream_data(bidi(1), encode_message(V, TrackStatus(4 * 5000, NS, b"t")))
    assert s.actions() == [] and s.events() == [] and not s.closed
    # Request ID 2, a skipped ID below the tracked gaps, counts as used: INVALID_REQUEST_ID.
    s.stream_data(bidi(2 * 5000), encode_message(V, TrackStatus(2, NS, b"t")))
    assert s.close_code == SessionErrorCode.INVALID_REQUEST_ID


def test_skipped_unidirectional_streams_are_bounded() -> None:
    gaps = 8
    s = server(max_id_gaps=gaps)
    padding = b"\xf0\x13\x2b\x3e\x28" + b"\x00" * 4  # a padding stream (§"Padding Streams")
    for n in range(1, 3000):
        s.stream_data(CLIENT_CONTROL + 8 * n, padding, True)  # skips every other uni stream
    assert s.state_sizes()["closed_uni_ranges"] <= gaps + 1 and not s.closed


def test_late_fetch_stream_after_release_is_cancelled() -> None:
    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/"))
    c.start()
    c.stream_data(3, encode_message(V, Setup()))
    rid = c.fetch(NS, b"t", (0, 0))
    c.actions()
    c.cancel(rid)
    c.actions()
    enc = FetchStreamEncoder(rid, V)
    late = enc.header() + enc.object(0, 0, b"late", subgroup_id=0, publisher_priority=1)
    c.stream_data(7, late)
    assert c.actions() == [ev.StopSending(7, StreamResetCode.CANCELLED)]
    c.stream_data(11, FetchStreamEncoder(rid + 2, V).header())  # never used: a violation
    assert c.close_code == SessionErrorCode.PROTOCOL_VIOLATION


# ==========================================================================================
# reserved namespaces
def test_reserved_namespace_helpers() -> None:
    assert is_reserved_namespace((b".",)) and is_reserved_namespace((b".session", b"x"))
    assert is_reserved_namespace((b".future",))
    assert not is_reserved_namespace(()) and not is_reserved_namespace((b"a", b"."))
    assert is_session_level_namespace((b".session",))
    assert not is_session_level_namespace((b".sessions",))
    assert rejected_namespace((b".",)) and rejected_namespace((b".session", b"t"))
    assert not rejected_namespace((b".future",)) and not rejected_namespace(NS)
    assert not rejected_namespace(()) and not rejected_namespace((b"..",))


@pytest.mark.parametrize("request_msg", [
    Subscribe(0, (b".",), b"t"),
    Subscribe(0, (b".", b"more"), b""),
    Subscribe(0, (b".session",), b""),  # "The empty track name in .session ... not exist"
    Subscribe(0, (b".session", b"x"), b"t"),  # no session-level track is recognized here
    TrackStatus(0, (b".",), b"t"),
    SubscribeNamespace(0, (b".",)),
    SubscribeNamespace(0, (b".session",)),
    PublishNamespace(0, (b".session",)),
])
def test_reserved_namespace_requests_get_does_not_exist(request_msg: object) -> None:
    s = server()
    s.stream_data(bidi(0), encode_message(V, request_msg))  # type: ignore[arg-type]
    [(sid, err)] = errors_sent(s.actions())
    assert sid == bidi(0) and err.code is RequestErrorCode.DOES_NOT_EXIST
    assert not [e for e in s.events() if isinstance(e, ev.RequestReceived)]
    assert not s.closed and s.state_sizes()["requests"] == 0


def test_unrecognized_reserved_namespace_reaches_the_application() -> None:
    # "an endpoint that receives a request for an unrecognized reserved namespace MUST pass
    # it to the Application".
    s = server()
    s.stream_data(bidi(0), encode_message(V, Subscribe(0, (b".future",), b"t")))
    assert errors_sent(s.actions()) == []
    assert [type(e) for e in s.events()] == [ev.RequestReceived]


def test_we_do_not_publish_under_reserved_namespaces() -> None:
    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/"))
    c.start()
    for bad in ((b".",), (b".session", b"x")):
        with pytest.raises(ValueError):
            c.publish_namespace(bad)
        with pytest.raises(ValueError):
            c.publish(bad, b"t", track_alias=1)
    # No Request ID was consumed by the refused calls; requesting one is allowed (the peer
    # answers DOES_NOT_EXIST).
    assert c.subscribe((b".",), b"t") == 0


# ==========================================================================================
# leniency where the draft names no close (docs/interop.md "Leniency")
def _publisher(version: Version) -> tuple[SessionMachine, int]:
    c = SessionMachine(Role.CLIENT, version, SessionConfig(path="/"))
    c.start()
    c.stream_data(3, encode_message(version, Setup()))
    rid = c.publish(NS, b"t", track_alias=1)
    c.actions()
    c.events()
    return c, rid


def test_draft18_publish_ok_0x1e_is_accepted() -> None:
    # Draft 18 §"Control Messages" table: "0x1E | PUBLISH_OK ({{message-request-ok}})".
    c, rid = _publisher(Version.DRAFT_18)
    c.stream_data(0, encode_message(Version.DRAFT_18, PublishOk()))
    [resp] = [e for e in c.events() if isinstance(e, ev.ResponseReceived)]
    assert isinstance(resp.message, RequestOk) and resp.request_id == rid and not c.closed
    # Only as the answer to the PUBLISH: a second one is a violation.
    c.stream_data(0, encode_message(Version.DRAFT_18, PublishOk()))
    assert c.close_code == SessionErrorCode.PROTOCOL_VIOLATION


@pytest.mark.parametrize("version", [Version.DRAFT_20, Version.DRAFT_22])
def test_0x1e_is_unknown_after_draft_18(version: Version) -> None:
    c, _ = _publisher(version)  # 20+: "0x1E | RESERVED (PUBLISH_OK in <= 17)"
    c.stream_data(0, bytes.fromhex("1e000100"))
    assert c.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_known_parameter_not_listed_is_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    # FORWARD in SUBSCRIBE_NAMESPACE, as another stack sent it (issue 18): the draft lists
    # FORWARD for SUBSCRIBE, REQUEST_UPDATE, PUBLISH, SUBSCRIBE_TRACKS and PUBLISH_STATE_NOTIFY
    # and names no close for it elsewhere; it is ignored, logged, and the request served.
    s = server()
    body = bytes.fromhex("00 01 06 6b7673702d31 01 10 01".replace(" ", ""))
    with caplog.at_level("INFO", logger="kvsp_moq.moqt.messages.params"):
        s.stream_data(bidi(0), bytes([0x50, 0, len(body)]) + body)
    [req] = [e for e in s.events() if isinstance(e, ev.RequestReceived)]
    assert isinstance(req.message, SubscribeNamespace)
    assert req.message.parameters == MessageParameters() and not s.closed
    assert any("FORWARD" in r.getMessage() for r in caplog.records)


def test_session_level_checks_drop_unlisted_parameters() -> None:
    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/"))
    c.start()
    c.stream_data(3, encode_message(V, Setup()))
    rid = c.track_status(NS, b"t")
    c.actions()
    # REQUEST_OK answering TRACK_STATUS with EXPIRES (listed for other REQUEST_OKs only).
    ok = RequestOk(MessageParameters(expires=5, largest_object=Location(1, 0)))
    c.stream_data(0, encode_message(V, ok))
    [resp] = [e for e in c.events() if isinstance(e, ev.ResponseReceived)]
    assert resp.request_id == rid and not c.closed
    assert isinstance(resp.message, RequestOk)
    assert resp.message.parameters == MessageParameters(largest_object=Location(1, 0))
    # Our own REQUEST_UPDATE with a parameter its request does not list: refused locally.
    fid = c.fetch(NS, b"t", (0, 0))
    with pytest.raises(WireError):
        c.request_update(fid, MessageParameters(forward=True))


def test_peer_update_with_unlisted_parameter_is_ignored() -> None:
    s = server()
    s.stream_data(bidi(0), encode_message(V, Subscribe(0, NS, b"t")))
    s.events()
    # REQUEST_UPDATE of a subscription carrying TRACK_NAMESPACE_PREFIX (listed only for the
    # namespace requests' updates): the update is delivered without it.
    upd = RequestUpdate(2, MessageParameters(subscriber_priority=9,
                                             track_namespace_prefix=(b"x",)))
    s.stream_data(bidi(0), encode_message(V, upd))
    [got] = [e for e in s.events() if isinstance(e, ev.UpdateReceived)]
    assert got.message == RequestUpdate(2, MessageParameters(subscriber_priority=9))
    assert not s.closed


def test_streams_held_for_unknown_aliases_are_capped() -> None:
    # Subgroup streams for a Track Alias not known yet are held ("MAY buffer"), each up to
    # max_pending_stream_bytes; at most max_pending_streams of them at once.
    from kvsp_moq.moqt.data import SubgroupStreamEncoder
    from kvsp_moq.moqt.objects import SubgroupHeader, SubgroupIdMode

    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/", max_pending_streams=4))
    c.start()
    c.stream_data(3, encode_message(V, Setup()))
    c.actions()
    before = rss_kib()
    for n in range(1, 2001):
        header = SubgroupHeader(1000 + n, 0, 0, None, SubgroupIdMode.ZERO)
        enc = SubgroupStreamEncoder(header, V)
        c.stream_data(3 + 4 * n, enc.header() + enc.object_header(0, 1 << 16) + b"x" * 60_000)
    stops = [a for a in c.actions() if isinstance(a, ev.StopSending)]
    assert len(stops) == 2000 - 4
    assert {a.error_code for a in stops} == {StreamResetCode.EXCESSIVE_LOAD}
    assert c.state_sizes()["uni_streams"] == 4 + 1 and not c.closed  # + the control stream
    assert c.state_sizes()["pending_streams"] == 4
    # 4 streams x 60 KB held; without the cap 2,000 x 60 KB = 120 MB would be.
    assert rss_kib() - before < 16 * 1024
    # SUBSCRIBE_OK for one of them releases it (and its bytes leave the budget).
    rid = c.subscribe(NS, b"t")
    c.actions()
    c.stream_data(0, encode_message(V, SubscribeOk(1001)))
    assert c.state_sizes()["pending_streams"] == 3
    assert any(isinstance(e, ev.DataEvent) and e.request_id == rid for e in c.events())


def test_bytes_held_for_unknown_aliases_are_capped_in_total() -> None:
    from kvsp_moq.moqt.data import SubgroupStreamEncoder
    from kvsp_moq.moqt.objects import SubgroupHeader, SubgroupIdMode

    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/", max_pending_total_bytes=200_000))
    c.start()
    c.stream_data(3, encode_message(V, Setup()))
    c.actions()
    for n in range(1, 11):
        enc = SubgroupStreamEncoder(SubgroupHeader(n, 0, 0, None, SubgroupIdMode.ZERO), V)
        c.stream_data(3 + 4 * n, enc.header() + enc.object_header(0, 1 << 16) + b"x" * 60_000)
    stops = [a for a in c.actions() if isinstance(a, ev.StopSending)]
    # 3 x ~60 KB fit in 200,000 bytes; every later stream overflows it and is stopped.
    assert [a.stream_id for a in stops] == [3 + 4 * n for n in range(4, 11)]
    assert {a.error_code for a in stops} == {StreamResetCode.EXCESSIVE_LOAD}
    assert c.state_sizes()["pending_streams"] == 3 and not c.closed


def test_unreleased_finished_subscriptions_are_bounded() -> None:
    # An application that never calls release(): the session keeps the data routing of at
    # most max_id_gaps finished subscriptions, oldest dropped first.
    c = SessionMachine(Role.CLIENT, V, SessionConfig(path="/", max_id_gaps=8))
    c.start()
    c.stream_data(3, encode_message(V, Setup()))
    c.actions()
    from kvsp_moq.moqt.messages import PublishDone

    for n in range(100):
        rid = c.subscribe(NS, b"t%d" % n)
        c.stream_data(4 * n, encode_message(V, SubscribeOk(n))
                      + encode_message(V, PublishDone(2, 0)), True)
    c.actions()
    c.events()
    assert c.state_sizes()["finished_local"] == 8 and c.state_sizes()["requests"] == 0
    assert c.state_sizes()["aliases_in"] == 8 and not c.closed
    assert rid == 2 * 99
