"""Sans-IO tests of kvsp_moq.moqt.session: two SessionMachine objects wired to each other in memory.

Pure state-machine testing (no transport): the actions one session queues are delivered to
the other as the transport would (SendStream → stream_data, ResetStream → stream_reset,
StopSending → stop_sending, SendDatagram → datagram_received).
"""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.data import SubgroupStreamEncoder, encode_subgroup_header
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode, SessionErrorCode, StreamResetCode
from kvsp_moq.moqt.messages import (
    FetchOk,
    GoAway,
    MessageParameters,
    PublishDone,
    RequestError,
    RequestOk,
    RequestUpdate,
    Setup,
    StandaloneFetch,
    Subscribe,
    SubscribeOk,
    encode_message,
)
from kvsp_moq.moqt.objects import (
    FetchHeader,
    ObjectBegin,
    ObjectDatagram,
    ObjectEnd,
    ObjectPayload,
    SubgroupHeader,
    SubgroupIdMode,
)
from kvsp_moq.moqt.session import Role, SessionConfig, SessionMachine, SessionState, events as ev
from kvsp_moq.moqt.version import Version

VERSIONS = [Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_21, Version.DRAFT_22]
NS = (b"kvsp-1", b"scope")
SERVER_UNI0 = 3  # first server-initiated unidirectional stream (its control stream)
CLIENT_UNI0 = 2


class Wire:
    """Two sessions and the in-memory 'network' between them."""

    def __init__(self, version: Version = Version.DRAFT_22, *,
                 client_cfg: SessionConfig | None = None,
                 server_cfg: SessionConfig | None = None) -> None:
        self.client = SessionMachine(Role.CLIENT, version,
                              client_cfg or SessionConfig(path="/moq", authority="h:1"))
        self.server = SessionMachine(Role.SERVER, version, server_cfg)
        self.events: dict[SessionMachine, list[ev.Event]] = {self.client: [], self.server: []}
        self.closes: dict[SessionMachine, list[ev.CloseSession]] = {self.client: [], self.server: []}

    def peer(self, s: SessionMachine) -> SessionMachine:
        return self.server if s is self.client else self.client

    def start(self) -> Wire:
        self.client.start()
        self.server.start()
        self.flush()
        return self

    def flush(self) -> None:
        moved = True
        while moved:
            moved = False
            for s in (self.client, self.server):
                self.events[s].extend(s.events())
                for a in s.actions():
                    moved = True
                    self.deliver(s, a)
            for s in (self.client, self.server):
                self.events[s].extend(s.events())

    def deliver(self, src: SessionMachine, a: ev.Action) -> None:
        dst = self.peer(src)
        if isinstance(a, ev.SendStream):
            dst.stream_data(a.stream_id, a.data, a.end_stream)
        elif isinstance(a, ev.ResetStream):
            dst.stream_reset(a.stream_id, a.error_code)
        elif isinstance(a, ev.StopSending):
            dst.stop_sending(a.stream_id, a.error_code)
        elif isinstance(a, ev.SendDatagram):
            dst.datagram_received(a.data)
        elif isinstance(a, ev.CloseSession):
            self.closes[src].append(a)
            dst.connection_lost(a.error_code, a.reason)

    def take(self, s: SessionMachine, kind: type) -> list:
        out = [e for e in self.events[s] if isinstance(e, kind)]
        self.events[s] = [e for e in self.events[s] if not isinstance(e, kind)]
        return out


def close_code(s: SessionMachine) -> int | None:
    return s.close_code if s.closed else None


# ==========================================================================================
# SETUP


@pytest.mark.parametrize("version", VERSIONS)
def test_setup_exchange(version: Version) -> None:
    w = Wire(version).start()
    [c] = w.take(w.client, ev.SetupComplete)
    [s] = w.take(w.server, ev.SetupComplete)
    assert s.peer_setup.path == "/moq" and s.peer_setup.authority == "h:1"
    assert c.peer_setup.path is None and c.peer_setup.moqt_implementation == "kvsp-moq"
    assert w.client.state is SessionState.ESTABLISHED
    assert w.server.state is SessionState.ESTABLISHED


def test_setup_unknown_options_ignored() -> None:
    w = Wire(client_cfg=SessionConfig(path="/", extra_setup_options=[(0x7F * 3 + 0x9D, 7),
                                                                    (0x3001, b"x")]))
    w.start()
    [s] = w.take(w.server, ev.SetupComplete)
    assert not w.server.closed and len(s.peer_setup.unknown_options) == 2


