"""The asyncio MOQT session: :class:`MoqtSession` drives a sans-IO
:class:`~kvsp_moq.moqt.session.SessionMachine` on a transport
:class:`~kvsp_moq.transport.Connection` and offers the application API (requests:
SUBSCRIBE, FETCH, PUBLISH, PUBLISH_NAMESPACE, ...).

The transport calls this handler's callbacks; each one feeds the sans-IO session and then
:meth:`MoqtSession.pump` carries out the queued actions (send/reset/stop/datagram/close)
and dispatches the events, until both queues are empty (the shared driver,
pubsub/driver.py). The peer's requests for our tracks are answered by the session's
:class:`~.catalog_server.CatalogServer`; :func:`~.endpoints.connect` and
:func:`~.endpoints.serve` make sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from ..moqt.session import events as ev
from ..moqt.errors import PublishDoneCode, RequestErrorCode, SessionErrorCode
from ..moqt.messages import (
    AliasType,
    Location,
    Message,
    MessageParameters,
    Namespace,
    NamespaceDone,
    Publish,
    PublishDone,
    PublishNamespace,
    RequestError,
    RequestOk,
    Token,
)
from ..moqt.objects import GroupOrder, SubgroupHeader
from ..moqt.session import Role, SessionConfig
from ..moqt.session import SessionMachine
from ..moqt.version import Version
from ..transport import Connection, TransportError
from .backlog import flushed
from .catalog_server import CatalogServer
from .driver import ConnectionStreamIds, EventTable, SessionDriver, Tasks
from .errors import ErrorKind, MoqtError, SessionClosedError
from .limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from .window import subscription_window
from .publish import Catalog, TrackPublisher, Outgoing, track_name, normalize_namespace
from .receive import (
    FetchStream,
    ObjectBeginCallback,
    ObjectProgressCallback,
    ObjectStream,
    Subscription,
)
from .serve_updates import answer_update

__all__ = ["GUARD", "IncomingPublish", "MoqtSession", "NamespaceLike", "RequestGate", "TokenLike",
           "token_values"]

logger = logging.getLogger(__name__)

NamespaceLike = Sequence[str | bytes] | str | bytes
TokenLike = Token | bytes | str
#: Seconds a request waits for its answer (and ``connect`` for SETUP) by default.
GUARD = 30.0


def token_values(tokens: Iterable[Token]) -> tuple[bytes, ...]:
    """The Token Values AUTHORIZATION_TOKENs carry (USE_VALUE and REGISTER, in order).

    This layer keeps no token-alias cache (it advertises MAX_AUTH_TOKEN_CACHE_SIZE 0, so a
    peer may not register aliases): USE_ALIAS and DELETE stand for no value here."""
    return tuple(t.token_value for t in tokens
                 if t.alias_type in (AliasType.USE_VALUE, AliasType.REGISTER)
                 and t.token_value is not None)


def _as_token(t: TokenLike) -> Token:
    if isinstance(t, Token):
        return t
    return Token.use_value(0, t.encode("utf-8") if isinstance(t, str) else t)


class RequestGate(Protocol):
    """Authorization of the requests a peer opens on a :class:`MoqtSession` (``serve(gate=...)``).

    ``allows`` runs before the catalog is consulted, so a refusal (REQUEST_ERROR
    UNAUTHORIZED) is the same whether or not the track exists. ``shows`` filters the
    NAMESPACE answers of an allowed SUBSCRIBE_NAMESPACE. The peer's credentials are
    :attr:`MoqtSession.peer_setup_tokens` and ``token_values(message.parameters.authorization_tokens)``.
    """

    def allows(self, session: MoqtSession, message: Message) -> bool: ...

    def shows(self, session: MoqtSession, message: Message,
              namespace: tuple[bytes, ...]) -> bool: ...


@dataclass(frozen=True)
class IncomingPublish:
    """A track the peer started publishing to us with PUBLISH; iterate ``subscription``."""

    namespace: tuple[bytes, ...]
    name: bytes
    track_alias: int
    subscription: Subscription


class MoqtSession(SessionDriver):
    """One MOQT session (client or server), asyncio side."""

    def __init__(self, role: Role, *, catalog: Catalog | None = None,
                 session_config: SessionConfig | None = None,
                 accept_publish: bool = False, gate: RequestGate | None = None,
                 setup_tokens: Sequence[TokenLike] = (),
                 receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS) -> None:
        self.role = role
        #: What the peer may make this session hold (pubsub/limits.py).
        self.receive_limits = receive_limits
        #: Authorizes each request of the peer (None: every request is served).
        self.gate = gate
        #: AUTHORIZATION_TOKEN Setup Options our SETUP carries (bytes / str: USE_VALUE, type 0).
        self.setup_tokens: tuple[Token, ...] = tuple(_as_token(t) for t in setup_tokens)
        #: Accept the peer's PUBLISH (its tracks arrive on :attr:`incoming_publishes`);
        #: otherwise PUBLISH is answered with REQUEST_ERROR NOT_SUPPORTED.
        self.accept_publish = accept_publish
        self.incoming_publishes: asyncio.Queue[IncomingPublish] = asyncio.Queue()
        cfg = session_config or SessionConfig()
        if self.setup_tokens:
            # Our SETUP carries them after any the config names (SessionConfig holds every
            # Setup Option the sans-IO session encodes).
            cfg = replace(cfg, authorization_tokens=(*cfg.authorization_tokens,
                                                     *self.setup_tokens))
        self._session_config = cfg
        self.moqt: SessionMachine | None = None
        self.connection: Connection = None  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[tuple[int, str]] = loop.create_future()
        self.goaway_received: asyncio.Future[str] = loop.create_future()
        self._waiters: dict[int, asyncio.Future[Message]] = {}
        #: Run on the answer to one of our requests as it is dispatched, before anything
        #: the peer sent after it (see :meth:`_request`'s ``on_answer``).
        self._answer_hooks: dict[int, Callable[[Message], None]] = {}
        #: Our REQUEST_UPDATEs waiting for REQUEST_OK / REQUEST_ERROR, by the update's ID.
        self._update_waiters: dict[int, asyncio.Future[Message]] = {}
        self._streams: dict[int, ObjectStream] = {}
        #: Set whenever one of our requests stops being in flight (see :meth:`wait_idle`).
        self._released = asyncio.Event()
        #: The catalog's tracks served to the peer, and the subscriptions this session
        #: serves (pubsub/catalog_server.py).
        self.serving = CatalogServer(self, catalog if catalog is not None else Catalog(),
                                     shows=self._shows)
        self._pumping = False
        self._tasks = Tasks(logger, "pubsub task")
        self.events = self._event_table()
        #: Namespaces the peer published (PUBLISH_NAMESPACE) and not withdrawn, and
        #: NAMESPACE notifications (at most ``receive_limits.max_peer_namespaces`` /
        #: ``max_namespace_updates`` unread: pubsub/limits.py).
        self.peer_namespaces: set[tuple[bytes, ...]] = set()
        self.namespace_updates: asyncio.Queue[tuple[str, tuple[bytes, ...]]] = asyncio.Queue()
        #: The peer's PUBLISH_NAMESPACE requests: Request ID -> namespace (pruned on
        #: withdrawal, i.e. cancellation of the request: draft-22 §"PUBLISH_NAMESPACE").
        self._peer_namespace_requests: dict[int, tuple[bytes, ...]] = {}
        #: Our SUBSCRIBE_NAMESPACE requests: Request ID -> prefix.
        self._namespace_subscriptions: dict[int, tuple[bytes, ...]] = {}
        #: Our SUBSCRIBE_NAMESPACEs cancelled for an overflow (one per such request of ours).
        self._overflowed: set[int] = set()
        self._published_namespaces: dict[tuple[bytes, ...], int] = {}
        for fut in (self.ready, self.closed, self.goaway_received):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def catalog(self) -> Catalog:
        """The tracks this session serves (shared with the other sessions given it)."""
        return self.serving.catalog

    @property
    def version(self) -> Version:
        assert self.moqt is not None
        return self.moqt.version

    @property
    def peer_setup_tokens(self) -> tuple[bytes, ...]:
        """The Token Values of the AUTHORIZATION_TOKEN options of the peer's SETUP (empty
        before it arrived or without any); see :func:`token_values`."""
        setup = self.moqt.peer_setup if self.moqt is not None else None
        return token_values(setup.authorization_tokens) if setup is not None else ()

    # ======================================================================================
    # ConnectionHandler
    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.connection = conn
        config = self._session_config
        if conn.is_webtransport:  # no PATH / AUTHORITY either way (§"PATH")
            config = replace(config, webtransport=True)
        self.moqt = SessionMachine(self.role, Version.from_alpn(alpn), config,
                                   streams=ConnectionStreamIds(conn, self.role is Role.CLIENT))
        self.moqt.start()
        self.pump()

    # The transport callbacks, the pump and the actions are the shared driver's
    # (pubsub/driver.py); events are dispatched by type to the handlers below.
    def _event_table(self) -> EventTable:
        t = EventTable()
        t.on(ev.DataEvent, self._on_data)
        t.on(ev.DataStreamClosed, self._on_data_stream_closed)
        t.on(ev.SetupComplete, self._on_setup_complete)
        t.on(ev.RequestReceived, lambda e: self._on_request(e.request_id, e.message))
        t.on(ev.ResponseReceived, lambda e: self._on_response(e.request_id, e.message))
        t.on(ev.RequestMessage, lambda e: self._on_request_message(e.request_id, e.message))
        t.on(ev.RequestCancelled, lambda e: self._on_cancelled(e.request_id, e.error_code))
        t.on(ev.DatagramReceived, self._on_datagram)
        t.on(ev.UpdateAnswered, self._on_update_answered)
        # pubsub/serve_updates.py
        t.on(ev.UpdateReceived, lambda e: answer_update(
            self, self.serving.served(e.request_id), e.request_id, e.message))
        t.on(ev.DataStreamStopped, self._on_data_stream_stopped)
        t.on(ev.GoawayReceived, self._on_goaway)
        t.on(ev.SessionClosed, lambda e: self._on_closed(e.error_code, e.reason))
        return t

    def _on_data(self, e: ev.DataEvent) -> None:
        s = self._streams.get(e.request_id)
        if s is not None:
            s.feed_data(e.stream_id, e.event)

    def _on_data_stream_closed(self, e: ev.DataStreamClosed) -> None:
        s = self._streams.get(e.request_id)
        if s is not None:
            s.feed_stream_closed(e.stream_id, e.error_code)

    def _on_setup_complete(self, e: ev.SetupComplete) -> None:
        if not self.ready.done():
            self.ready.set_result(None)

    def _on_datagram(self, e: ev.DatagramReceived) -> None:
        s = self._streams.get(e.request_id)
        if s is not None:
            s.feed_datagram(e.datagram)

    def _on_update_answered(self, e: ev.UpdateAnswered) -> None:
        fut = self._update_waiters.pop(e.update_request_id, None)
        if fut is not None and not fut.done():
            if isinstance(e.message, RequestError):
                fut.set_exception(MoqtError(e.message.error_code, e.message.error_reason))
            else:
                fut.set_result(e.message)

    def _on_data_stream_stopped(self, e: ev.DataStreamStopped) -> None:
        # One stopped subgroup stream ends that stream only, not the subscription.
        track = self.serving.served(e.request_id)
        if track is not None:
            track.stream_stopped(self, e.request_id, e.stream_id)

    def _on_goaway(self, e: ev.GoawayReceived) -> None:
        if not self.goaway_received.done():
            self.goaway_received.set_result(e.message.new_session_uri)

    # ======================================================================================
    # incoming requests
    def _on_request(self, rid: int, msg: Message) -> None:
        moqt = self.moqt
        assert moqt is not None
        if moqt.goaway_sent:
            return  # already rejected with GOING_AWAY by the session
        if self.gate is not None and not self.gate.allows(self, msg):
            # Before any lookup: the answer does not tell whether the track exists.
            moqt.reject(rid, RequestErrorCode.UNAUTHORIZED, "not authorized")
            return
        if isinstance(msg, PublishNamespace):
            self._on_publish_namespace(rid, msg)
        elif self.serving.answer(rid, msg):
            pass  # SUBSCRIBE, FETCH, TRACK_STATUS, SUBSCRIBE_NAMESPACE: pubsub/catalog_server.py
        elif isinstance(msg, Publish) and self.accept_publish:
            self._accept_publish(rid, msg)
        else:
            moqt.reject(rid, RequestErrorCode.NOT_SUPPORTED, f"{msg.NAME} not supported")

    def _on_publish_namespace(self, rid: int, msg: PublishNamespace) -> None:
        moqt = self.moqt
        assert moqt is not None
        limits = self.receive_limits
        if (len(self._peer_namespace_requests) >= limits.max_peer_namespaces
                or self.namespace_updates.qsize() >= limits.max_namespace_updates):
            # draft-22 §"REQUEST_ERROR Codes": EXCESSIVE_LOAD (pubsub/limits.py).
            moqt.reject(rid, RequestErrorCode.EXCESSIVE_LOAD,
                        "too many namespaces published on this session")
            return
        self._peer_namespace_requests[rid] = msg.track_namespace
        self.peer_namespaces.add(msg.track_namespace)
        moqt.request_ok(rid)
        self.namespace_updates.put_nowait(("publish_namespace", msg.track_namespace))

    def _peer_namespace_withdrawn(self, rid: int) -> None:
        """The peer cancelled its PUBLISH_NAMESPACE ``rid`` (withdrawal, draft-22
        §"PUBLISH_NAMESPACE"): forget the namespace unless another request publishes it."""
        ns = self._peer_namespace_requests.pop(rid, None)
        if ns is None:
            return
        if ns not in self._peer_namespace_requests.values():
            self.peer_namespaces.discard(ns)
        if self.namespace_updates.qsize() < self.receive_limits.max_namespace_updates:
            self.namespace_updates.put_nowait(("publish_namespace_done", ns))

    def _shows(self, msg: Message, namespace: tuple[bytes, ...]) -> bool:
        """Whether a NAMESPACE answer to the peer's SUBSCRIBE_NAMESPACE may be sent."""
        return self.gate is None or self.gate.shows(self, msg, namespace)

    def _accept_publish(self, rid: int, msg: Publish) -> None:
        """The peer starts a subscription from its side (§"PUBLISH"): answer REQUEST_OK
        (PUBLISH_OK before draft 18), and if it published with FORWARD=0 ask it to forward
        with REQUEST_UPDATE FORWARD=1. Its objects arrive on a :class:`Subscription` (the
        session routes its Track Alias to this request), handed out on
        :attr:`incoming_publishes`."""
        moqt = self.moqt
        assert moqt is not None
        if self.incoming_publishes.qsize() >= self.receive_limits.max_incoming_publishes:
            # Nobody reads them: draft-22 §"REQUEST_ERROR Codes" EXCESSIVE_LOAD.
            moqt.reject(rid, RequestErrorCode.EXCESSIVE_LOAD, "too many PUBLISHes unread")
            return
        sub = Subscription(self, rid, self.receive_limits)
        self._streams[rid] = sub
        moqt.request_ok(rid)
        if msg.parameters.forward is False:
            moqt.request_update(rid, MessageParameters(forward=True))
        self.incoming_publishes.put_nowait(
            IncomingPublish(msg.track_namespace, msg.track_name, msg.track_alias, sub))

    def _on_cancelled(self, rid: int, code: int) -> None:
        self._peer_namespace_withdrawn(rid)
        self._namespace_subscriptions.pop(rid, None)
        track = self.serving.discard(rid)
        if track is not None:
            track.remove_subscriber(self, rid)
        stream = self._streams.get(rid)
        if stream is not None:
            stream.feed_cancelled(code)
        self._answer_hooks.pop(rid, None)
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(MoqtError(code, "request cancelled", ErrorKind.STREAM))
        self._released.set()

    # ======================================================================================
    # responses to our requests
    def _on_response(self, rid: int, msg: Message) -> None:
        hook = self._answer_hooks.pop(rid, None)
        if hook is not None:
            hook(msg)
        stream = self._streams.get(rid)
        if stream is not None:
            stream.feed_response(msg)
            if isinstance(msg, RequestError):
                stream.feed_end(MoqtError(msg.error_code, msg.error_reason))
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        self._released.set()

    def _on_request_message(self, rid: int, msg: Message) -> None:
        if isinstance(msg, PublishDone):
            stream = self._streams.get(rid)
            if isinstance(stream, Subscription):
                stream.feed_publish_done(msg)
        elif isinstance(msg, Namespace):
            self._namespace_update(rid, "namespace", msg.track_namespace_suffix)
        elif isinstance(msg, NamespaceDone):
            self._namespace_update(rid, "namespace_done", msg.track_namespace_suffix)

    def _namespace_update(self, rid: int, kind: str, suffix: tuple[bytes, ...]) -> None:
        """A NAMESPACE / NAMESPACE_DONE of our SUBSCRIBE_NAMESPACE ``rid``. Beyond
        ``max_namespace_updates`` unread the subscription is cancelled (draft-22 §"Resource
        Exhaustion"; pubsub/limits.py) and ``("overflow", prefix)`` ends its updates."""
        if rid in self._overflowed:
            return  # cancelled for an overflow: what was already parsed for it is dropped
        if self.namespace_updates.qsize() < self.receive_limits.max_namespace_updates:
            self.namespace_updates.put_nowait((kind, suffix))
            return
        prefix = self._namespace_subscriptions.pop(rid, ())
        self._overflowed.add(rid)
        logger.warning("SUBSCRIBE_NAMESPACE %d cancelled: %d namespace updates unread", rid,
                       self.namespace_updates.qsize())
        self.drop_request(rid)
        self.namespace_updates.put_nowait(("overflow", prefix))

    def stop_data_stream(self, stream_id: int, error_code: int) -> None:
        """STOP_SENDING one of the peer's data streams (an ObjectStream's limit); its
        DataStreamClosed follows."""
        if self.moqt is not None:
            self.moqt.stop_data_stream(stream_id, error_code)
            self.pump()

    def stream_finished(self, request_id: int) -> None:
        """The object stream of our request ``request_id`` ended: forget its routing."""
        self._streams.pop(request_id, None)
        self._released.set()
        if self.moqt is not None:
            self.moqt.release(request_id)

    def _on_closed(self, code: int, reason: str) -> None:
        err = SessionClosedError(code, reason)
        for fut in list(self._waiters.values()) + list(self._update_waiters.values()):
            if not fut.done():
                fut.set_exception(err)
        self._waiters.clear()
        self._answer_hooks.clear()
        self._update_waiters.clear()
        self._peer_namespace_requests.clear()
        self._namespace_subscriptions.clear()
        for stream in list(self._streams.values()):
            stream.feed_end(err)
        for rid, track in self.serving.discard_all():
            track.remove_subscriber(self, rid)
        if not self.ready.done():
            self.ready.set_exception(err)
        if not self.closed.done():
            self.closed.set_result((code, reason))
        self._released.set()

    # ======================================================================================
    # application API
    def _check_open(self) -> SessionMachine:
        moqt = self.moqt
        if moqt is None or moqt.closed:
            code = moqt.close_code if moqt is not None and moqt.close_code is not None else 0
            raise SessionClosedError(code, "session closed")
        if moqt.peer_goaway is not None:
            raise MoqtError(RequestErrorCode.GOING_AWAY, "the peer sent GOAWAY", ErrorKind.LOCAL)
        return moqt

    async def _request(self, start: Callable[[SessionMachine], int],
                       stream: Callable[[int], ObjectStream] | None = None,
                       timeout: float = GUARD,
                       on_answer: Callable[[int, Message], None] | None = None,
                       ) -> tuple[int, Message, ObjectStream | None]:
        """Send a request and wait for its answer. ``on_answer(request_id, answer)`` runs
        synchronously when the answer is dispatched, before any later event of the same
        read: the caller resumes only after those (e.g. a REQUEST_UPDATE the peer sent right
        behind its REQUEST_OK), so state they act on must be in place by then."""
        moqt = self._check_open()
        rid = start(moqt)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        if on_answer is not None:
            self._answer_hooks[rid] = lambda msg: on_answer(rid, msg)
        obj = None
        if stream is not None:
            obj = stream(rid)
            self._streams[rid] = obj
        self.pump()
        try:
            msg = await asyncio.wait_for(fut, timeout)
        except BaseException:
            self._waiters.pop(rid, None)
            self._answer_hooks.pop(rid, None)
            if obj is not None:
                self._streams.pop(rid, None)
            self._released.set()
            raise
        if isinstance(msg, RequestError):
            raise MoqtError(msg.error_code, msg.error_reason, ErrorKind.REQUEST)
        return rid, msg, obj

    async def publish_namespace(self, namespace: NamespaceLike, *,
                                parameters: MessageParameters = MessageParameters()) -> int:
        """PUBLISH_NAMESPACE; returns its Request ID on REQUEST_OK, raises
        :class:`MoqtError` otherwise. Withdraw it with :meth:`withdraw_namespace`.
        ``parameters``: e.g. ``authorization_tokens``."""
        ns = normalize_namespace(namespace)
        rid, _, _ = await self._request(lambda m: m.publish_namespace(ns, parameters))
        self._published_namespaces[ns] = rid
        return rid

    def withdraw_namespace(self, namespace: NamespaceLike) -> bool:
        """Withdraw a namespace we published: cancel its PUBLISH_NAMESPACE request
        (draft-20 §"Publishing Namespaces": withdrawal is request cancellation). False if
        it was not published on this session (or the session is closed)."""
        rid = self._published_namespaces.pop(normalize_namespace(namespace), None)
        if rid is None or self.moqt is None or self.moqt.closed:
            return False
        self.drop_request(rid)
        return True

    async def subscribe_namespace(self, prefix: NamespaceLike, *,
                                  parameters: MessageParameters = MessageParameters()) -> int:
        """SUBSCRIBE_NAMESPACE; returns its Request ID once REQUEST_OK arrived. NAMESPACE /
        NAMESPACE_DONE arrive on :attr:`namespace_updates`; end it with
        :meth:`cancel_request`."""
        ns = normalize_namespace(prefix)

        def established(rid: int, ok: Message) -> None:
            # Before any NAMESPACE behind the REQUEST_OK is dispatched.
            if isinstance(ok, RequestOk):
                self._namespace_subscriptions[rid] = ns

        rid, _, _ = await self._request(lambda m: m.subscribe_namespace(ns, parameters),
                                        on_answer=established)
        return rid

    async def track_status(self, namespace: NamespaceLike, name: str | bytes, *,
                           parameters: MessageParameters = MessageParameters()) -> Message:
        """TRACK_STATUS; returns the REQUEST_OK (LARGEST_OBJECT, Track Properties).
        ``parameters``: request parameters, e.g. ``authorization_tokens``."""
        ns = normalize_namespace(namespace)
        return (await self._request(lambda m: m.track_status(ns, track_name(name), parameters)))[1]

    async def subscribe_tracks(self, prefix: NamespaceLike, *, forward: bool = True,
                               parameters: MessageParameters = MessageParameters()) -> int:
        """SUBSCRIBE_TRACKS (draft 18+, §"SUBSCRIBE_TRACKS"): the peer PUBLISHes every track
        under ``prefix``, now and later; they arrive on :attr:`incoming_publishes` (the
        session must accept PUBLISH: ``connect(..., accept_publish=True)``). ``forward``
        False asks for the PUBLISHes in Forward State 0 (§"FORWARD"). Returns the Request
        ID on REQUEST_OK; end it with :meth:`cancel_request`."""
        if not self.accept_publish:
            raise ValueError("SUBSCRIBE_TRACKS needs a session that accepts PUBLISH")
        ns = normalize_namespace(prefix)
        params = parameters if forward else replace(parameters, forward=False)
        rid, _, _ = await self._request(lambda m: m.subscribe_tracks(ns, params))
        return rid

    async def publish(self, track: TrackPublisher, *, forward: bool = True,
                      track_alias: int | None = None,
                      parameters: MessageParameters = MessageParameters()) -> int:
        """PUBLISH ``track`` to the peer (§"PUBLISH"): a subscription we start, with no
        filter; once REQUEST_OK (PUBLISH_OK) arrives the track's writes go to it like to any
        subscriber. ``forward`` False: FORWARD=0, nothing is sent until the peer's
        REQUEST_UPDATE sets FORWARD=1. ``track_alias``: the Track Alias to use (the
        publisher chooses it, §"Track Alias"; default: the session's next one). Returns the
        Request ID; end it with :meth:`end_publish` (or ``track.finish()``, which ends every
        subscription)."""
        self._check_open()
        if track_alias is None:
            alias = self.serving.next_alias()
        else:
            alias = track_alias
            self.serving.reserve_alias(alias)
        params = replace(parameters, forward=forward)
        if track.largest is not None and params.largest_object is None:
            params = replace(params, largest_object=Location(*track.largest))

        def established(rid: int, ok: Message) -> None:
            # Serve the subscription as REQUEST_OK is dispatched, not when this coroutine
            # resumes: a REQUEST_UPDATE the peer sent right behind it (a relay pausing the
            # PUBLISH with FORWARD=0, §"Publisher Interactions") is dispatched in between
            # and must find the subscription, or it would be answered but not applied.
            if not isinstance(ok, RequestOk):
                return
            forward_now = forward if ok.parameters.forward is None else ok.parameters.forward
            self.serving.add(rid, track)
            track.add_subscriber(Outgoing(self, rid, alias,
                                 window=subscription_window(None, track.largest),
                                 forward=forward_now))
            served.append(rid)

        served: list[int] = []
        try:
            rid, _, _ = await self._request(lambda m: m.publish(
                track.namespace, track.name, alias, params, track.response_properties()),
                on_answer=established)
        except BaseException:
            if served:  # cancelled after REQUEST_OK: nobody else can end it (best effort;
                # the original exception is what the caller gets)
                with contextlib.suppress(Exception):
                    self.end_publish(served[0], PublishDoneCode.INTERNAL_ERROR, "abandoned")
            raise
        return rid

    def end_publish(self, request_id: int, status: int = PublishDoneCode.TRACK_ENDED,
                    reason: str = "") -> None:
        """End one subscription we serve (our PUBLISH, or the peer's SUBSCRIBE): FIN its
        data stream, then PUBLISH_DONE ``status`` with its exact Stream Count."""
        track = self.serving.served(request_id)
        out = track.outgoing(self, request_id) if track is not None else None
        if track is None or out is None:
            raise KeyError(f"no subscription {request_id} served on this session")
        track.complete_soon(out, status, reason)

    def cancel_request(self, request_id: int) -> None:
        """Cancel one of our requests by its Request ID (SUBSCRIBE_NAMESPACE,
        SUBSCRIBE_TRACKS, PUBLISH_NAMESPACE, ...): RESET_STREAM / STOP_SENDING CANCELLED
        (§"Request Cancellation"; drafts 17+ have no cancel messages)."""
        for ns, rid in list(self._published_namespaces.items()):
            if rid == request_id:
                del self._published_namespaces[ns]
        self._namespace_subscriptions.pop(request_id, None)
        stream = self._streams.get(request_id)
        self.drop_request(request_id)
        if stream is not None:
            stream.feed_end()

    async def subscribe(self, namespace: NamespaceLike, name: str | bytes, *,
                        parameters: MessageParameters = MessageParameters(),
                        on_object_begin: ObjectBeginCallback | None = None,
                        on_object_progress: ObjectProgressCallback | None = None,
                        on_response: Callable[[Message], None] | None = None
                        ) -> Subscription:
        """SUBSCRIBE; returns the :class:`Subscription` once SUBSCRIBE_OK arrived. ``on_response``
        as :meth:`fetch`'s (the native transport registers destinations by Track Alias then)."""
        ns = normalize_namespace(namespace)

        def make(rid: int) -> ObjectStream:
            s = Subscription(self, rid, self.receive_limits)
            s.on_object_begin = on_object_begin
            s.on_object_progress = on_object_progress
            return s

        hook = None if on_response is None else lambda _rid, msg: on_response(msg)
        _, _, sub = await self._request(lambda m: m.subscribe(ns, track_name(name), parameters),
                                        make, on_answer=hook)
        assert isinstance(sub, Subscription)
        return sub

    async def fetch(self, namespace: NamespaceLike, name: str | bytes, *,
                    start: tuple[int, int] = (0, 0), end: tuple[int, int] | None = None,
                    group_order: GroupOrder | None = None,
                    subscriber_priority: int | None = None,
                    parameters: MessageParameters = MessageParameters(),
                    on_object_begin: ObjectBeginCallback | None = None,
                    on_object_progress: ObjectProgressCallback | None = None,
                    on_response: Callable[[Message], None] | None = None,
                    on_request: Callable[[int], None] | None = None) -> FetchStream:
        """FETCH objects ``start`` .. ``end`` (inclusive; None: to the largest object), groups
        in ``group_order`` (None: the publisher's, ascending here), at
        ``subscriber_priority`` (§"SUBSCRIBER PRIORITY": relative to the session's other
        subscriptions and fetch responses; None: default 128). ``parameters``: any other
        request parameter (e.g. ``authorization_tokens``); the keywords override it.
        ``on_response(answer)`` runs synchronously when FETCH_OK (or REQUEST_ERROR) is
        dispatched, before the objects read behind it reach ``on_object_begin``.
        ``on_request(request_id)`` runs once the FETCH has its Request ID, before it is sent
        (the native transport registers the objects' destinations then)."""
        ns = normalize_namespace(namespace)
        params = parameters
        if group_order:
            params = replace(params, group_order=group_order)
        if subscriber_priority is not None:
            params = replace(params, subscriber_priority=subscriber_priority)

        def make(rid: int) -> ObjectStream:
            s = FetchStream(self, rid, self.receive_limits)
            s.on_object_begin = on_object_begin
            s.on_object_progress = on_object_progress
            if on_request is not None:
                on_request(rid)
            return s

        _, _, f = await self._request(
            lambda m: m.fetch(ns, track_name(name), start, end, parameters=params), make,
            on_answer=None if on_response is None else lambda _rid, msg: on_response(msg))
        assert isinstance(f, FetchStream)
        return f

    async def joining_fetch(self, subscription: Subscription, joining_start: int, *,
                            absolute: bool = False,
                            parameters: MessageParameters = MessageParameters(),
                            on_object_begin: ObjectBeginCallback | None = None
                            ) -> FetchStream:
        """Draft-18 Joining FETCH (§"Joining Fetches") of ``subscription``: the objects
        before its Joining Location, from ``joining_start`` groups back (Relative) or from
        group ``joining_start`` (``absolute``). Drafts 20+ replaced it with fill fetch
        streams (SUBSCRIBE with FILL_PARAMETERS): ValueError there."""

        def make(rid: int) -> ObjectStream:
            s = FetchStream(self, rid, self.receive_limits)
            s.on_object_begin = on_object_begin
            return s

        _, _, f = await self._request(lambda m: m.joining_fetch(
            subscription.request_id, joining_start, absolute=absolute, parameters=parameters),
            make)
        assert isinstance(f, FetchStream)
        return f

    def update_request(self, request_id: int,
                       parameters: MessageParameters) -> asyncio.Future[Message]:
        """REQUEST_UPDATE on our request ``request_id`` (any updatable request: SUBSCRIBE,
        FETCH, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS, or a PUBLISH we
        received), sent now, even before the request was answered (the answer then follows
        the request's own). The future resolves to the REQUEST_OK or fails with
        :class:`MoqtError` (REQUEST_ERROR's code, or the session closing). See
        :meth:`ObjectStream.update <kvsp_moq.pubsub.receive.ObjectStream.update>`."""
        moqt = self.moqt
        if moqt is None or moqt.closed:
            code = moqt.close_code if moqt is not None and moqt.close_code is not None else 0
            raise SessionClosedError(code, "session closed")
        if request_id not in moqt.requests:
            raise MoqtError(RequestErrorCode.INTERNAL_ERROR,
                            f"request {request_id} is over", ErrorKind.LOCAL)
        upd = moqt.request_update(request_id, parameters)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # may go unawaited
        self._update_waiters[upd] = fut
        self.pump()
        return fut

    @property
    def max_datagram_size(self) -> int:
        """The largest OBJECT_DATAGRAM (header and payload) this session can send: the
        peer's ``max_datagram_frame_size`` within one QUIC packet."""
        return self.connection.max_datagram_payload

    def create_track(self, namespace: NamespaceLike, name: str | bytes, **kw: object
                     ) -> TrackPublisher:
        """A track served to this session's (and the catalog's other sessions') subscribers."""
        return self.catalog.create(namespace, name, **kw)

    async def goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        moqt = self.moqt
        if moqt is None or moqt.closed:
            raise SessionClosedError(0, "session closed")
        moqt.goaway(new_session_uri, timeout_ms)
        self.pump()

    @property
    def requests_in_flight(self) -> int:
        """Our requests not over yet: waiting for their answer, or receiving objects."""
        return len(self._waiters) + len(self._streams)

    async def wait_idle(self) -> None:
        """Return once none of our requests is in flight (:attr:`requests_in_flight` is 0),
        or the session closed; at once if so already."""
        while self.requests_in_flight and not self.closed.done():
            self._released.clear()
            await self._released.wait()

    async def close_when_idle(self) -> None:
        """Close the session once none of our requests is in flight on it, or return when the
        peer closed it first (after a GOAWAY: what is in flight finishes here, new requests go
        to the new session)."""
        idle = asyncio.ensure_future(self.wait_idle())
        closed = asyncio.shield(self.closed)  # cancelling the shield spares the future
        either: set[asyncio.Future[Any]] = {idle, closed}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        closed.cancel()
        if not self.closed.done():
            await self.close()

    async def drain(self) -> None:
        """Wait until the peer acknowledged everything sent on this session's streams (call
        before :meth:`close` after publishing: a close discards unsent data)."""
        if self.moqt is not None and not self.moqt.closed:
            await flushed(self)  # bytes still waiting for a slow subscriber (pubsub.backlog)
            await self.connection.drain()

    async def close(self, error_code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        if self.moqt is not None:
            self.moqt.close(error_code, reason)
            self.pump()
        if self.connection is not None:
            await self.connection.wait_closed()

    async def wait_closed(self) -> tuple[int, str]:
        return await self.closed

    async def __aenter__(self) -> MoqtSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- used by TrackPublisher / streams ----------------------------------------------------
    def open_subgroup(self, rid: int, header: SubgroupHeader) -> int:
        assert self.moqt is not None
        sid = self.moqt.open_subgroup_stream(rid, header)
        self.pump()
        return sid

    def send_datagram(self, data: bytes) -> None:
        if self.moqt is not None and not self.moqt.closed:
            try:
                self.connection.send_datagram(data)
            except TransportError:
                pass  # the connection is going away: datagrams are unreliable anyway

    def data_stream_done(self, sid: int) -> None:
        if self.moqt is not None and not self.moqt.closed:
            self.moqt.data_stream_done(sid)
            self.pump()

    def publish_done(self, rid: int, status: int, count: int, reason: str) -> None:
        moqt = self.moqt
        if moqt is not None and not moqt.closed and rid in moqt.requests:
            moqt.publish_done(rid, status, count, reason)
            self.serving.discard(rid)
            self.pump()

    def drop_request(self, rid: int) -> None:
        if self.moqt is not None:
            self.moqt.cancel(rid)
            self.pump()
        self._streams.pop(rid, None)
        self._released.set()

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task of this session (failures logged)."""
        self._tasks.spawn(coro)
