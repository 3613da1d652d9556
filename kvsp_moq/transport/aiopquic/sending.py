"""The send side of an aiopquic connection's streams: our queue in front of aiopquic's
per-stream send rings, and what "buffered" means there.

aiopquic takes stream bytes through a bounded ring per stream (``stream_ring_cap``) that
picoquic's network thread pulls from as congestion and flow control allow.
``QuicConnection.send_stream_data`` is all-or-nothing and raises ``BufferError`` when the
bytes do not fit, while ``Connection.send`` must never refuse bytes: what does not fit waits
here, in order, and is fed in when the network thread reports that it drained the ring
(``_EVT_STREAM_TX_DRAINED``, armed with ``set_tx_data_drain_pending``) or, when aiopquic's
connection-wide command ring was full, when that ring drained.

Buffered bytes of a stream (:meth:`SendStreams.buffered`) = queued here + in its ring.
picoquic exposes no per-stream acknowledgement state except one event: it *releases* a
stream once both directions are over and everything we sent on it, FIN included, was
acknowledged (RFC 9000 §3.1 "Data Recvd"; ``_EVT_STREAM_DESTROY``). So a finished stream —
the FIN handed over, and (bidirectional) the peer's direction finished or reset — counts one
byte (its FIN) until released: 0 then means acknowledged. Bytes of an unfinished stream that
picoquic took into packets are not counted (its congestion and stream flow-control windows
bound them); :meth:`~.connection.AiopquicConnection.drain` adds a connection-wide
"nothing in flight" check for those.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from .stack import transport_context
from ..api import StreamClosedError, is_unidirectional

__all__ = ["SendStreams"]

logger = logging.getLogger(__name__)

Data = bytes | bytearray | memoryview


class _Stream:
    """One stream's send state."""

    __slots__ = ("fin_pushed", "fin_wanted", "head_offset", "pending", "pending_bytes")

    def __init__(self) -> None:
        self.pending: deque[bytes] = deque()
        self.head_offset = 0  # bytes of pending[0] already in the ring
        self.pending_bytes = 0
        self.fin_wanted = False  # send(end_stream=True) was called
        self.fin_pushed = False  # ... and the FIN went into the ring