def test_control_stream_bytes_start_with_setup_type() -> None:
    s = SessionMachine(Role.SERVER, Version.DRAFT_22)
    s.start()
    acts = s.actions()
    # The control stream is the server's first unidirectional stream (RFC 9000 numbering,
    # here from the default StreamCounter); no "open" action: the transport numbers streams.
    assert isinstance(acts[0], ev.SendStream) and acts[0].stream_id == SERVER_UNI0
    assert acts[0].data[:2] == b"\xaf\x00"


@pytest.mark.parametrize("path,code", [("no-slash", SessionErrorCode.MALFORMED_PATH),
                                       ("/a b", SessionErrorCode.MALFORMED_PATH),
                                       ("/other", SessionErrorCode.INVALID_PATH)])
def test_path_errors(path: str, code: int) -> None:
    w = Wire(client_cfg=SessionConfig(path=path),
             server_cfg=SessionConfig(accept_path=lambda p: p == "/moq"))
    w.start()
    assert close_code(w.server) == code


def test_malformed_authority() -> None:
    w = Wire(client_cfg=SessionConfig(path="/", authority="a b/c"))
    w.start()
    assert close_code(w.server) == SessionErrorCode.MALFORMED_AUTHORITY


def test_server_sending_path_is_violation() -> None:
    client = SessionMachine(Role.CLIENT, Version.DRAFT_22)
    client.start()
    client.stream_data(SERVER_UNI0, encode_message(Version.DRAFT_22, Setup(path="/x")))
    assert client.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def _server_after_setup(version: Version = Version.DRAFT_22) -> SessionMachine:
    s = SessionMachine(Role.SERVER, version)
    s.start()
    s.stream_data(CLIENT_UNI0, encode_message(version, Setup(path="/")))
    s.actions()
    s.events()
    return s


@pytest.mark.parametrize("data,end", [
    (encode_message(Version.DRAFT_22, Setup()), False),         # a second SETUP
    (b"", True),                                                  # control stream FIN
    (encode_message(Version.DRAFT_22, Subscribe(0, NS, b"t")), False),  # request on control
    (b"\x3f\x00\x00", False),                                     # unknown message type
])
def test_control_stream_violations(data: bytes, end: bool) -> None:
    s = _server_after_setup()
    s.stream_data(CLIENT_UNI0, data, end)
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION
    assert s.actions()[-1] == ev.CloseSession(SessionErrorCode.PROTOCOL_VIOLATION,
                                              s.close_reason)


def test_unknown_stream_type_is_violation() -> None:
    s = SessionMachine(Role.SERVER, Version.DRAFT_22)
    s.start()
    # A GOAWAY frame's first byte (0x10) is a subgroup stream type: such a data stream
    # arriving before SETUP is held, not an error.
    s.stream_data(CLIENT_UNI0, encode_message(Version.DRAFT_22, GoAway()))
    assert not s.closed
    s2 = SessionMachine(Role.SERVER, Version.DRAFT_22)
    s2.start()
    s2.stream_data(CLIENT_UNI0, b"\xf0\x13\x2b\x3e\x29")  # padding datagram type as stream
    assert s2.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_reset_control_stream_is_violation() -> None:
    s = _server_after_setup()
    s.stream_reset(CLIENT_UNI0, 0)
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_requests_before_setup_are_buffered() -> None:
    v = Version.DRAFT_22
    s = SessionMachine(Role.SERVER, v)
    s.start()
    s.stream_data(0, encode_message(v, Subscribe(0, NS, b"t")))
    assert not s.events()
    s.stream_data(CLIENT_UNI0, encode_message(v, Setup(path="/")))
    kinds = [type(e) for e in s.events()]
    assert kinds == [ev.SetupComplete, ev.RequestReceived]


# ==========================================================================================
# requests


