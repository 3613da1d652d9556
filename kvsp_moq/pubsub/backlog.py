"""One subscriber's output of a published track: bytes handed to QUIC without waiting on
that subscriber, the rest queued here under a byte bound (issue 19: a slow subscriber must
not slow the others).

:class:`~.publish.TrackPublisher` sends every object to each of its subscribers through
the subscriber's :class:`Backlog`:

* while nothing waits in the backlog and the stream's send buffer in QUIC is under the
  connection's ``send_buffer_high_water``, bytes go straight to QUIC
  (``Connection.send``, no queueing);
* otherwise they wait here, in order, and a task of the session hands them to QUIC as the
  peer acknowledges (``Connection.write``: at most ``send_buffer_high_water`` buffered);
* FINs and what must follow the data (PUBLISH_DONE: draft-22 §"PUBLISH_DONE" is sent once
  the subscription's data streams are closed) wait behind the bytes queued before them;
* more than ``budget`` bytes waiting: :attr:`on_overflow` runs (the publisher ends the
  subscription: streams reset and PUBLISH_DONE with TOO_FAR_BEHIND, draft-22 §"Delivery
  Timeouts": "the publisher MAY terminate the subscription using PUBLISH_DONE with error
  TOO_FAR_BEHIND").

Queued bytes must not change under us: the caller's buffer may be reused once a write
returns, so a chunk that has to wait is frozen (copied) once, the copy shared by every
subscriber whose backlog holds it (:class:`Chunk`). A *stable* chunk (bytes that never change:
a store's view of a layer, or ``bytes``) is never frozen: it waits as the caller's view, and it
goes to QUIC with ``Connection.send_stable`` (the native backend sends from it without a copy,
docs/transport.md "Sending from the store (no copy)").
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..transport import Connection, ConnectionClosedError, StreamClosedError, TransportError
from ..wire.buffer import Buffer

__all__ = ["Backlog", "Chunk", "DEFAULT_SUBSCRIBER_QUEUE_BYTES", "flushed"]

#: Default bound of the bytes one subscriber of a track may have waiting in the publisher
#: (beyond what QUIC buffers for its stream): the relay's ``subscriber_queue_bytes`` too.
DEFAULT_SUBSCRIBER_QUEUE_BYTES = 8 << 20


#: The backlogs with bytes waiting, by the session (the ``DataPlane``) they send on.
_WAITING: weakref.WeakKeyDictionary[object, set[Backlog]] = weakref.WeakKeyDictionary()


async def flushed(session: object) -> None:
    """Return once no backlog of ``session`` holds bytes (every byte written to its tracks
    is in QUIC's hands): ``MoqtSession.drain`` waits for it before the QUIC drain."""
    while True:
        waiting = [b for b in _WAITING.get(session, ()) if b.blocked and not b.closed]
        if not waiting:
            return
        await asyncio.gather(*(b.empty.wait() for b in waiting))


class Chunk:
    """A payload chunk being sent to several subscribers: its bytes as given, and one frozen
    copy made the first time a subscriber must queue it — none for a :attr:`stable` chunk."""

    __slots__ = ("data", "stable", "_frozen")

    def __init__(self, data: Buffer, stable: bool = False) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self.data = view
        #: The bytes never change while anyone may send them: ``stable`` given (a store's
        #: view that is never rewritten), or bytes (or a view of bytes), which cannot change.
        #: Queued without a copy and sent with ``Connection.send_stable``.
        self.stable = stable or isinstance(data, bytes) or isinstance(view.obj, bytes)
        self._frozen: memoryview | None = view if self.stable else None

    def frozen(self) -> memoryview:
        """The bytes, immune to the caller reusing its buffer (copied at most once)."""
        if self._frozen is None:
            self._frozen = memoryview(bytes(self.data))
        return self._frozen


@dataclass(slots=True)
class _Item:
    sid: int
    data: memoryview | bytes
    fin: bool = False
    #: ``data`` is a stable chunk's view: handed to QUIC with ``stable=True``.
    stable: bool = False
    #: Runs once the item is handed to QUIC (or dropped with its stream).
    after: Callable[[], None] | None = None


class Backlog:
    """What waits for one subscriber (see the module docstring)."""

    def __init__(self, connection: Callable[[], Connection], spawn: Callable[..., None],
                 budget: int = DEFAULT_SUBSCRIBER_QUEUE_BYTES, session: object = None) -> None:
        self._connection = connection
        self._session = session
        self._spawn = spawn
        self.budget = budget
        self.queued = 0
        self.peak = 0
        self._items: deque[_Item] = deque()
        self._draining = False
        self.closed = False
        #: Called (once) when more than ``budget`` bytes wait.
        self.on_overflow: Callable[[], None] = lambda: None
        #: Called when a stream is found stopped by the peer (STOP_SENDING) while draining.
        self.on_stopped: Callable[[int], None] = lambda sid: None
        #: Called when the connection is found gone while draining.
        self.on_gone: Callable[[], None] = lambda: None
        #: Set while nothing waits (the publisher paces itself on it).
        self.empty = asyncio.Event()
        self.empty.set()

    @property
    def blocked(self) -> bool:
        """Bytes wait here (the next ones would queue behind them)."""
        return bool(self._items)

    # -- sending -----------------------------------------------------------------------------
    def send(self, sid: int, chunk: Chunk | bytes, fin: bool = False) -> None:
        """Bytes of stream ``sid``, after everything sent before. Raises
        :class:`StreamClosedError` when ``sid`` was stopped (the direct path), and
        :class:`TransportError` when the connection is gone."""
        if self.closed:
            return
        view = chunk.data if isinstance(chunk, Chunk) else memoryview(chunk)
        stable = isinstance(chunk, Chunk) and chunk.stable
        if not self._items:
            conn = self._connection()
            send = conn.send_stable if stable else conn.send
            room = conn.send_buffer_high_water - conn.stream_send_buffered(sid)
            if room >= len(view) or not view:
                send(sid, view, end_stream=fin)
                return
            if room > 0:
                send(sid, view[:room])
        else:
            room = 0
        rest = max(room, 0)
        if isinstance(chunk, Chunk):
            data: memoryview | bytes = chunk.frozen()[rest:]  # a stable chunk's own view
        else:
            data = chunk[rest:]
        self._push(_Item(sid, data, fin, stable))

    def after(self, sid: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` once everything queued before it is handed to QUIC (at once when
        nothing waits). ``sid`` is the stream it belongs with (dropped with it)."""
        if self.closed:
            return
        if not self._items:
            fn()
            return
        self._push(_Item(sid, b"", after=fn))

    def _push(self, item: _Item) -> None:
        self._items.append(item)
        if self.empty.is_set() and self._session is not None:
            _WAITING.setdefault(self._session, set()).add(self)
        self.empty.clear()
        self.queued += len(item.data)
        if self.queued > self.peak:
            self.peak = self.queued
        if self.queued > self.budget:
            self.on_overflow()
            return
        if not self._draining:
            self._draining = True
            self._spawn(self._drain())

    def drop_stream(self, sid: int) -> None:
        """Forget what waits for ``sid`` (it was stopped or reset); its ``after`` calls
        still run, in order."""
        keep: deque[_Item] = deque()
        calls = []
        for item in self._items:
            if item.sid == sid:
                self.queued -= len(item.data)
                if item.after is not None:
                    calls.append(item.after)
            else:
                keep.append(item)
        self._items = keep
        if not keep:
            self._emptied()
        for fn in calls:
            fn()

    def streams(self) -> set[int]:
        """The streams with bytes waiting."""
        return {item.sid for item in self._items if item.data or item.fin}

    def close(self) -> None:
        """Drop everything (the subscription ended or was dropped)."""
        self.closed = True
        self._items.clear()
        self.queued = 0
        self._emptied()

    def _emptied(self) -> None:
        self.empty.set()
        waiting = _WAITING.get(self._session) if self._session is not None else None
        if waiting is not None:
            waiting.discard(self)

    # -- draining ----------------------------------------------------------------------------
    async def _drain(self) -> None:
        try:
            while self._items and not self.closed:
                item = self._items[0]
                try:
                    if item.data or item.fin:
                        await self._connection().write(item.sid, item.data, end_stream=item.fin,
                                                       stable=item.stable)
                except StreamClosedError:
                    self.drop_stream(item.sid)
                    self.on_stopped(item.sid)
                    continue
                except (ConnectionClosedError, TransportError):
                    self.close()
                    self.on_gone()
                    return
                if self.closed or not self._items or self._items[0] is not item:
                    continue  # dropped meanwhile
                self._items.popleft()
                self.queued -= len(item.data)
                if item.after is not None:
                    item.after()
            if not self._items:
                self._emptied()
        finally:
            self._draining = False