class SendStreams:
    """Every stream's send side on one aiopquic ``QuicConnection``. ``on_change(sid)`` is
    called when a stream's buffered figure may have dropped (its ring drained, it was
    released); ``sid`` None: possibly all of them."""

    def __init__(self, quic: Any, ring_cap: int,
                 on_change: Callable[[int | None], None]) -> None:
        self._quic = quic
        self._ring_cap = ring_cap
        self._on_change = on_change
        self._streams: dict[int, _Stream] = {}
        #: Streams whose send side is over for good: reset/stopped (the code) or released
        #: after the FIN (None).
        self._done: dict[int, int | None] = {}
        #: Bidirectional streams whose receive side is over (FIN or RESET_STREAM seen).
        self._recv_done: set[int] = set()
        self._blocked: set[int] = set()  # waiting for room in their ring
        self._ring_wait: asyncio.Task[None] | None = None

    # -- queries ----------------------------------------------------------------------------
    def closed_code(self, stream_id: int) -> tuple[bool, int | None]:
        """(True, code) when the send side is over: code of the reset/STOP_SENDING, None
        after the FIN. (False, None) while it may send."""
        if stream_id in self._done:
            return True, self._done[stream_id]
        stream = self._streams.get(stream_id)
        if stream is not None and stream.fin_wanted:
            return True, None
        return False, None

    def unsent(self, stream_id: int) -> int:
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return stream.pending_bytes + int(self._quic.tx_data_ring_used(stream_id))

    def buffered(self, stream_id: int) -> int:
        """Queued + in the ring; a finished stream counts its FIN (1) until released."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0  # never sent on, reset, stopped, or released
        unsent = stream.pending_bytes + int(self._quic.tx_data_ring_used(stream_id))
        if unsent == 0 and stream.fin_pushed and self._release_expected(stream_id):
            return 1
        return unsent

    def _release_expected(self, stream_id: int) -> bool:
        # picoquic releases a stream only when both directions are over.
        return is_unidirectional(stream_id) or stream_id in self._recv_done

    def sending(self) -> list[int]:
        """The streams with send state (not reset, stopped or released)."""
        return list(self._streams)

    # -- sending ----------------------------------------------------------------------------
    def send(self, stream_id: int, data: Data, end_stream: bool) -> None:
        closed, code = self.closed_code(stream_id)
        if closed:
            raise StreamClosedError(stream_id, code, f"stream {stream_id} can no longer send "
                                    + ("(finished)" if code is None else f"(code {code})"))
        stream = self._streams.get(stream_id)
        if stream is None:
            stream = self._streams[stream_id] = _Stream()
        if len(data):
            # The one copy on our side: aiopquic's ring takes ``bytes`` (copying them again),
            # and the caller may reuse its buffer on return.
            chunk = data if isinstance(data, bytes) else bytes(data)
            stream.pending.append(chunk)
            stream.pending_bytes += len(chunk)
        if end_stream:
            stream.fin_wanted = True
        self._feed(stream_id, stream)

    def _feed(self, stream_id: int, stream: _Stream) -> None:
        """Move queued bytes (and the FIN) into the ring while they fit."""
        quic = self._quic
        while stream.pending or (stream.fin_wanted and not stream.fin_pushed):
            room = self._ring_cap - int(quic.tx_data_ring_used(stream_id))
            if stream.pending:
                head, start = stream.pending[0], stream.head_offset
                n = min(len(head) - start, room)
                if n <= 0:
                    self._wait_for_room(stream_id)
                    return
                whole = start == 0 and n == len(head)
                piece = head if whole else head[start:start + n]
                done = start + n == len(head)
                fin = done and len(stream.pending) == 1 and stream.fin_wanted
            else:
                piece, n, done, fin = b"", 0, False, True
            try:
                quic.send_stream_data(stream_id, piece, end_stream=fin)
            except BufferError:
                # aiopquic's command ring (connection-wide) is full: it armed its drain event.
                self._wait_for_command_ring(stream_id)
                return
            if n:
                stream.pending_bytes -= n
                if done:
                    stream.pending.popleft()
                    stream.head_offset = 0
                else:
                    stream.head_offset += n
            if fin:
                stream.fin_pushed = True
        self._blocked.discard(stream_id)

    def _wait_for_room(self, stream_id: int) -> None:
        self._blocked.add(stream_id)
        self.arm(stream_id)

    def arm(self, stream_id: int) -> None:
        """Ask for ``_EVT_STREAM_TX_DRAINED`` when the network thread next takes bytes from
        this stream's ring; if it took some meanwhile, act now (no lost wake-up)."""
        quic = self._quic
        before = int(quic.tx_data_ring_used(stream_id))
        if before == 0:
            return
        quic.set_tx_data_drain_pending(stream_id)
        if int(quic.tx_data_ring_used(stream_id)) < before:
            asyncio.get_running_loop().call_soon(self.tx_drained, stream_id)

    def _wait_for_command_ring(self, stream_id: int) -> None:
        self._blocked.add(stream_id)
        if self._ring_wait is not None:
            return
        transport = transport_context(self._quic)
        if transport is None:
            return
        event: asyncio.Event = transport.tx_event_ring_drain_event
        event.clear()
        if not transport.arm_tx_event_ring_drain_pending():
            asyncio.get_running_loop().call_soon(self._refeed)  # drained already
            return

        async def wait() -> None:
            await event.wait()
            self._ring_wait = None
            self._refeed()

        self._ring_wait = asyncio.ensure_future(wait())

    def _refeed(self) -> None:
        for stream_id in list(self._blocked):
            stream = self._streams.get(stream_id)
            if stream is None:
                self._blocked.discard(stream_id)
            else:
                self._feed(stream_id, stream)
        self._on_change(None)

    # -- events -----------------------------------------------------------------------------
    def tx_drained(self, stream_id: int) -> None:
        """The network thread took bytes from the stream's ring."""
        stream = self._streams.get(stream_id)
        if stream is not None and stream_id in self._blocked and self._ring_wait is None:
            self._feed(stream_id, stream)
        self._on_change(stream_id)

    def released(self, stream_id: int) -> None:
        """picoquic retired the stream: all we sent on it was acknowledged."""
        self._recv_done.discard(stream_id)
        self._blocked.discard(stream_id)
        if self._streams.pop(stream_id, None) is not None:
            self._done.setdefault(stream_id, None)
            self._on_change(stream_id)

    def receive_finished(self, stream_id: int) -> None:
        """The peer's direction of a bidirectional stream ended (FIN or RESET_STREAM)."""
        if not is_unidirectional(stream_id):
            self._recv_done.add(stream_id)

    def abandon(self, stream_id: int, error_code: int) -> bool:
        """Reset or STOP_SENDING: drop what is queued. False if already over."""
        if stream_id in self._done:
            return False
        self._done[stream_id] = error_code
        self._streams.pop(stream_id, None)
        self._blocked.discard(stream_id)
        return True

    def close(self) -> None:
        """The connection ended: nothing more will be sent."""
        self._streams.clear()
        self._blocked.clear()
        self._recv_done.clear()
        if self._ring_wait is not None:
            self._ring_wait.cancel()
            self._ring_wait = None