@pytest.mark.parametrize("version", VERSIONS)
def test_subscribe_objects_publish_done(version: Version) -> None:
    w = Wire(version).start()
    rid = w.client.subscribe(NS, b"track")
    assert rid == 0
    w.flush()
    [req] = w.take(w.server, ev.RequestReceived)
    assert isinstance(req.message, Subscribe) and req.request_id == 0
    w.server.accept_subscribe(rid, track_alias=7, track_properties=[(0x3800, 5)])
    w.flush()
    [resp] = w.take(w.client, ev.ResponseReceived)
    assert isinstance(resp.message, SubscribeOk) and resp.message.track_alias == 7
    header = SubgroupHeader(7, 3, 0, 128, SubgroupIdMode.ZERO, has_properties=True)
    sid = w.server.open_subgroup_stream(rid, header)
    enc = SubgroupStreamEncoder(header, version)
    acts = w.server.actions()
    for a in acts:
        w.deliver(w.server, a)
    data = enc.object(0, b"hello", properties=[(0x3800, 1)]) + enc.object(1, b"world")
    w.client.stream_data(sid, data[:4])
    w.client.stream_data(sid, data[4:], True)
    w.server.data_stream_done(sid)
    w.server.publish_done(rid, PublishDoneCode.TRACK_ENDED, 1)
    w.flush()
    data_events = [e.event for e in w.take(w.client, ev.DataEvent)]
    assert isinstance(data_events[0], SubgroupHeader)
    begins = [e for e in data_events if isinstance(e, ObjectBegin)]
    assert [(b.group_id, b.object_id) for b in begins] == [(3, 0), (3, 1)]
    payload = b"".join(bytes(e.data) for e in data_events if isinstance(e, ObjectPayload))
    assert payload == b"helloworld"
    assert len([e for e in data_events if isinstance(e, ObjectEnd)]) == 2
    assert w.take(w.client, ev.DataStreamClosed) == [ev.DataStreamClosed(rid, sid, None)]
    [done] = w.take(w.client, ev.RequestMessage)
    assert isinstance(done.message, PublishDone) and done.message.stream_count == 1
    assert w.take(w.client, ev.RequestFinished)
    # Both halves ended: both sides forgot the request.
    assert rid not in w.client.requests and rid not in w.server.requests
    assert not w.client.closed and not w.server.closed


def test_data_before_subscribe_ok_is_held_then_routed() -> None:
    v = Version.DRAFT_22
    w = Wire(v).start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    header = SubgroupHeader(9, 0, 0, None, SubgroupIdMode.ZERO)
    enc = SubgroupStreamEncoder(header, v)
    # Server's data stream overtakes SUBSCRIBE_OK.
    w.client.stream_data(7, enc.header() + enc.object(0, b"early"), True)
    assert not w.client.events()
    w.server.accept_subscribe(rid, 9)
    w.flush()
    kinds = [type(e.event) for e in w.take(w.client, ev.DataEvent)]
    assert kinds == [SubgroupHeader, ObjectBegin, ObjectPayload, ObjectEnd]
    assert w.take(w.client, ev.DataStreamClosed)


def test_pending_alias_limit_stops_stream() -> None:
    v = Version.DRAFT_22
    w = Wire(v, client_cfg=SessionConfig(path="/", max_pending_stream_bytes=100)).start()
    w.client.subscribe(NS, b"t")
    w.flush()
    header = SubgroupHeader(9, 0, 0, None, SubgroupIdMode.ZERO)
    enc = SubgroupStreamEncoder(header, v)
    w.client.stream_data(7, enc.header() + enc.object_header(0, 1000) + b"x" * 200)
    assert w.client.actions() == [ev.StopSending(7, StreamResetCode.EXCESSIVE_LOAD)]
    assert not w.client.closed


@pytest.mark.parametrize("version", VERSIONS)
def test_fetch_flow(version: Version) -> None:
    w = Wire(version).start()
    rid = w.client.fetch(NS, b"t", (1, 0), (1, 4))
    w.flush()
    [req] = w.take(w.server, ev.RequestReceived)
    if version is Version.DRAFT_18:
        assert isinstance(req.message, StandaloneFetch)
        assert tuple(req.message.end_location) == (1, 5)  # end plus 1 (draft-18 §FETCH)
    else:
        flt = req.message.parameters.location_filter
        assert tuple(flt.start_location) == (1, 0) and flt.end_group == 1 and flt.end_object == 4
    w.server.accept_fetch(rid, (1, 4))
    sid = w.server.open_fetch_stream(rid)
    w.flush()
    from kvsp_moq.moqt.data import FetchStreamEncoder

    enc = FetchStreamEncoder(rid, version)
    body = enc.object(1, 0, b"a", subgroup_id=0, publisher_priority=1) + enc.object(
        1, 4, b"b", subgroup_id=0, publisher_priority=1)
    w.client.stream_data(sid, body, True)
    w.flush()
    [resp] = w.take(w.client, ev.ResponseReceived)
    assert isinstance(resp.message, FetchOk)
    evs = [e.event for e in w.take(w.client, ev.DataEvent)]
    assert isinstance(evs[0], FetchHeader)
    assert [(b.group_id, b.object_id) for b in evs if isinstance(b, ObjectBegin)] == [(1, 0),
                                                                                     (1, 4)]


