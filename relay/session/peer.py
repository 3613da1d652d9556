"""The per-session handler: one :class:`PeerSession` per QUIC connection (downstream
clients, publishers, and our own connection to an upstream relay).

It drives a sans-IO :class:`kvsp_moq.moqt.session.SessionMachine` on a transport
:class:`~kvsp_moq.transport.Connection` (as ``kvsp_moq.pubsub`` does), but gives the relay
every request: requests the peer opens go to :meth:`Relay.on_request`; each request (ours
or the peer's) that needs more than one answer has a :class:`RequestHandler` registered
under its Request ID, which receives the responses, messages, data events and cancellation
for it. Payload chunks reach the handlers as memoryviews of the received bytes (not copied).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Protocol

from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode
from kvsp_moq.moqt.messages import Message, MessageParameters, RequestUpdate, Token
from kvsp_moq.moqt.objects import ObjectDatagram
from kvsp_moq.moqt.session import Role, SessionConfig
from kvsp_moq.moqt.session import SessionMachine
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub.driver import ConnectionStreamIds, EventTable, SessionDriver, apply_action
from kvsp_moq.transport import Connection

from .sender import SessionSender
from ..ops.tokens import TokenCache

if TYPE_CHECKING:  # pragma: no cover
    from kvsp_moq.moqt.messages import Setup

    from ..ops.auth import Principal
    from ..ops.config import RelayConfig

__all__ = ["HeldUpdates", "NamespaceRequestHandler", "PeerSession", "RequestHandler",
           "SessionGate", "SessionOwner"]


@dataclass(slots=True)
class HeldUpdates:
    """REQUEST_UPDATEs of a request that could not be applied yet, coalesced (draft-22
    §"REQUEST_UPDATE": "A receiver of multiple REQUEST_UPDATE messages on the same stream
    MAY coalesce their processing by applying only the cumulative result. Parameter values
    from later REQUEST_UPDATE messages override values from earlier ones"): ``count``
    answers are owed (one REQUEST_OK each, or one REQUEST_ERROR for all)."""

    count: int
    parameters: MessageParameters

    def add(self, later: MessageParameters) -> None:
        changed = {f.name: getattr(later, f.name) for f in fields(later)
                   if getattr(later, f.name) != f.default}
        self.parameters = replace(self.parameters, **changed)
        self.count += 1

logger = logging.getLogger(__name__)


class RequestHandler:
    """Callbacks for one request on one session; all no-ops by default."""

    def on_response(self, msg: Message) -> None:
        """First response to our request (SUBSCRIBE_OK, FETCH_OK, REQUEST_OK/ERROR)."""

    def on_message(self, msg: Message) -> None:
        """PUBLISH_DONE, NAMESPACE, NAMESPACE_DONE, ... on the request stream."""

    def on_data(self, stream_id: int, event: object) -> None:
        """Data-plane event of our subscription / fetch."""

    def on_datagram(self, datagram: ObjectDatagram) -> None:
        """An OBJECT_DATAGRAM of our subscription (or of the peer's PUBLISH)."""

    def on_stream_closed(self, stream_id: int, code: int | None) -> None:
        """One of its data streams ended (FIN: None; reset: the code)."""

    def on_stream_stopped(self, stream_id: int, code: int) -> None:
        """The peer sent STOP_SENDING on a data stream we send for this request."""

    #: Whether :meth:`on_update` applies and answers REQUEST_UPDATEs. While the handler of
    #: a request does not (none yet, or one that waits, e.g. for the upstream subscription),
    #: its updates are held by the session (:meth:`PeerSession.take_updates`).
    takes_updates = False

    def on_update(self, msg: RequestUpdate) -> None:
        """The peer sent REQUEST_UPDATE for this request (it answers REQUEST_OK/ERROR)."""

    def on_finished(self) -> None:
        """The peer FIN'd its half of the request stream."""

    def on_cancelled(self, code: int) -> None:
        """The peer reset / stopped the request stream (cancellation)."""

    def on_session_closed(self, peer: PeerSession) -> None:
        """The session ended."""


class NamespaceRequestHandler(RequestHandler):
    """A handler of the peer's PUBLISH_NAMESPACE / SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS
    (attributes ``peer`` and ``rid``). Their REQUEST_UPDATEs change nothing the relay keeps
    (token aliases are applied by the gate first): REQUEST_OK. A new
    TRACK_NAMESPACE_PREFIX (§"Updating Namespace Subscriptions") is not supported:
    REQUEST_ERROR NOT_SUPPORTED, then the stream is closed, as §"Updating Subscriptions"
    requires for a failed update of these requests; :meth:`on_update_failed` cleans up."""

    peer: PeerSession
    rid: int
    takes_updates = True

    def on_update(self, msg: RequestUpdate) -> None:
        moqt = self.peer.moqt
        if moqt is None or moqt.closed or self.rid not in moqt.requests:
            return
        if msg.parameters.track_namespace_prefix is not None:
            self.peer.served.pop(self.rid, None)
            moqt.reject(self.rid, RequestErrorCode.NOT_SUPPORTED,
                        "changing the Track Namespace Prefix is not supported")
            self.peer.flush()
            self.on_update_failed()
            return
        moqt.request_ok(self.rid)
        self.peer.flush()

    def on_update_failed(self) -> None:
        """The request ended after a failed update (the relay closed its stream)."""
        self.on_cancelled(RequestErrorCode.NOT_SUPPORTED)


class SessionGate(Protocol):
    """The authorization checks a session asks for (:class:`relay.ops.gate.Gate`)."""

    def on_setup(self, peer: PeerSession, setup: Setup) -> bool: ...

    def on_request_update(self, peer: PeerSession, msg: RequestUpdate) -> None: ...


class SessionOwner(Protocol):
    """What a :class:`PeerSession` asks of the relay that owns it (:class:`relay.core.Relay`):
    its configuration, its gate, and the session's requests and events."""

    @property
    def config(self) -> RelayConfig: ...

    @property
    def gate(self) -> SessionGate: ...

    def on_request(self, peer: PeerSession, rid: int, msg: Message) -> None: ...

    def on_setup(self, peer: PeerSession, setup: Setup) -> None: ...

    def on_goaway(self, peer: PeerSession) -> None: ...

    def on_session_closed(self, peer: PeerSession) -> None: ...


class PeerSession(SessionDriver):
    """One MOQT session of the relay."""

    def __init__(self, relay: SessionOwner, role: Role,
                 session_config: SessionConfig | None = None, *, upstream: bool = False) -> None:
        self.relay = relay
        self.role = role
        self.upstream = upstream
        self._session_config = session_config or SessionConfig(implementation="kvsp-moq-relay")
        self.moqt: SessionMachine | None = None
        self.connection: Connection = None  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[tuple[int, str]] = loop.create_future()
        for fut in (self.ready, self.closed):
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        #: Handlers of the requests we sent (by our Request ID).
        self.local: dict[int, RequestHandler] = {}
        #: Handlers of the peer's requests we are answering (by its Request ID).
        self.served: dict[int, RequestHandler] = {}
        self.goaway_received = False
        #: The New Session URI of the peer's GOAWAY ("" : none, or no GOAWAY yet).
        self.goaway_uri = ""
        #: REQUEST_UPDATEs of the peer's requests whose handler cannot apply them yet.
        self.held_updates: dict[int, HeldUpdates] = {}
        self._aliases = 0
        self._pumping = False
        self.events = self._event_table()
        #: Token aliases the peer registered (we advertise the cache size to downstream
        #: peers only) and the principals its SETUP tokens named.
        self.tokens = TokenCache(0 if upstream else relay.config.auth_token_cache_size)
        self.principals: list[Principal] = []
        self.alpn = ""
        self.opened_at = 0.0
        #: Our SUBSCRIBE_NAMESPACE to this peer when the relay solicits its namespaces
        #: (a :class:`relay.subscribe.solicit.Solicitation`), else None.
        self.solicitation: RequestHandler | None = None
        self._sender: SessionSender | None = None

    def __repr__(self) -> str:
        addr = self.connection.remote_address if self.connection is not None else None
        return f"<PeerSession {self.role.value} {addr}>"

    @property
    def version(self) -> Version:
        assert self.moqt is not None
        return self.moqt.version

    @property
    def is_open(self) -> bool:
        return self.moqt is not None and not self.moqt.closed and not self.closed.done()

    @property
    def address(self) -> str:
        """``host:port`` of the peer (for logs)."""
        addr = self.connection.remote_address if self.connection is not None else None
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    @property
    def sender(self) -> SessionSender:
        """Every data stream the relay sends on this session, scheduled by priority
        (relay/session/sender.py); made on first use."""
        if self._sender is None:
            self._sender = SessionSender(self)
        return self._sender

    def next_alias(self) -> int:
        """Track Aliases we hand out on this session (SUBSCRIBE_OK), one per subscription."""
        a = self._aliases
        self._aliases += 1
        return a

    # -- ConnectionHandler -------------------------------------------------------------------
    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.connection = conn
        self.alpn = alpn
        version = Version.from_alpn(alpn)
        cfg = self.relay.config
        setup = self._session_config
        if self.upstream:
            token = cfg.auth.upstream_token if cfg.auth is not None else None
            if token:
                setup = replace(setup, authorization_tokens=(*setup.authorization_tokens,
                                                             Token.use_value(0, token)))
        else:
            # The sans-IO session refuses a downstream peer's requests beyond the relay's cap
            # itself (EXCESSIVE_LOAD with a Retry Interval; relay/session/limits.py).
            setup = replace(setup, max_auth_token_cache_size=cfg.auth_token_cache_size,
                            max_concurrent_requests=cfg.max_requests_per_session)
        if conn.is_webtransport:  # no PATH / AUTHORITY either way (MOQT §"PATH")
            setup = replace(setup, webtransport=True)
        self.moqt = SessionMachine(self.role, version, setup, streams=ConnectionStreamIds(
            conn, self.role is Role.CLIENT))
        self.moqt.start()
        self.pump()

    # Transport callbacks, the pump and the actions: the shared driver (pubsub/driver.py);
    # events are dispatched by type (its EventTable) to the handlers below.
    def dispatch(self, e: ev.Event) -> None:
        try:
            self.events.dispatch(e)
        except Exception:  # a relay bug must not take the session's peers down
            logger.exception("relay: handling %r failed", e)

    def _event_table(self) -> EventTable:
        t = EventTable()
        # Data arrives for our subscriptions / fetches (local) and for the peer's PUBLISHes
        # (served; Request IDs of the two sides never collide).
        t.on(ev.DataEvent, self._on_data)
        t.on(ev.DataStreamClosed, self._on_data_stream_closed)
        t.on(ev.RequestReceived, self._on_request)
        t.on(ev.ResponseReceived, self._on_response)
        t.on(ev.UpdateReceived, self._on_update)
        t.on(ev.DatagramReceived, self._on_datagram)
        t.on(ev.RequestMessage, self._on_request_message)
        t.on(ev.RequestFinished, self._on_request_finished)
        t.on(ev.RequestCancelled, self._on_cancelled)
        t.on(ev.DataStreamStopped, self._on_data_stream_stopped)
        t.on(ev.SetupComplete, self._on_setup_complete)
        t.on(ev.GoawayReceived, self._on_goaway)
        t.on(ev.SessionClosed, lambda e: self._on_closed(e.error_code, e.reason))
        return t

    def _handler(self, rid: int) -> RequestHandler | None:
        return self.local.get(rid) or self.served.get(rid)

    def _on_data(self, e: ev.DataEvent) -> None:
        h = self._handler(e.request_id)
        if h is not None:
            h.on_data(e.stream_id, e.event)

    def _on_data_stream_closed(self, e: ev.DataStreamClosed) -> None:
        h = self._handler(e.request_id)
        if h is not None:
            h.on_stream_closed(e.stream_id, e.error_code)

    def _on_request(self, e: ev.RequestReceived) -> None:
        if self.moqt is not None and self.moqt.goaway_sent:
            return  # the session already answered GOING_AWAY
        self.relay.on_request(self, e.request_id, e.message)

    def _on_response(self, e: ev.ResponseReceived) -> None:
        h = self.local.get(e.request_id)
        if h is not None:
            h.on_response(e.message)

    def _on_update(self, e: ev.UpdateReceived) -> None:
        # REQUEST_UPDATE may REGISTER / DELETE token aliases (draft-20
        # §"AUTHORIZATION TOKEN Parameter"); then the request's handler applies it
        # (subscriber priority, forward, filter: §"REQUEST_UPDATE").
        if isinstance(e.message, RequestUpdate):
            self.relay.gate.on_request_update(self, e.message)
            if self.moqt is None or self.moqt.closed:
                return
            h = self._handler(e.request_id)
            if h is not None and h.takes_updates:
                h.on_update(e.message)
            else:
                self._hold_update(e.request_id, e.message)

    def _on_datagram(self, e: ev.DatagramReceived) -> None:
        h = self._handler(e.request_id)
        if h is not None:
            h.on_datagram(e.datagram)

    def _on_request_message(self, e: ev.RequestMessage) -> None:
        h = self._handler(e.request_id)
        if h is not None:
            h.on_message(e.message)

    def _on_request_finished(self, e: ev.RequestFinished) -> None:
        h = self._handler(e.request_id)
        if h is not None:
            h.on_finished()

    def _on_cancelled(self, e: ev.RequestCancelled) -> None:
        h = self.local.pop(e.request_id, None) or self.served.pop(e.request_id, None)
        if h is not None:
            h.on_cancelled(e.error_code)

    def _on_data_stream_stopped(self, e: ev.DataStreamStopped) -> None:
        h = self.served.get(e.request_id)
        if h is not None:
            h.on_stream_stopped(e.stream_id, e.error_code)

    def _on_setup_complete(self, e: ev.SetupComplete) -> None:
        if not self.upstream and not self.relay.gate.on_setup(self, e.peer_setup):
            return
        if not self.ready.done():
            self.ready.set_result(None)
        if not self.upstream:
            # e.g. SUBSCRIBE_NAMESPACE to a publisher that waits to be solicited
            # (relay/subscribe/solicit.py); the peer's Setup Options are in e.peer_setup.
            self.relay.on_setup(self, e.peer_setup)

    def _on_goaway(self, e: ev.GoawayReceived) -> None:
        self.goaway_received = True
        self.goaway_uri = e.message.new_session_uri
        self.relay.on_goaway(self)

    def _on_closed(self, code: int, reason: str) -> None:
        if self.closed.done():
            return
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"session closed ({code}): {reason}"))
        self.closed.set_result((code, reason))
        handlers = list(self.local.values()) + list(self.served.values())
        self.local.clear()
        self.served.clear()
        for h in handlers:
            try:
                h.on_session_closed(self)
            except Exception:
                logger.exception("relay: closing %r failed", h)
        if self._sender is not None:
            self._sender.close()
        self.relay.on_session_closed(self)

    # -- REQUEST_UPDATEs held for a request still being routed / waiting upstream -------------
    def _hold_update(self, rid: int, msg: RequestUpdate) -> None:
        moqt = self.moqt
        if moqt is None:
            return
        # Requests that ended while their updates were held (refused, cancelled) owe nothing.
        for gone in [r for r in self.held_updates if r not in moqt.requests]:
            del self.held_updates[gone]
        held = self.held_updates.get(rid)
        if held is None:
            self.held_updates[rid] = HeldUpdates(1, msg.parameters)
        else:
            held.add(msg.parameters)

    def take_updates(self, rid: int) -> HeldUpdates | None:
        """The held REQUEST_UPDATEs of the peer's request ``rid`` (its handler now applies
        them and answers), or None."""
        return self.held_updates.pop(rid, None)

    # -- helpers for handlers ----------------------------------------------------------------
    def flush(self) -> None:
        """Carry out the actions queued by a call into ``self.moqt`` now (even from inside
        another event's dispatch, so a stream is opened before bytes are written to it),
        then dispatch events unless a pump is already running."""
        moqt = self.moqt
        if moqt is None:
            return
        while (action := moqt.next_action()) is not None:
            apply_action(self.connection, action)
        self.pump()

    def cancel_request(self, rid: int) -> None:
        """Give up our request ``rid``: forget its handler, cancel it on the session (if it is
        still open) and send that now."""
        self.local.pop(rid, None)
        moqt = self.moqt
        if moqt is not None and not moqt.closed:
            moqt.cancel(rid)
            self.flush()

    def release(self, rid: int) -> None:
        """Forget our finished request ``rid`` (its data routing too)."""
        self.local.pop(rid, None)
        if self.moqt is not None:
            self.moqt.release(rid)

    def close(self, code: int = SessionErrorCode.NO_ERROR, reason: str = "") -> None:
        if self.moqt is not None:
            self.moqt.close(code, reason)
            self.pump()
