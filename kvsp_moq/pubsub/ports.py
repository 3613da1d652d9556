"""What the pieces of pubsub ask of the session they run on, as Protocols
:class:`~.session.MoqtSession` implements (so they import no session module: DESIGN.md §2,
dependencies point down).

* :class:`DataPlane` — what a :class:`~.publish.TrackPublisher` needs to send a track's
  objects to one subscriber on a session: open subgroup streams, write to them, send
  OBJECT_DATAGRAMs, end data streams and subscriptions (PUBLISH_DONE), run a task.
* :class:`ServingSession` — a :class:`DataPlane` whose sans-IO session answers requests: what
  the catalog server (:mod:`.catalog_server`), the FETCH server (:mod:`.fetch_server`) and
  :func:`~.serve_updates.answer_update` act on.
* :class:`RequestOwner` — what an :class:`~.receive.ObjectStream` (a subscription or fetch we
  made) needs of its session: update its request, cancel it, report it finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

from ..moqt.messages import Message, MessageParameters
from ..moqt.objects import SubgroupHeader
from ..moqt.session import SessionMachine
from ..moqt.version import Version
from ..transport import Connection

__all__ = ["DataPlane", "RequestOwner", "ServingSession"]


class DataPlane(Protocol):
    """A session a track publishes on (one :class:`~.publish.Outgoing` per subscription)."""

    @property
    def version(self) -> Version:
        """The MOQT version of the session (the data stream encoding)."""
        ...

    @property
    def connection(self) -> Connection:
        """The transport connection: objects are written on its streams."""
        ...

    @property
    def max_datagram_size(self) -> int:
        """The largest OBJECT_DATAGRAM (header and payload) the session can send."""
        ...

    def open_subgroup(self, rid: int, header: SubgroupHeader) -> int:
        """Open a subgroup stream of subscription ``rid`` with ``header`` sent; its ID."""
        ...

    def send_datagram(self, data: bytes) -> None:
        """Send one encoded OBJECT_DATAGRAM (dropped once the session is closing)."""
        ...

    def data_stream_done(self, sid: int) -> None:
        """Data stream ``sid`` was finished or reset by the publisher."""
        ...

    def publish_done(self, rid: int, status: int, count: int, reason: str) -> None:
        """End subscription ``rid`` with PUBLISH_DONE (its Stream Count ``count``)."""
        ...

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` as a task of the session (failures logged)."""
        ...


class ServingSession(DataPlane, Protocol):
    """A session that answers the peer's requests through its sans-IO session."""

    @property
    def moqt(self) -> SessionMachine | None:
        """The sans-IO session (None before the connection is made)."""
        ...

    def pump(self) -> None:
        """Carry out what calls into :attr:`moqt` queued, dispatch its events."""
        ...


class RequestOwner(Protocol):
    """The session a request of ours (SUBSCRIBE, FETCH, the peer's PUBLISH) runs on."""

    def update_request(self, request_id: int,
                       parameters: MessageParameters) -> asyncio.Future[Message]:
        """REQUEST_UPDATE on the request; the future resolves to its REQUEST_OK."""
        ...

    def drop_request(self, rid: int) -> None:
        """Cancel the request (§"Request Cancellation") and forget it."""
        ...

    def stream_finished(self, request_id: int) -> None:
        """The request's object stream has ended: forget its routing."""
        ...

    def stop_data_stream(self, stream_id: int, error_code: int) -> None:
        """STOP_SENDING one of the peer's data streams of the request (a local limit);
        its DataStreamClosed with ``error_code`` follows."""
        ...