def test_request_error_and_redirect_checks() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"missing")
    w.flush()
    w.server.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "nope")
    w.flush()
    [resp] = w.take(w.client, ev.ResponseReceived)
    assert isinstance(resp.message, RequestError)
    assert resp.message.code is RequestErrorCode.DOES_NOT_EXIST
    assert rid not in w.client.requests and rid not in w.server.requests
    assert not w.client.closed and not w.server.closed


def test_publish_namespace_ok_and_track_status() -> None:
    w = Wire().start()
    rid = w.client.publish_namespace(NS)
    w.flush()
    [req] = w.take(w.server, ev.RequestReceived)
    w.server.request_ok(req.request_id)
    w.flush()
    [resp] = w.take(w.client, ev.ResponseReceived)
    assert isinstance(resp.message, RequestOk) and resp.request_id == rid
    rid2 = w.client.track_status(NS, b"t")
    w.flush()
    w.server.request_ok(rid2, MessageParameters(largest_object=(4, 2)),
                        track_properties=[(0x3800, 1)], end=True)
    w.flush()
    [resp2] = w.take(w.client, ev.ResponseReceived)
    assert resp2.message.parameters.largest_object == (4, 2)


def test_subscribe_namespace_namespace_messages() -> None:
    w = Wire().start()
    rid = w.client.subscribe_namespace((b"kvsp-1",))
    w.flush()
    w.server.request_ok(rid)
    w.server.namespace(rid, (b"a",))
    w.server.namespace_done(rid, (b"a",))
    w.flush()
    msgs = [type(e.message).__name__ for e in w.take(w.client, ev.RequestMessage)]
    assert msgs == ["Namespace", "NamespaceDone"]


def test_namespace_before_ok_is_violation() -> None:
    w = Wire().start()
    rid = w.client.subscribe_namespace((b"kvsp-1",))
    w.flush()
    w.server.requests[rid].responded = True  # bypass the local guard to misbehave
    w.server.namespace(rid, (b"a",))
    w.flush()
    assert close_code(w.client) == SessionErrorCode.PROTOCOL_VIOLATION


def test_request_update_and_answer() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 1)
    w.flush()
    upd = w.client.request_update(rid, MessageParameters(forward=False))
    assert upd == 2
    w.flush()
    [u] = w.take(w.server, ev.UpdateReceived)
    assert isinstance(u.message, RequestUpdate) and u.message.parameters.forward is False
    w.server.request_ok(rid)
    w.flush()
    [a] = w.take(w.client, ev.UpdateAnswered)
    assert a.update_request_id == upd


def test_too_many_request_updates() -> None:
    w = Wire(server_cfg=SessionConfig(max_request_updates=1)).start()
    [c] = w.take(w.client, ev.SetupComplete)
    assert c.peer_setup.max_request_updates == 1
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 1)
    w.client.request_update(rid, MessageParameters(forward=False))
    w.client.request_update(rid, MessageParameters(forward=True))
    w.flush()
    assert close_code(w.server) == SessionErrorCode.TOO_MANY_REQUEST_UPDATES


@pytest.mark.parametrize("request_id", [1, 0])  # wrong parity; duplicate of the first
def test_invalid_request_id(request_id: int) -> None:
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    s.stream_data(0, encode_message(v, Subscribe(0, NS, b"t")))
    assert not s.closed
    s.stream_data(4, encode_message(v, Subscribe(request_id, NS, b"u")))
    assert s.close_code == SessionErrorCode.INVALID_REQUEST_ID


def test_first_message_not_a_request() -> None:
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    s.stream_data(0, encode_message(v, SubscribeOk(1)))
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_response_from_requester_is_violation() -> None:
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    s.stream_data(0, encode_message(v, Subscribe(0, NS, b"t")) + encode_message(
        v, SubscribeOk(1)))
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_second_subscribe_ok_is_violation() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 1)
    w.flush()
    w.client.stream_data(0, encode_message(Version.DRAFT_22, SubscribeOk(1)))
    assert close_code(w.client) == SessionErrorCode.PROTOCOL_VIOLATION


def test_duplicate_track_alias() -> None:
    w = Wire().start()
    a = w.client.subscribe(NS, b"one")
    b = w.client.subscribe(NS, b"two")
    w.flush()
    w.server.accept_subscribe(a, 5)
    w.server.accept_subscribe(b, 5)
    w.flush()
    assert close_code(w.client) == SessionErrorCode.DUPLICATE_TRACK_ALIAS


