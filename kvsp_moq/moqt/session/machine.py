"""The sans-IO MOQT session state machine (drafts 18, 20/21, 22), one per connection.

No asyncio, no QUIC library: the I/O layer (``kvsp_moq.pubsub``) feeds it what the
transport delivered and carries out the actions it queues; see ``docs/moqt-session.md``.

Inputs: :meth:`SessionMachine.start` (once, when the connection is up), :meth:`stream_data`,
:meth:`stream_reset`, :meth:`stop_sending`, :meth:`datagram_received`,
:meth:`connection_lost`; and the local API (``subscribe``, ``fetch``, ``accept_subscribe``,
``reject``, ``publish_done``, ``cancel``, ``goaway``, ``open_subgroup_stream``, ...).
Outputs: :meth:`next_event` / :meth:`events` and :meth:`next_action` / :meth:`actions`.

Streams (draft-20 §"Session initialization", §"Request Streams"; same in 18):

* a pair of unidirectional control streams, each starting with SETUP (type 0x2F00), then
  carrying only GOAWAY; closing one → PROTOCOL_VIOLATION;
* one bidirectional stream per request; its first message is the request, responses and
  updates follow on it; cancellation is RESET_STREAM / STOP_SENDING (code CANCELLED);
* unidirectional data streams (SUBGROUP_HEADER, routed by Track Alias; FETCH_HEADER, routed
  by Request ID) and datagrams (by Track Alias).

Every protocol error surfaces as a :class:`WireError` and is turned into a session close
(or, for a local resource limit on one stream, a STOP_SENDING) in exactly one place,
:meth:`SessionMachine._fail`.

Layout of this package: the settings in :mod:`.config`, our SETUP and the checks of the
peer's in :mod:`.setup`, the peer's unidirectional streams and datagrams in
:mod:`.incoming`, stream numbering (the transport's, :class:`~.streams.StreamIdAllocator`)
in :mod:`.streams`, events and actions in :mod:`.events`; requests, control streams and
the local API here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from ...wire.buffer import Buffer
from ...wire.errors import LimitExceeded, SessionErrorCode, StreamResetCode, WireError
from ..data import encode_fetch_header, encode_subgroup_header, parse_datagram
from ..data import encode_datagram as _encode_datagram
from ..messages import (
    FETCH_TYPE,
    PUBLISH_TYPE,
    REQUEST_TYPES,
    SUBSCRIBE_TYPE,
    ControlStreamReader,
    Fetch,
    FetchOk,
    GoAway,
    JoiningFetch,
    Location,
    Message,
    MessageParameters,
    Namespace,
    NamespaceDone,
    Publish,
    PublishDone,
    PublishOk,
    RequestError,
    RequestOk,
    RequestUpdate,
    Sender,
    Setup,
    StandaloneFetch,
    StreamUse,
    SubscribeOk,
    check_redirect,
    check_request_ok,
    check_request_update,
    encode_message,
    violation,
)
from ..messages.params import ParamContext
from ..objects import GroupOrder, ObjectDatagram, SubgroupHeader
from ..requests import INITIAL_RESPONSES, OK_CONTEXT, Request, RequestIdAllocator, RequestIdChecker
from ..version import Version
from .config import Role, SessionConfig, SessionState
from .events import (
    Action,
    CloseSession,
    DataStreamStopped,
    Event,
    GoawayReceived,
    RequestCancelled,
    RequestFinished,
    RequestMessage,
    RequestReceived,
    ResetStream,
    ResponseReceived,
    SendDatagram,
    SendStream,
    SessionClosed,
    SetupComplete,
    StopSending,
    UpdateAnswered,
    UpdateReceived,
)
from .admission import check_local_namespace, refusal
from .incoming import IncomingStreams
from .requester import RequestApi, kvps
from .setup import build_setup, check_peer_setup
from .streams import StreamCounter, StreamIdAllocator

__all__ = ["SessionMachine"]

PV = SessionErrorCode.PROTOCOL_VIOLATION


class SessionMachine(RequestApi):
    """The MOQT session state machine (client or server role) of one connection, sans-IO.

    ``streams`` numbers the streams it opens: the transport's allocator (the I/O layer
    passes one over its connection), by default an RFC 9000 :class:`StreamCounter`."""

    def __init__(self, role: Role, version: Version, config: SessionConfig | None = None, *,
                 streams: StreamIdAllocator | None = None) -> None:
        self.role = role
        self.version = version
        self.config = config or SessionConfig()
        self.is_client = role is Role.CLIENT
        self.state = SessionState.SETUP
        self.peer_setup: Setup | None = None
        self.close_code: int | None = None
        self.close_reason = ""
        self.goaway_sent = False
        self.peer_goaway: GoAway | None = None
        self._events: deque[Event] = deque()
        self._actions: deque[Action] = deque()
        self._streams: StreamIdAllocator = (streams if streams is not None
                                            else StreamCounter(self.is_client))
        self._control_out: int | None = None
        self._control_in: int | None = None
        self._control_goaway = False
        self._ids = RequestIdAllocator(self.is_client)
        self._peer_ids = RequestIdChecker(peer_is_client=not self.is_client,
                                          max_gaps=self.config.max_id_gaps)
        self.requests: dict[int, Request] = {}
        #: The peer's requests open now (SessionConfig.max_concurrent_requests caps them).
        self._peer_live = 0
        self._by_stream: dict[int, Request] = {}
        #: The peer's unidirectional streams and datagrams (data routing: .incoming).
        self._in = IncomingStreams(self.version, self.config, self._events, self._actions,
                                   established=lambda: self.peer_setup is not None,
                                   hold=self._hold, control=self._control_opened,
                                   control_data=self._control_data,
                                   request_id_used=self._request_id_used)
        #: Our finished SUBSCRIBEs / FETCHes whose data streams may still arrive: their
        #: Track Alias, until :meth:`release`.
        self._finished_local: dict[int, int | None] = {}
        #: Our data streams → request ID.
        self._data_out: dict[int, int] = {}
        #: Input held before the peer's SETUP (§"Session initialization": SHOULD buffer).
        self._early: list[tuple[int, bytes, bool]] = []
        self._early_bytes = 0
        #: Peer request streams whose first message is still incomplete.
        self._partial_first: dict[int, ControlStreamReader] = {}

    # ======================================================================================
    # output queues
    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def events(self) -> list[Event]:
        out = list(self._events)
        self._events.clear()
        return out

    def next_action(self) -> Action | None:
        return self._actions.popleft() if self._actions else None

    def actions(self) -> list[Action]:
        out = list(self._actions)
        self._actions.clear()
        return out

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    def state_sizes(self) -> dict[str, int]:
        """Entries (or ranges) in each per-request and per-stream structure: bounded by the
        requests and streams open now, never by the session's history."""
        return {"requests": len(self.requests), "by_stream": len(self._by_stream),
                "finished_local": len(self._finished_local), "data_out": len(self._data_out),
                "partial_first": len(self._partial_first), "early": len(self._early),
                "peer_request_id_ranges": len(self._peer_ids), **self._in.state_sizes()}

    def _request_id_used(self, request_id: int) -> bool:
        return self._ids.allocated(request_id) or self._peer_ids.used(request_id)

    # ======================================================================================
    # start and SETUP (§"SETUP")
    def start(self) -> None:
        """Open our control stream and send SETUP (either side sends it at once)."""
        if self._control_out is not None:
            raise RuntimeError("session already started")
        setup = build_setup(self.config, self.version, self.is_client)
        self._control_out = self._open(uni=True)
        self._send(self._control_out, encode_message(self.version, setup))

    def _on_setup(self, setup: Setup) -> None:
        check_peer_setup(setup, self.config, self.is_client)
        self.peer_setup = setup
        if self.state is SessionState.SETUP:
            self.state = SessionState.ESTABLISHED
        self._events.append(SetupComplete(setup))
        early, self._early = self._early, []
        self._early_bytes = 0
        for stream_id, data, end in early:
            if self.closed:
                return
            self.stream_data(stream_id, data, end)

    # ======================================================================================
    # transport input
    def stream_data(self, stream_id: int, data: Buffer, end_stream: bool = False) -> None:
        if self.closed:
            return
        try:
            self._stream_data(stream_id, data, end_stream)
        except WireError as exc:
            self._fail(exc, stream_id)

    def _stream_data(self, stream_id: int, data: Buffer, end_stream: bool) -> None:
        uni = bool(stream_id & 2)
        local = (stream_id & 1 == 0) == self.is_client
        if uni and local:
            raise violation(f"data on our own unidirectional stream {stream_id}")
        if uni:
            self._in.stream_data(stream_id, data, end_stream)
            return
        req = self._by_stream.get(stream_id)
        if req is None:
            if local:
                return  # a request we already forgot (cancelled): ignore late bytes
            if self.peer_setup is None:
                self._hold(stream_id, data, end_stream)
                return
            if stream_id not in self._partial_first and stream_id in self._in.dead_streams:
                return
            self._new_peer_request(stream_id, data, end_stream)
            return
        self._request_data(req, data, end_stream)

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset its send half of ``stream_id``."""
        if self.closed:
            return
        try:
            if stream_id == self._control_in:
                raise violation("the peer reset its control stream")
            req = self._by_stream.get(stream_id)
            if req is not None:
                self._cancelled(req, error_code)
                return
            if stream_id & 2:
                self._in.stream_reset(stream_id, error_code)
        except WireError as exc:
            self._fail(exc, stream_id)

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        """The peer sent STOP_SENDING on ``stream_id`` (the transport reset our half)."""
        if self.closed:
            return
        try:
            if stream_id == self._control_out:
                raise violation("the peer stopped our control stream")
            req = self._by_stream.get(stream_id)
            if req is not None:
                self._cancelled(req, error_code)
                return
            rid = self._data_out.pop(stream_id, None)
            if rid is not None:
                owner = self.requests.get(rid)
                if owner is not None:
                    owner.data_streams.discard(stream_id)
                self._events.append(DataStreamStopped(rid, stream_id, error_code))
        except WireError as exc:
            self._fail(exc, stream_id)

    def datagram_received(self, data: Buffer) -> None:
        if self.closed:
            return
        try:
            dg = parse_datagram(self.version, data)
        except WireError as exc:
            self._fail(exc)
            return
        if isinstance(dg, ObjectDatagram):
            self._in.datagram(dg)

    def connection_lost(self, error_code: int = 0, reason: str = "") -> None:
        if self.closed:
            return
        self.state = SessionState.CLOSED
        self.close_code, self.close_reason = error_code, reason
        self._events.append(SessionClosed(error_code, reason, local=False))

    # ======================================================================================
    # the one place where protocol errors become closes / resets
    def _fail(self, exc: WireError, stream_id: int | None = None) -> None:
        if isinstance(exc, LimitExceeded) and stream_id is not None and stream_id & 2:
            # A local resource limit on one data stream: cancel just that stream
            # (draft-20 §"Resource Exhaustion").
            self._in.limit_exceeded(stream_id, exc.stream_code)
            return
        self.close(exc.code, exc.reason)

    def close(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        """Close the session (CONNECTION_CLOSE with ``error_code``)."""
        if self.closed:
            return
        self.state = SessionState.CLOSED
        self.close_code, self.close_reason = int(error_code), reason
        self._actions.append(CloseSession(int(error_code), reason))
        self._events.append(SessionClosed(int(error_code), reason, local=True))

    # ======================================================================================
    # input before the peer's SETUP, and the control stream
    def _hold(self, stream_id: int, data: Buffer, end_stream: bool) -> None:
        self._early_bytes += len(data)
        if self._early_bytes > self.config.max_pending_stream_bytes:
            self._actions.append(StopSending(stream_id, StreamResetCode.EXCESSIVE_LOAD))
            self._in.dead_streams.add(stream_id)
            return
        self._early.append((stream_id, bytes(data), end_stream))

    def _control_opened(self, stream_id: int) -> ControlStreamReader:
        if self._control_in is not None:
            raise violation("a second control stream")
        self._control_in = stream_id
        return ControlStreamReader(self.version)

    def _control_data(self, reader: ControlStreamReader, data: Buffer, end_stream: bool) -> None:
        for msg in reader.feed(data):
            self._control_message(msg)
            if self.closed:
                return
        if end_stream:
            raise violation("the peer closed its control stream")

    def _control_message(self, msg: Message) -> None:
        if self.peer_setup is None:
            if not isinstance(msg, Setup):
                raise violation(f"{msg.NAME} before SETUP on the control stream")
            self._on_setup(msg)
            return
        if isinstance(msg, Setup):
            raise violation("a second SETUP")
        if not isinstance(msg, GoAway):
            # Only SETUP and GOAWAY ride the control stream (§"Control Streams").
            raise violation(f"{msg.NAME} on the control stream")
        if self._control_goaway:
            raise violation("a second GOAWAY on the control stream")
        self._control_goaway = True
        self._on_goaway(msg, None)

    def _on_goaway(self, msg: GoAway, request_id: int | None) -> None:
        # §"GOAWAY": a client MUST NOT send a New Session URI.
        if not self.is_client and msg.new_session_uri:
            raise violation("a client sent GOAWAY with a New Session URI")
        self.peer_goaway = msg
        if self.state is SessionState.ESTABLISHED:
            self.state = SessionState.DRAINING
        self._events.append(GoawayReceived(msg, request_id))

    # ======================================================================================
    # request streams (§"Request Streams")
    def _new_peer_request(self, stream_id: int, data: Buffer, end_stream: bool) -> None:
        reader = self._partial_first.pop(stream_id, None) or ControlStreamReader(self.version)
        msgs = reader.feed(data, end_stream)
        if not msgs:
            if end_stream:
                raise violation("request stream ended before its request")
            if len(self._partial_first) >= self.config.max_incomplete_requests:
                # As many unreadable requests as allowed already: refuse this stream
                # (§"Session initialization": an endpoint "MAY reset such bidirectional
                # streams"; §"Resource Exhaustion").
                self._in.dead_streams.add(stream_id)
                self._actions.append(StopSending(stream_id, StreamResetCode.EXCESSIVE_LOAD))
                self._actions.append(ResetStream(stream_id, StreamResetCode.EXCESSIVE_LOAD))
                return
            # Keep the reader: the first message is incomplete.
            self._partial_first[stream_id] = reader
            return
        self._open_peer_request(stream_id, reader, msgs, end_stream)

    def _open_peer_request(self, stream_id: int, reader: ControlStreamReader,
                           msgs: list[Message], end_stream: bool) -> None:
        first = msgs[0]
        if not (first.FIRST and first.STREAM is StreamUse.REQUEST
                and first.TYPE in REQUEST_TYPES):
            raise violation(f"{first.NAME} as the first message of a request stream")
        rid: int = first.request_id  # type: ignore[attr-defined]
        self._peer_ids.check(rid)
        req = Request(rid, stream_id, first.TYPE, first, local=False, reader=reader)
        refused = None if self.goaway_sent else refusal(first, self.config, self._peer_live)
        self.requests[rid] = req
        self._by_stream[stream_id] = req
        self._peer_live += 1
        if refused is not None:
            # Answered by the session itself (.admission): the application never sees it.
            code, reason, retry = refused
            self.reject(rid, code, reason, retry_interval=retry)
            return
        if isinstance(first, Publish):
            self._register_alias(req, first.track_alias, first.track_namespace, first.track_name)
        self._events.append(RequestReceived(rid, first))
        if self.goaway_sent:
            # We asked the peer to go away: refuse new work (REQUEST_ERROR GOING_AWAY).
            self.reject(rid, 0x6, "going away")
        for msg in msgs[1:]:
            if self.closed or rid not in self.requests:
                return
            self._request_message(req, msg)
        if end_stream and not self.closed and rid in self.requests:
            self._peer_finished(req)

    def _request_data(self, req: Request, data: Buffer, end_stream: bool) -> None:
        if req.recv_finished:
            # QUIC never delivers past a FIN (a final size error); defend anyway.
            raise violation("data after the end of a request stream")
        for msg in req.reader.feed(data, end_stream):
            self._request_message(req, msg)
            if self.closed or req.request_id not in self.requests:
                return
        if end_stream:
            self._peer_finished(req)

    def _request_message(self, req: Request, msg: Message) -> None:
        if isinstance(msg, GoAway):
            if req.goaway_received:
                raise violation("a second GOAWAY on a request stream")
            req.goaway_received = True
            self._on_goaway(msg, req.request_id)
            return
        allowed = type(msg).ON_REQUESTS.get(req.request_type)
        peer_is_requester = not req.local
        if allowed is None or (allowed is Sender.REQUESTER and not peer_is_requester) or (
                allowed is Sender.RESPONDER and peer_is_requester):
            raise violation(f"{msg.NAME} on a {req.message.NAME} stream from the "
                            f"{'requester' if peer_is_requester else 'responder'}")
        if isinstance(msg, RequestUpdate):
            msg = check_request_update(self.version, msg, req.request_type)
            self._peer_ids.check(msg.request_id)
            req.updates_received += 1
            limit = self.config.max_request_updates
            if (self.version.has_range_filters and limit
                    and req.updates_received > limit):
                raise WireError(SessionErrorCode.TOO_MANY_REQUEST_UPDATES,
                                f"more than {limit} REQUEST_UPDATEs")
            self._events.append(UpdateReceived(req.request_id, msg))
            return
        if isinstance(msg, RequestOk | RequestError | SubscribeOk | FetchOk):
            if req.local and not req.responded:
                self._initial_response(req, msg)
                return
            if isinstance(msg, PublishOk):  # draft 18's 0x1E answers only the PUBLISH
                raise violation("PUBLISH_OK after the response to PUBLISH")
            if isinstance(msg, RequestOk | RequestError) and req.pending_updates:
                if isinstance(msg, RequestOk):
                    msg = check_request_ok(self.version, msg, ParamContext.REQUEST_UPDATE_OK)
                upd = req.pending_updates.popleft()
                self._events.append(UpdateAnswered(req.request_id, upd, msg))
                return
            raise violation(f"unexpected {msg.NAME} on a {req.message.NAME} stream")
        # NAMESPACE, NAMESPACE_DONE, PUBLISH_DONE, PUBLISH_STATE_NOTIFY, PUBLISH_SKIPPED.
        if req.local and not req.responded and req.request_type != PUBLISH_TYPE:
            # The OK/ERROR MUST be the first message on the response half.
            raise violation(f"{msg.NAME} before the response to {req.message.NAME}")
        self._events.append(RequestMessage(req.request_id, msg))

    def _initial_response(self, req: Request, msg: Message) -> None:
        if not isinstance(msg, INITIAL_RESPONSES[req.request_type]):
            raise violation(f"{msg.NAME} answering {req.message.NAME}")
        req.responded = True
        if isinstance(msg, RequestOk):
            msg = check_request_ok(self.version, msg, OK_CONTEXT[req.request_type])
        elif isinstance(msg, RequestError):
            check_redirect(self.version, msg, req.request_type,
                           receiver_is_server=not self.is_client)
            req.failed = True
            if not req.send_finished:  # the request is over: nothing more from us either
                req.send_finished = True
                self._send(req.stream_id, b"", True)
        elif isinstance(msg, SubscribeOk):
            sub = req.message
            self._register_alias(req, msg.track_alias, sub.track_namespace,  # type: ignore[attr-defined]
                                 sub.track_name)  # type: ignore[attr-defined]
        self._events.append(ResponseReceived(req.request_id, msg))

    def _register_alias(self, req: Request, alias: int, ns: tuple[bytes, ...],
                        name: bytes) -> None:
        self._in.register_alias(req.request_id, alias, ns, name)
        req.track_alias = alias

    def _peer_finished(self, req: Request) -> None:
        req.recv_finished = True
        self._events.append(RequestFinished(req.request_id))
        if req.local and not req.send_finished and (req.failed or req.request_type != PUBLISH_TYPE):
            # The responder ended the request (e.g. PUBLISH_DONE + FIN): end ours too.
            req.send_finished = True
            self._send(req.stream_id, b"", True)
        self._maybe_forget(req)

    def _cancelled(self, req: Request, error_code: int) -> None:
        self._forget(req, reset_code=StreamResetCode.CANCELLED)
        self._events.append(RequestCancelled(req.request_id, error_code))

    def _maybe_forget(self, req: Request) -> None:
        if req.recv_finished and req.send_finished and not req.data_streams:
            self._forget(req, reset_code=None)

    def _forget(self, req: Request, reset_code: int | None) -> None:
        """Drop a request's stream state. A normal end (``reset_code`` None) keeps the data
        routing of a local subscription/fetch, whose data streams may still be arriving
        (PUBLISH_DONE's Stream Count exists for that), until :meth:`release`."""
        if self.requests.pop(req.request_id, None) is not None and not req.local:
            self._peer_live -= 1
        self._by_stream.pop(req.stream_id, None)
        if not req.local:
            self._in.dead_streams.add(req.stream_id)  # late bytes are not a new request
        if reset_code is None:
            if req.local and not req.failed and req.request_type in (SUBSCRIBE_TYPE, FETCH_TYPE):
                # Only these receive data streams (subgroups, fetch and fill fetch streams).
                self._finished_local[req.request_id] = req.track_alias
                if len(self._finished_local) > self.config.max_id_gaps:
                    # An application that never calls release(): the oldest goes first.
                    oldest = next(iter(self._finished_local))
                    self._retire(oldest, self._finished_local.pop(oldest))
                return
        else:
            if not req.send_finished:
                self._actions.append(ResetStream(req.stream_id, reset_code))
            if not req.recv_finished:
                self._actions.append(StopSending(req.stream_id, reset_code))
            for sid in sorted(req.data_streams):
                self._data_out.pop(sid, None)
                self._actions.append(ResetStream(sid, reset_code))
            req.data_streams.clear()
        self._retire(req.request_id, req.track_alias)

    def _retire(self, request_id: int, alias: int | None) -> None:
        self._in.retire(request_id, alias)

    def release(self, request_id: int) -> None:
        """The application is done with a finished local request: drop its data routing
        (later data streams for it are stopped with CANCELLED)."""
        if request_id in self._finished_local:
            self._retire(request_id, self._finished_local.pop(request_id))

    def stop_data_stream(self, stream_id: int, error_code: int) -> None:
        """STOP_SENDING one of the peer's data streams for a limit of the application
        (draft-ietf-moq-transport-22 §"Resource Exhaustion": "The publisher and subscriber
        MUST cancel a stream ... after reaching a resource limit"): its later bytes are
        ignored and its request sees DataStreamClosed with ``error_code``."""
        if not self.closed:
            self._in.limit_exceeded(stream_id, error_code)

    # ======================================================================================
    # local API: requests we send
    def _check_can_request(self) -> None:
        if self.closed:
            raise RuntimeError("session closed")
        if self.peer_goaway is not None:
            # §"GOAWAY": after receiving it, no new requests.
            raise RuntimeError("the peer sent GOAWAY: no new requests")

    def _request(self, build: Callable[[int], Message]) -> int:
        self._check_can_request()
        rid = self._ids.next_id
        msg = build(rid)
        check_local_namespace(msg)
        data = encode_message(self.version, msg)
        self._ids.allocate()  # only now: a request that cannot be sent consumes no ID
        stream_id = self._open(uni=False)
        req = Request(rid, stream_id, msg.TYPE, msg, local=True,
                      reader=ControlStreamReader(self.version))
        self.requests[rid] = req
        self._by_stream[stream_id] = req
        if msg.TYPE in (FETCH_TYPE, SUBSCRIBE_TYPE):
            order = (msg.parameters.group_order
                     if isinstance(msg, Fetch | StandaloneFetch | JoiningFetch) else None)
            self._in.add_fetch_route(rid, GroupOrder(order) if order is not None else None)
        self._send(stream_id, data)
        return rid

    def request_update(self, request_id: int, parameters: MessageParameters) -> int:
        """REQUEST_UPDATE on the stream of ``request_id``; returns the update's own ID."""
        req = self._req(request_id)
        if self.closed:
            raise RuntimeError("session closed")
        upd = self._ids.allocate()
        msg = RequestUpdate(upd, parameters)
        check_request_update(self.version, msg, req.request_type, strict=True)
        req.pending_updates.append(upd)
        self._send(req.stream_id, encode_message(self.version, msg))
        return upd

    def cancel(self, request_id: int) -> None:
        """Cancel a request (unsubscribe, fetch cancel, ...): RESET_STREAM and STOP_SENDING
        with CANCELLED (§"Request Streams": there are no cancel messages since 17)."""
        if self.closed:
            return
        self._in.stop_request(request_id, StreamResetCode.CANCELLED)
        req = self.requests.get(request_id)
        if req is None:
            self.release(request_id)
            return
        self._forget(req, reset_code=StreamResetCode.CANCELLED)

    # ======================================================================================
    # local API: answering the peer's requests
    def _req(self, request_id: int) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no open request {request_id}")
        return req

    def _respond(self, request_id: int, msg: Message, *, end: bool = False) -> None:
        req = self._req(request_id)
        if req.local and req.request_type != PUBLISH_TYPE:
            raise ValueError("cannot respond to our own request")
        if req.responded and isinstance(msg, SubscribeOk | FetchOk):
            raise ValueError("request already answered")
        if self.closed:
            return
        req.responded = True
        self._send(req.stream_id, encode_message(self.version, msg), end)
        if end:
            req.send_finished = True
            self._maybe_forget(req)

    def accept_subscribe(self, request_id: int, track_alias: int,
                         parameters: MessageParameters = MessageParameters(),
                         track_properties: Sequence[tuple[int, int | bytes]] = ()) -> None:
        self._req(request_id).track_alias = track_alias
        self._respond(request_id, SubscribeOk(track_alias, parameters, kvps(track_properties)))

    def accept_fetch(self, request_id: int, end_location: tuple[int, int], *,
                     end_of_track: bool = False,
                     track_properties: Sequence[tuple[int, int | bytes]] = ()) -> None:
        self._respond(request_id, FetchOk(end_of_track, Location(*end_location),
                                          MessageParameters(), kvps(track_properties)))

    def request_ok(self, request_id: int, parameters: MessageParameters = MessageParameters(),
                   track_properties: Sequence[tuple[int, int | bytes]] = (), *,
                   end: bool = False) -> None:
        """REQUEST_OK (PUBLISH_NAMESPACE_OK, TRACK_STATUS_OK, PUBLISH_OK, REQUEST_UPDATE_OK...)."""
        self._respond(request_id, RequestOk(parameters, kvps(track_properties)), end=end)

    def reject(self, request_id: int, error_code: int, reason: str = "", *,
               retry_interval: int = 0, end: bool = True) -> None:
        """REQUEST_ERROR. With ``end`` (the default) FIN follows: the request is over.

        ``end=False`` answers a REQUEST_UPDATE of the peer (§"REQUEST_UPDATE": "The receiver
        of a REQUEST_UPDATE MUST respond with exactly one REQUEST_OK or REQUEST_ERROR")
        without ending the request, so that what the draft asks next can still be sent on
        it: PUBLISH_DONE UPDATE_FAILED for a subscription (§"Updating Subscriptions"), or
        the responder closes the stream itself (:meth:`finish_request`). The first answer
        to a request cannot be such an error (a REQUEST_ERROR there ends the request)."""
        req = self._req(request_id)
        if not end and not req.responded:
            raise ValueError("a REQUEST_ERROR answering the request itself ends it")
        self._respond(request_id, RequestError(error_code, retry_interval, reason), end=end)
        if end:
            # The request is over: whatever else the requester sends on it is ignored.
            self._forget(req, reset_code=None)

    def namespace(self, request_id: int, suffix: Sequence[bytes]) -> None:
        self._respond(request_id, Namespace(tuple(suffix)))

    def namespace_done(self, request_id: int, suffix: Sequence[bytes]) -> None:
        self._respond(request_id, NamespaceDone(tuple(suffix)))

    def publish_done(self, request_id: int, status_code: int, stream_count: int,
                     reason: str = "") -> None:
        """PUBLISH_DONE then FIN (§"PUBLISH_DONE": after every data stream is closed)."""
        req = self._req(request_id)
        self._send(req.stream_id, encode_message(
            self.version, PublishDone(status_code, stream_count, reason)), True)
        req.send_finished = True
        req.data_streams.clear()
        self._maybe_forget(req)

    def finish_request(self, request_id: int) -> None:
        """FIN our half of a request stream ("nothing more from us")."""
        req = self.requests.get(request_id)
        if req is None or req.send_finished or self.closed:
            return
        req.send_finished = True
        self._send(req.stream_id, b"", True)
        self._maybe_forget(req)

    # ======================================================================================
    # local API: data streams and datagrams we send
    def open_subgroup_stream(self, request_id: int, header: SubgroupHeader) -> int:
        """Open a subgroup stream for subscription ``request_id`` and queue its header.
        Objects are then written by the caller straight to the transport (encode them with
        :class:`~kvsp_moq.moqt.data.SubgroupStreamEncoder`)."""
        req = self._req(request_id)
        stream_id = self._open(uni=True)
        self._data_out[stream_id] = request_id
        req.data_streams.add(stream_id)
        self._send(stream_id, encode_subgroup_header(header, self.version))
        return stream_id

    def open_fetch_stream(self, request_id: int) -> int:
        req = self._req(request_id)
        stream_id = self._open(uni=True)
        self._data_out[stream_id] = request_id
        req.data_streams.add(stream_id)
        self._send(stream_id, encode_fetch_header(request_id, self.version))
        return stream_id

    def data_stream_done(self, stream_id: int) -> None:
        """The caller finished (or reset) one of our data streams."""
        rid = self._data_out.pop(stream_id, None)
        req = self.requests.get(rid) if rid is not None else None
        if req is not None:
            req.data_streams.discard(stream_id)
            self._maybe_forget(req)

    def send_datagram(self, datagram: ObjectDatagram) -> None:
        if not self.closed:
            self._actions.append(SendDatagram(_encode_datagram(datagram, self.version)))

    # ======================================================================================
    # GOAWAY (§"GOAWAY")
    def goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        if self.closed or self._control_out is None:
            raise RuntimeError("session not started or closed")
        if self.is_client and new_session_uri:
            raise ValueError("a client's GOAWAY carries no New Session URI")
        if self.goaway_sent:
            raise RuntimeError("GOAWAY already sent")
        self.goaway_sent = True
        if self.state is SessionState.ESTABLISHED:
            self.state = SessionState.DRAINING
        self._send(self._control_out, encode_message(
            self.version, GoAway(new_session_uri, timeout_ms)))

    # ======================================================================================
    # helpers
    def _open(self, uni: bool) -> int:
        """A new stream of ours: its ID is the transport's (:mod:`.streams`)."""
        return self._streams.open_uni() if uni else self._streams.open_bidi()

    def _send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self._actions.append(SendStream(stream_id, data, end))

