"""kvsp_moq.pubsub — the asyncio MOQT application API (DESIGN.md §2; docs/pubsub.md).

``await connect("moqt://host:port/path", config)`` → :class:`MoqtSession`;
``await serve(host, port, config, on_session=...)`` → :class:`MoqtServer`. Publish with a
:class:`TrackPublisher` (``session.create_track`` or a shared :class:`Catalog`), subscribe
with ``await session.subscribe(ns, name)``, fetch with ``await session.fetch(...)``.
Failures raise :class:`MoqtError` carrying the MOQT code.

Modules: :mod:`.session` (:class:`MoqtSession`: the connection handler and the request API),
:mod:`.catalog_server` (answers the peer's SUBSCRIBE / FETCH / TRACK_STATUS /
SUBSCRIBE_NAMESPACE from the catalog), :mod:`.fetch_server` (a FETCH range from stored
objects), :mod:`.serve_updates` (the peer's REQUEST_UPDATEs), :mod:`.endpoints`
(``connect`` / ``serve``), :mod:`.publish` and :mod:`.receive` (objects out and in),
:mod:`.limits` (:class:`ReceiveLimits`: what a peer may make a session hold),
:mod:`.ports` (what those ask of a session), :mod:`.driver` (the transport-to-sans-IO pump
the relay shares).
"""

from .errors import DatagramTooLargeError, ErrorKind, MoqtError, SessionClosedError
from .limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from .publish import Catalog, ObjectWriter, StoredObject, TrackPublisher
from .receive import (
    DISCARD,
    FetchStream,
    ObjectStream,
    ReceivedObject,
    ReceiveStats,
    Refuse,
    Subscription,
)
from .endpoints import MoqtServer, connect, serve
from .session import IncomingPublish, MoqtSession, token_values

__all__ = [
    "DEFAULT_RECEIVE_LIMITS",
    "DISCARD",
    "Catalog",
    "DatagramTooLargeError",
    "ErrorKind",
    "FetchStream",
    "IncomingPublish",
    "MoqtError",
    "MoqtServer",
    "ObjectStream",
    "ObjectWriter",
    "ReceiveStats",
    "ReceiveLimits",
    "ReceivedObject",
    "Refuse",
    "MoqtSession",
    "SessionClosedError",
    "StoredObject",
    "Subscription",
    "TrackPublisher",
    "connect",
    "serve",
    "token_values",
]
