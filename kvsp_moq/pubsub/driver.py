"""Driving a sans-IO MOQT session on a transport connection (DESIGN.md §2: the aioquic
``QuicConnection`` / ``asyncio.protocol`` split).

:class:`SessionDriver` is the :class:`~kvsp_moq.transport.ConnectionHandler` half that every
MOQT endpoint shares — the pubsub :class:`~.session.Session` and the relay's peer sessions:
transport callbacks are fed to the session, then :meth:`SessionDriver.pump` carries out the
session's actions on the connection (:func:`apply_action`) and hands its events to
``_dispatch`` until both queues are empty.
"""

from __future__ import annotations

from ..moqt import session_events as ev
from ..moqt.session import Session as MoqtSession
from ..transport import Connection, ConnectionHandler, StreamClosedError


def apply_action(conn: Connection, a: ev.Action) -> None:
    """Carry out one action of the sans-IO session on the connection."""
    if conn.is_closed:
        return
    try:
        if isinstance(a, ev.SendStream):
            conn.send(a.stream_id, a.data, a.end_stream)
        elif isinstance(a, ev.OpenStream):
            sid = conn.open_bidi() if a.bidirectional else conn.open_uni()
            if sid != a.stream_id:  # pragma: no cover - numbering is RFC 9000's
                raise RuntimeError(f"stream {sid} opened, session expected {a.stream_id}")
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


class SessionDriver(ConnectionHandler):
    """Feeds transport callbacks to ``self.moqt`` and pumps. Subclasses set ``moqt``,
    ``connection`` and ``_pumping = False``, and implement ``_dispatch`` and ``_on_closed``."""

    moqt: MoqtSession | None
    connection: Connection
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
                self._dispatch(event)
        finally:
            self._pumping = False

    def _dispatch(self, e: ev.Event) -> None:
        raise NotImplementedError

    def _on_closed(self, code: int, reason: str) -> None:
        raise NotImplementedError