def test_fetch_stream_for_unknown_request() -> None:
    w = Wire().start()
    w.client.stream_data(3 + 4, b"\x05\x09")  # FETCH_HEADER for Request ID 9
    assert close_code(w.client) == SessionErrorCode.PROTOCOL_VIOLATION


def test_invalid_datagram_closes() -> None:
    w = Wire().start()
    w.client.datagram_received(b"\x10\x00\x00")  # 0x10 is a reserved datagram flag
    assert close_code(w.client) == SessionErrorCode.PROTOCOL_VIOLATION


def test_datagram_routed_by_alias() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 3)
    w.server.send_datagram(ObjectDatagram(3, 1, 2, payload=b"dg"))
    w.server.send_datagram(ObjectDatagram(99, 1, 2, payload=b"unknown alias: dropped"))
    w.flush()
    [d] = w.take(w.client, ev.DatagramReceived)
    assert d.request_id == rid and bytes(d.datagram.payload) == b"dg"


def test_cancel_subscription_resets_data_streams() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 1)
    sid = w.server.open_subgroup_stream(rid, SubgroupHeader(1, 0, 0, None, SubgroupIdMode.ZERO))
    w.flush()
    w.client.cancel(rid)
    acts = w.client.actions()
    assert ev.ResetStream(0, StreamResetCode.CANCELLED) in acts
    assert ev.StopSending(0, StreamResetCode.CANCELLED) in acts
    assert ev.StopSending(sid, StreamResetCode.CANCELLED) in acts
    for a in acts:
        w.deliver(w.client, a)
    sacts = w.server.actions()
    sevents = w.server.events()
    # STOP_SENDING on the data stream (the transport resets it) was seen by the publisher.
    assert ev.DataStreamStopped(rid, sid, StreamResetCode.CANCELLED) in sevents
    assert ev.ResetStream(0, StreamResetCode.CANCELLED) in sacts
    [c] = [e for e in sevents if isinstance(e, ev.RequestCancelled)]
    assert c.request_id == rid and c.error_code == StreamResetCode.CANCELLED
    assert rid not in w.server.requests
    # Late data for the cancelled alias is stopped, not an error.
    w.client.stream_data(11, encode_subgroup_header(SubgroupHeader(1, 0, 0, None,
                                                                   SubgroupIdMode.ZERO)))
    assert w.client.actions() == [ev.StopSending(11, StreamResetCode.CANCELLED)]
    assert not w.client.closed


# ==========================================================================================
# GOAWAY


def test_goaway_from_server() -> None:
    w = Wire().start()
    w.server.goaway("moqt://other/x", 5000)
    w.flush()
    [g] = w.take(w.client, ev.GoawayReceived)
    assert g.message.new_session_uri == "moqt://other/x" and g.message.timeout == 5000
    assert w.client.state is SessionState.DRAINING
    with pytest.raises(RuntimeError):
        w.client.subscribe(NS, b"t")


def test_server_rejects_requests_after_its_goaway() -> None:
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    s.goaway()
    s.actions()
    s.stream_data(0, encode_message(v, Subscribe(0, NS, b"t")))
    sends = [a for a in s.actions() if isinstance(a, ev.SendStream) and a.stream_id == 0]
    assert sends and sends[0].data[0] == RequestError.TYPE and sends[-1].end_stream


def test_client_goaway_with_uri_is_violation() -> None:
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    s.stream_data(CLIENT_UNI0, encode_message(v, GoAway("moqt://x/")))
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_second_goaway_is_violation() -> None:
    w = Wire().start()
    w.client.stream_data(SERVER_UNI0, encode_message(Version.DRAFT_22, GoAway()))
    assert not w.client.closed
    w.client.stream_data(SERVER_UNI0, encode_message(Version.DRAFT_22, GoAway()))
    assert close_code(w.client) == SessionErrorCode.PROTOCOL_VIOLATION


def test_too_many_namespace_fields_is_violation() -> None:
    # 33 fields: the limit is 32 (§"Track Namespace"): PROTOCOL_VIOLATION.
    v = Version.DRAFT_22
    s = _server_after_setup(v)
    body = bytearray(b"\x00" + bytes([33]) + b"\x01a" * 33 + b"\x01t\x00")
    s.stream_data(0, bytes([0x03]) + len(body).to_bytes(2, "big") + bytes(body))
    assert s.close_code == SessionErrorCode.PROTOCOL_VIOLATION


def test_publish_done_code_unknown_reads_internal() -> None:
    assert PublishDone(0x777, 0).code is PublishDoneCode.INTERNAL_ERROR
