"""The relay's output to one downstream session: every data stream it sends there, handed to
QUIC in priority order (:mod:`relay.session.schedule`, draft-22 §"Priorities").

QUIC itself serves the streams it holds bytes for in turn (aioquic: round robin), so
priorities only decide anything while the relay still holds the bytes. The sender keeps
the bytes buffered in QUIC for the whole session (unsent + unacknowledged, summed over
its streams) under the connection's ``send_buffer_high_water``; beyond it, bytes wait in
the :class:`~relay.session.schedule.Schedule` and are handed out best first as the peer
acknowledges (down to the low-water mark, half of it). While nothing waits and there is
room, bytes go straight to QUIC (no queueing on the fast path).

* Payload chunks are the received memoryviews, handed as they are (the same object to
  every subscriber; a chunk larger than the room is split as a view). They are views of
  immutable ``bytes``, so they go with ``Connection.send_stable``: on the native backend the
  STREAM frames to every subscriber are written from the very bytes that arrived upstream,
  which the cache keeps too (no copy at all: cut-through); other backends copy them into
  their send buffer, the only copy.
* Each request has a :class:`RequestOut` (a SUBSCRIBE and its fill stream, a FETCH, a
  PUBLISH to a SUBSCRIBE_TRACKS subscriber). Push bytes waiting for a request are bounded
  by its budget (``subscriber_queue_bytes``): beyond it its ``on_overflow`` runs (the
  subscription is ended TOO_FAR_BEHIND, §"Delivery Timeouts"); a slow or low-priority
  request never holds the others, and a slow session never holds other sessions (the
  fan-out never waits).
* FETCH and fill streams are pulled from their source piece by piece when it is their
  turn, so they need no budget and no copy of a cached range.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from kvsp_moq.moqt.objects import GroupOrder
from kvsp_moq.transport import ConnectionClosedError, StreamClosedError, TransportError

from .schedule import DEFAULT_PRIORITY, Data, Flow, Piece, Schedule

if TYPE_CHECKING:  # pragma: no cover
    from kvsp_moq.moqt.session import SessionMachine
    from kvsp_moq.transport import Connection

__all__ = ["Piece", "RequestOut", "SenderSession", "SessionSender"]

logger = logging.getLogger(__name__)
#: How many of the fullest streams a wait for room watches.
_WATCH = 8


def _immutable(data: Data) -> bool:
    """``data`` can never change: ``bytes``, or a view of ``bytes`` (the chunks the QUIC
    layer handed us and the cache keeps). Such a chunk goes to QUIC with ``send_stable``: the
    native backend writes its STREAM frames from these very bytes (no copy per subscriber;
    the reference is held until the peer acknowledged them, within ``send_buffer_high_water``)."""
    return isinstance(data, bytes) or (isinstance(data, memoryview) and isinstance(data.obj, bytes))


class SenderSession(Protocol):
    """What a :class:`SessionSender` uses of its session (:class:`relay.session.peer.PeerSession`):
    the QUIC connection, the sans-IO MOQT session told of finished data streams, and
    ``flush`` to carry out what that queued."""

    @property
    def connection(self) -> Connection: ...

    @property
    def moqt(self) -> SessionMachine | None: ...

    def flush(self) -> None: ...


class RequestOut:
    """One request's data streams on the session (see the module docstring)."""

    def __init__(self, sender: SessionSender, flow: Flow,
                 on_overflow: Callable[[], None] | None) -> None:
        self.sender = sender
        self.flow = flow
        flow.owner = self
        self.on_overflow = on_overflow
        #: Functions to run once nothing of this request waits any more.
        self.calls: list[Callable[[], None]] = []
        #: Streams reset or stopped: later bytes for them are dropped.
        self.dead_streams: set[int] = set()

    # -- state -------------------------------------------------------------------------------
    @property
    def priority(self) -> int:
        return self.flow.priority

    @property
    def budget(self) -> int | None:
        return self.flow.budget

    @property
    def queued(self) -> int:
        return self.flow.queued

    @property
    def closed(self) -> bool:
        return self.flow.closed

    def set_priority(self, priority: int) -> None:
        """SUBSCRIBER_PRIORITY changed (REQUEST_UPDATE): re-ranks what waits."""
        self.sender.schedule.set_priority(self.flow, priority)

    # -- streams -----------------------------------------------------------------------------
    def open_stream(self, sid: int, publisher_priority: int, group_id: int,
                    subgroup_id: int = 0, *, fill: bool = False) -> None:
        """Register a data stream of this request (its header already went out)."""
        if not self.flow.closed:
            self.sender.schedule.open_stream(self.flow, sid, publisher_priority, group_id,
                                             subgroup_id, fill=fill)

    def send(self, sid: int, data: Data, fin: bool = False) -> None:
        """Bytes for push stream ``sid``, in order."""
        if self.flow.closed or sid in self.dead_streams:
            return
        s = self.sender
        if not s.schedule.is_open(sid):
            return  # never registered, or already finished
        if not s.schedule.backlog and s.room() > 0:
            s.hand(self, sid, data, fin)
            return
        s.schedule.push(sid, data, fin)
        if self.flow.over_budget and self.on_overflow is not None:
            self.on_overflow()
            return
        s.kick()

    def feed(self, sid: int, source: Iterator[Piece]) -> None:
        """Make ``sid`` a pull stream: its pieces are taken from ``source`` in turn."""
        if self.flow.closed or sid in self.dead_streams or not self.sender.schedule.is_open(sid):
            return
        self.sender.schedule.attach(sid, source)
        self.sender.kick()

    def wake(self, sid: int) -> None:
        """Pull stream ``sid``'s source has more now (it yielded ``schedule.PENDING``
        before: a FETCH range still arriving, cut through)."""
        if self.flow.closed or sid in self.dead_streams:
            return
        self.sender.schedule.wake(sid)
        self.sender.hand_ready()

    def reset(self, sid: int, code: int) -> None:
        """Abandon one stream now (RESET_STREAM): drop what waits for it."""
        if sid in self.dead_streams:
            return
        self.dead_streams.add(sid)
        self.sender.reset(sid, code)
        self.maybe_idle()

    def stopped(self, sid: int) -> None:
        """The peer sent STOP_SENDING on ``sid`` (QUIC resets it): drop what waits."""
        self.dead_streams.add(sid)
        self.sender.finished(sid)
        self.maybe_idle()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once everything this request queued before it has been handed to QUIC
        (PUBLISH_DONE goes after the FIN of every data stream)."""
        if self.flow.closed:
            return
        if self.flow.idle:
            fn()
            return
        self.calls.append(fn)
        self.sender.kick()

    def abort(self, reset_code: int | None = None) -> None:
        """Stop: drop everything queued; with ``reset_code`` reset the streams still open
        (without it the caller, or the session, resets them)."""
        if self.flow.closed:
            return
        self.calls.clear()
        for sid in self.sender.schedule.drop_flow(self.flow):
            if reset_code is not None:
                self.dead_streams.add(sid)
                self.sender.reset(sid, reset_code)

    def maybe_idle(self) -> None:
        """Run the functions waiting for this request (:meth:`call`) once nothing of it
        waits any more."""
        while self.calls and self.flow.idle and not self.flow.closed:
            self.calls.pop(0)()


class SessionSender:
    """All data the relay sends on one session (see the module docstring)."""

    def __init__(self, peer: SenderSession) -> None:
        self.peer = peer
        self.schedule = Schedule()
        #: Upper bound of the bytes QUIC holds for our streams (re-measured when it reaches
        #: the high-water mark).
        self.inflight = 0
        #: Streams that may still hold bytes in QUIC.
        self.live: set[int] = set()
        self.closed = False
        self._task: asyncio.Future[None] | None = None
        #: Inside :meth:`hand_ready` (a callback of QUIC's must not re-enter it).
        self._handing = False

    @property
    def high_water(self) -> int:
        return max(1, self.peer.connection.send_buffer_high_water)

    def request(self, priority: int | None = None, group_order: int = GroupOrder.ASCENDING,
                budget: int | None = None,
                on_overflow: Callable[[], None] | None = None) -> RequestOut:
        """The output of one request (subscriber priority None: the default, 128)."""
        flow = self.schedule.flow(DEFAULT_PRIORITY if priority is None else priority,
                                  group_order, budget)
        if self.closed:
            flow.closed = True
        return RequestOut(self, flow, on_overflow)

    # -- room in QUIC --------------------------------------------------------------------------
    def room(self) -> int:
        """Bytes that may be handed to QUIC now."""
        high = self.high_water
        if self.inflight < high:
            return high - self.inflight
        self.inflight = self._measure()
        return high - self.inflight

    def _measure(self) -> int:
        conn = self.peer.connection
        total = 0
        for sid in list(self.live):
            try:
                n = conn.stream_send_buffered(sid)
            except (KeyError, TransportError):
                n = 0
            if n == 0 and not self.schedule.is_open(sid):
                self.live.discard(sid)  # finished (or reset) and acknowledged
            total += n
        return total

    async def _wait_room(self) -> None:
        """Until the buffered bytes dropped toward the low-water mark: each of the fullest
        streams is watched for its share of the drop; the first to get there wakes us."""
        conn = self.peer.connection
        total = self.inflight
        need = total - self.high_water // 2
        sizes = sorted(((conn.stream_send_buffered(s), s) for s in self.live), reverse=True)
        sizes = [(n, s) for n, s in sizes[:_WATCH] if n > 0]
        if not sizes or total <= 0:
            return
        waits = [asyncio.ensure_future(conn.wait_writable(s, n - max(1, -(-need * n // total))))
                 for n, s in sizes]
        try:
            done, _pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        for w in done:
            exc = w.exception()
            if isinstance(exc, ConnectionClosedError):
                raise exc
        self.inflight = self._measure()

    # -- handing bytes to QUIC ---------------------------------------------------------------
    def hand(self, out: RequestOut, sid: int, data: Data, fin: bool) -> None:
        conn = self.peer.connection
        try:
            if _immutable(data):  # a received or cached payload: sent from where it lies
                conn.send_stable(sid, data, end_stream=fin)
            else:
                conn.send(sid, data, end_stream=fin)
        except StreamClosedError:
            out.dead_streams.add(sid)
            self.finished(sid)
            return
        except ConnectionClosedError:
            self.close()
            return
        self.inflight += len(data)
        self.live.add(sid)
        if fin:
            self.finished(sid)

    def reset(self, sid: int, code: int) -> None:
        try:
            self.peer.connection.reset_stream(sid, code)
        except TransportError:
            pass
        self.finished(sid)

    def finished(self, sid: int) -> None:
        """``sid`` is over (FIN handed, reset or stopped): forget it, tell the session."""
        self.schedule.drop_stream(sid)
        moqt = self.peer.moqt
        if moqt is not None and not moqt.closed:
            moqt.data_stream_done(sid)
            self.peer.flush()

    def hand_ready(self) -> None:
        """Hand what waits to QUIC now, best first, while there is room (no task hop: a
        FETCH range cut through goes down as it arrives); what does not fit waits for the
        drain task (which also takes over while it runs)."""
        if self._task is not None or self.closed or self._handing:
            return
        self._handing = True
        try:
            while not self.closed and (room := self.room()) > 0:
                if not self._hand_next(room):
                    return
        finally:
            self._handing = False
        self.kick()

    def _hand_next(self, room: int) -> bool:
        """Hand the Schedule's next piece (at most ``room`` octets) to QUIC; False when none waits."""
        got = self.schedule.next(room)
        if got is None:
            return False
        flow, sid, data, fin = got
        out = flow.owner
        assert isinstance(out, RequestOut)
        self.hand(out, sid, data, fin)
        if flow.idle:
            out.maybe_idle()
        return True

    def kick(self) -> None:
        if self._task is None and not self.closed and self.schedule.backlog:
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            while not self.closed:
                room = self.room()
                if room <= 0:
                    await self._wait_room()
                    continue
                if not self._hand_next(room):
                    break
        except ConnectionClosedError:
            self.close()
        except Exception:  # pragma: no cover - a bug: do not leave the session wedged
            logger.exception("relay: session sender failed")
            self.close()
        finally:
            self._task = None

    def close(self) -> None:
        """The session ended: drop everything."""
        self.closed = True
        for flow in list(self._flows()):
            self.schedule.drop_flow(flow)
        self.live.clear()

    def _flows(self) -> list[Flow]:
        return list({st.flow for st in self.schedule.streams.values()})
