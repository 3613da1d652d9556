"""Driving a sans-IO MOQT session on a transport connection (DESIGN.md §2: the aioquic
``QuicConnection`` / ``asyncio.protocol`` split).

:class:`SessionDriver` is the :class:`~kvsp_moq.transport.ConnectionHandler` half that every
MOQT endpoint shares — the pubsub :class:`~.session.MoqtSession` and the relay's peer
sessions: transport callbacks are fed to the session, then :meth:`SessionDriver.pump` carries
out the session's actions on the connection (:func:`apply_action`) and hands its events to
:meth:`SessionDriver.dispatch` (an :class:`EventTable`: one handler per event type) until
both queues are empty. The session numbers its streams by asking the connection
(:class:`ConnectionStreamIds`). :class:`Tasks` runs an endpoint's background coroutines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from ..moqt.session import SessionMachine
from ..moqt.session import events as ev
from ..moqt.session.streams import stream_id
from ..transport import Connection, ConnectionHandler, StreamClosedError, TransportError

__all__ = ["ConnectionStreamIds", "EventTable", "SessionDriver", "Tasks", "apply_action"]

E = TypeVar("E", bound=ev.Event)


def apply_action(conn: Connection, a: ev.Action) -> None:
    """Carry out one action of the sans-IO session on the connection."""
    if conn.is_closed:
        return
    try:
        if isinstance(a, ev.SendStream):
            conn.send(a.stream_id, a.data, a.end_stream)
        elif isinstance(a, ev.ResetStream):
            conn.reset_stream(a.stream_id, a.error_code)
        elif isinstance(a, ev.StopSending):
            conn.stop_sending(a.stream_id, a.error_code)
        elif isinstance(a, ev.SendDatagram):
            conn.send_datagram(a.data)
        elif isinstance(a, ev.CloseSession):
            conn.close(a.error_code, a.reason)
    except StreamClosedError:
        pass  # the peer stopped the stream meanwhile; its event follows


class ConnectionStreamIds:
    """The :class:`~kvsp_moq.moqt.session.StreamIdAllocator` of a session driven on
    ``conn``: every stream is opened, and numbered, by the transport backend (aioquic's
    ``get_next_available_stream_id``, qh3's and picoquic's own allocation).

    Once the connection is closing nothing reaches the wire any more (actions are dropped,
    :func:`apply_action`); a stream the session opens then gets the next ID in RFC 9000
    order after the transport's last, so its bookkeeping stays consistent until the
    session learns of the close."""

    def __init__(self, conn: Connection, is_client: bool) -> None:
        self._conn = conn
        self._is_client = is_client
        self._last: dict[bool, int | None] = {True: None, False: None}

    def _open(self, uni: bool) -> int:
        if not self._conn.is_closed:
            try:
                sid = self._conn.open_uni() if uni else self._conn.open_bidi()
            except TransportError:
                pass  # closed meanwhile
            else:
                self._last[uni] = sid
                return sid
        last = self._last[uni]
        sid = stream_id(0, self._is_client, uni) if last is None else last + 4
        self._last[uni] = sid
        return sid

    def open_uni(self) -> int:
        return self._open(True)

    def open_bidi(self) -> int:
        return self._open(False)


class EventTable:
    """Session events → their handler, by event type (one lookup per event; events
    without a handler are ignored)."""

    def __init__(self) -> None:
        self._handlers: dict[type[ev.Event], Callable[[Any], None]] = {}

    def on(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._handlers[kind] = handler

    def dispatch(self, e: ev.Event) -> None:
        handler = self._handlers.get(type(e))
        if handler is not None:
            handler(e)


class Tasks:
    """The background tasks of one owner (a session, a relay): :meth:`spawn` runs a
    coroutine, :meth:`cancel_all` cancels what still runs; a task that fails is logged with
    ``what`` on ``logger``, never left unretrieved."""

    def __init__(self, logger: logging.Logger, what: str = "task") -> None:
        self._logger = logger
        self._what = what
        self._tasks: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Future[None]]:
        return iter(list(self._tasks))

    def spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._logger.error("%s failed", self._what, exc_info=task.exception())


class SessionDriver(ConnectionHandler):
    """Feeds transport callbacks to ``self.moqt`` and pumps. Subclasses set ``moqt`` (its
    streams numbered by :class:`ConnectionStreamIds` over the connection), ``connection``,
    ``events`` (their :class:`EventTable`) and ``_pumping = False``, and implement
    ``_on_closed``."""

    moqt: SessionMachine | None
    connection: Connection
    events: EventTable
    _pumping: bool

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        assert self.moqt is not None
        self.moqt.stream_data(stream_id, data, end_stream)
        self.pump()

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        assert self.moqt is not None
        self.moqt.stream_reset(stream_id, error_code)
        self.pump()

    def stop_sending(self, stream_id: int, error_code: int) -> None:
        assert self.moqt is not None
        self.moqt.stop_sending(stream_id, error_code)
        self.pump()

    def datagram_received(self, data: bytes | memoryview) -> None:
        assert self.moqt is not None
        self.moqt.datagram_received(data)
        self.pump()

    def connection_lost(self, error_code: int, reason: str) -> None:
        if self.moqt is not None:
            self.moqt.connection_lost(error_code, reason)
            self.pump()
        self._on_closed(error_code, reason)

    def pump(self) -> None:
        """Carry out queued actions, then dispatch events, until both queues are empty.
        Re-entrant calls (a handler acting on this session) return at once: the outer loop
        picks up what they queued."""
        if self._pumping or self.moqt is None:
            return
        self._pumping = True
        try:
            moqt = self.moqt
            while True:
                action = moqt.next_action()
                if action is not None:
                    apply_action(self.connection, action)
                    continue
                event = moqt.next_event()
                if event is None:
                    break
                self.dispatch(event)
        finally:
            self._pumping = False

    def dispatch(self, e: ev.Event) -> None:
        """Hand one event to its handler in :attr:`events`."""
        self.events.dispatch(e)

    def _on_closed(self, code: int, reason: str) -> None:
        raise NotImplementedError
