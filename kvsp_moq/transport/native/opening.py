"""Streams opened beyond the peer's stream limit: :class:`StreamOpener`.

``Connection.open_bidi``/``open_uni`` never fail for lack of stream credit (aioquic and qh3
hand out the next ID and hold the stream's frames until MAX_STREAMS, RFC 9000 §4.6), while
the extension's ``open_stream`` raises BlockingIOError at the limit. So past the limit the
opener hands out the ID the stream will have (IDs of a kind are consecutive: RFC 9000 §2.1),
keeps what is sent, reset or stopped on it, and opens it for real, in order, when a
``stream_limit`` event says the peer granted more (:meth:`StreamOpener.retry`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["StreamOpener"]

logger = logging.getLogger(__name__)

Data = bytes | bytearray | memoryview


class _Waiting:
    """What happened to a stream before it could be opened."""

    __slots__ = ("chunks", "fin", "nbytes", "reset", "stop")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.nbytes = 0
        self.fin = False
        self.reset: int | None = None
        self.stop: int | None = None


class StreamOpener:
    """Stream opening on one connection of an ``_ngtcp2.Endpoint`` (``ep``, ``handle``).
    ``opened(sid)`` is called for each waiting stream once it is open and its bytes queued
    in the extension."""

    def __init__(self, ep: Any, handle: int, is_client: bool,
                 opened: Callable[[int], None]) -> None:
        self._ep = ep
        self._handle = handle
        self._opened = opened
        first = 0 if is_client else 1
        self._next = {False: first, True: first + 2}  # the next ID of each kind
        self._queues: dict[bool, deque[int]] = {False: deque(), True: deque()}
        self._waiting: dict[int, _Waiting] = {}

    def open(self, uni: bool) -> int:
        """A new stream's ID (open at once when the peer's limit allows)."""
        queue = self._queues[uni]
        if not queue:
            try:
                sid = int(self._ep.open_stream(self._handle, uni))
            except (BlockingIOError, ConnectionError):  # at the limit, or closing
                pass
            else:
                self._next[uni] = sid + 4
                return sid
        sid = self._next[uni]
        self._next[uni] = sid + 4
        queue.append(sid)
        self._waiting[sid] = _Waiting()
        return sid

    def waiting(self, stream_id: int) -> bool:
        """True for a stream not opened yet (the peer's limit)."""
        return stream_id in self._waiting

    def buffered(self, stream_id: int) -> int:
        """Bytes sent on a waiting stream (0 once reset)."""
        w = self._waiting[stream_id]
        return 0 if w.reset is not None else w.nbytes

    def send(self, stream_id: int, data: Data, fin: bool) -> None:
        w = self._waiting[stream_id]
        if len(data):
            chunk = bytes(data)  # the caller may reuse its buffer on return
            w.chunks.append(chunk)
            w.nbytes += len(chunk)
        w.fin = w.fin or fin

    def reset(self, stream_id: int, code: int) -> None:
        w = self._waiting[stream_id]
        w.reset = code
        w.chunks.clear()
        w.nbytes = 0

    def stop(self, stream_id: int, code: int) -> None:
        self._waiting[stream_id].stop = code

    def retry(self) -> None:
        """The peer's limit grew: open the waiting streams it admits, in order."""
        for uni in (False, True):
            queue = self._queues[uni]
            while queue:
                try:
                    sid = int(self._ep.open_stream(self._handle, uni))
                except (BlockingIOError, ConnectionError):
                    break
                expected = queue.popleft()
                if sid != expected:  # IDs of a kind are consecutive: cannot happen
                    logger.error("native: stream %d opened as %d; the waiting stream's "
                                 "sends are lost", expected, sid)
                    self._waiting.pop(expected, None)
                    continue
                self._flush(sid, self._waiting.pop(sid))
                self._opened(sid)

    def _flush(self, sid: int, w: _Waiting) -> None:
        ep, handle = self._ep, self._handle
        try:
            if w.reset is not None:
                ep.reset_stream(handle, sid, w.reset)
            else:
                last = len(w.chunks) - 1
                for i, chunk in enumerate(w.chunks):
                    ep.send(handle, sid, chunk, w.fin and i == last)
                if w.fin and not w.chunks:
                    ep.send(handle, sid, b"", True)
            if w.stop is not None:
                ep.stop_sending(handle, sid, w.stop)
        except (ConnectionError, ValueError) as exc:  # closing meanwhile
            logger.debug("native: stream %d could not be flushed: %s", sid, exc)

    def clear(self) -> None:
        """The connection ended: nothing waits any more."""
        for queue in self._queues.values():
            queue.clear()
        self._waiting.clear()
