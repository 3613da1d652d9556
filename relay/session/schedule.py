"""Which bytes the relay hands to QUIC next on one downstream session (draft-22
§"Priorities", §"Scheduling Algorithm"; the same text in the draft-20 editor's copy).

Pure state, no I/O: :mod:`relay.session.sender` drives it on a connection. One :class:`Schedule` per
session holds every data stream the relay sends there — subscription subgroup streams,
fill fetch streams, FETCH response streams — grouped by request (a :class:`Flow`: one
SUBSCRIBE with its fill stream, one FETCH, one PUBLISH to a SUBSCRIBE_TRACKS subscriber).

Order, from §"Scheduling Algorithm" ("lower numbers get higher priority"):

1. the **subscriber priority** of the request (SUBSCRIBER_PRIORITY, default 128; changed by
   REQUEST_UPDATE: "a best effort SHOULD be made to apply the change to all objects that
   have not been scheduled" — here every queued byte is re-ranked at once);
2. the **publisher priority** of the stream (subgroup header, else the track's
   DEFAULT_PUBLISHER_PRIORITY); a fetch stream's is that of its *next* object ("FETCH
   responses however can contain objects with different publisher priorities");
3. within one request, the subscription's **group order** (ascending: lower Group ID first;
   descending: higher first);
4. within one group, the **fill** stream before subscription-delivered objects, then the
   lowest **Subgroup ID**.

A request's key is (subscriber priority, publisher priority of its best stream, turn), its
streams' keys (publisher priority, group rank, fill rank, Subgroup ID). Between requests of
equal subscriber and publisher priority the draft leaves the order to the implementation,
"though the expectation is that all subscriptions will be able to send some data": the
*turn* is a counter stamped each time a request is served, so equal requests take turns
(round robin, one hand-off each).

Bytes within one stream keep their order (a relay MUST NOT reorder objects within a
stream). Push streams (live objects) queue the received memoryviews themselves, counted
against the request's byte budget; pull streams (fetch / fill) take the next piece from
their source only when it is their turn, so a large cached range is not copied or queued.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvsp_moq.moqt.objects import GroupOrder

__all__ = ["Flow", "LazyHeap", "PENDING", "Piece", "Schedule", "StreamKey", "FlowKey",
           "stream_key"]

#: (publisher priority, group rank, fill rank, Subgroup ID): lower first.
StreamKey = tuple[int, int, int, int]
#: (subscriber priority, publisher priority of the best ready stream, turn): lower first.
FlowKey = tuple[int, int, int]
DEFAULT_PRIORITY = 128
#: Fill rank (rule 4): fill-delivered objects before subscription-delivered ones.
FILL, SUBSCRIPTION = 0, 1

Data = bytes | memoryview
T = TypeVar("T", bound=Hashable)
K = TypeVar("K")


def stream_key(publisher_priority: int, group_order: int, group_id: int, subgroup_id: int,
               *, fill: bool = False) -> StreamKey:
    """The key of a stream inside its request (rules 2-4)."""
    rank = -group_id if group_order == GroupOrder.DESCENDING else group_id
    return (publisher_priority, rank, FILL if fill else SUBSCRIPTION, subgroup_id)


class LazyHeap(Generic[T, K]):
    """Items with a key that can change; the lowest key first, equal keys in push order.
    Each item is in it at most once: pushing it again replaces its key (the old heap entry
    is skipped when it surfaces)."""

    def __init__(self) -> None:
        self._heap: list[tuple[K, int, T]] = []
        self._live: dict[T, tuple[K, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: object) -> bool:
        return item in self._live

    def push(self, item: T, key: K) -> None:
        cur = self._live.get(item)
        if cur is not None and cur[0] == key:
            return
        seq = next(self._seq)
        self._live[item] = (key, seq)
        heapq.heappush(self._heap, (key, seq, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(k, s, i) for i, (k, s) in self._live.items()]
            heapq.heapify(self._heap)

    def _top(self) -> tuple[K, int, T] | None:
        heap, live = self._heap, self._live
        while heap:
            key, seq, item = heap[0]
            cur = live.get(item)
            if cur is not None and cur[1] == seq:
                return heap[0]
            heapq.heappop(heap)
        return None

    def peek(self) -> T | None:
        top = self._top()
        return top[2] if top is not None else None

    def peek_key(self) -> K | None:
        top = self._top()
        return top[0] if top is not None else None

    def pop(self) -> T | None:
        item = self.peek()
        if item is not None:
            heapq.heappop(self._heap)
            del self._live[item]
        return item

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()


@dataclass(slots=True)
class Piece:
    """Bytes for one stream. A piece that starts an object of a pull stream carries that
    object's publisher priority and Group ID (they re-rank the stream)."""

    data: Data = b""
    fin: bool = False
    publisher_priority: int | None = None
    group_id: int | None = None


#: What a pull source yields when it has nothing more *yet* (a FETCH range still arriving
#: from upstream, cut through by :mod:`relay.fetch.inflight`): the stream keeps its source and
#: waits, not ready, until :meth:`Schedule.wake`.
PENDING = Piece()


@dataclass(slots=True, eq=False)
class _Stream:
    sid: int
    flow: Flow
    publisher_priority: int
    group_id: int
    subgroup_id: int
    fill: bool
    items: deque[Piece] = field(default_factory=deque)
    #: Pull stream: where the next pieces come from (None: push, or exhausted).
    source: Iterator[Piece] | None = None
    #: A pull stream's pieces are not counted in the flow's ``queued`` bytes.
    pull: bool = False
    #: Its source yielded :data:`PENDING` and it was not woken since.
    waiting: bool = False

    def key(self) -> StreamKey:
        return stream_key(self.publisher_priority, self.flow.group_order, self.group_id,
                          self.subgroup_id, fill=self.fill)


@dataclass(eq=False)
class Flow:
    """One request's share of the session: its streams, subscriber priority, byte budget."""

    priority: int = DEFAULT_PRIORITY
    group_order: int = GroupOrder.ASCENDING
    #: Most bytes of push data that may wait here (None: unbounded).
    budget: int | None = None
    #: Push bytes waiting.
    queued: int = 0
    peak_queued: int = 0
    turn: int = 0
    #: Pull streams waiting for their source (:data:`PENDING`): not ready, not idle either.
    pending: int = 0
    closed: bool = False
    streams: dict[int, _Stream] = field(default_factory=dict)
    ready: LazyHeap[int, StreamKey] = field(default_factory=LazyHeap)
    #: Whoever drives this flow (relay.session.sender.RequestOut); opaque here.
    owner: object = None

    @property
    def idle(self) -> bool:
        """Nothing of this request waits (everything handed to QUIC, no stream waiting for
        more from its source)."""
        return not self.ready and not self.pending

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.queued > self.budget


class Schedule:
    """Every stream of one session, ready ones ranked by :data:`FlowKey` then
    :data:`StreamKey`."""

    def __init__(self) -> None:
        self.ready: LazyHeap[Flow, FlowKey] = LazyHeap()
        self.streams: dict[int, _Stream] = {}
        self._turns = itertools.count(1)

    @property
    def backlog(self) -> bool:
        """Whether anything waits (then new bytes must queue behind the order)."""
        return bool(self.ready)

    # -- requests ------------------------------------------------------------------------------
    def flow(self, priority: int = DEFAULT_PRIORITY, group_order: int = GroupOrder.ASCENDING,
             budget: int | None = None) -> Flow:
        return Flow(priority, group_order, budget)

    def set_priority(self, flow: Flow, priority: int) -> None:
        """A new subscriber priority for everything of ``flow`` not yet handed out."""
        flow.priority = priority
        self._rank_flow(flow)

    def drop_flow(self, flow: Flow) -> list[int]:
        """Forget ``flow`` and all it queued; returns the ids of its streams still open."""
        flow.closed = True
        self.ready.discard(flow)
        sids = list(flow.streams)
        for sid in sids:
            self.streams.pop(sid, None)
        flow.streams.clear()
        flow.ready.clear()
        flow.queued = 0
        flow.pending = 0
        return sids

    # -- streams -------------------------------------------------------------------------------
    def open_stream(self, flow: Flow, sid: int, publisher_priority: int, group_id: int,
                    subgroup_id: int = 0, *, fill: bool = False) -> None:
        st = _Stream(sid, flow, publisher_priority, group_id, subgroup_id, fill)
        self.streams[sid] = st
        flow.streams[sid] = st

    def is_open(self, sid: int) -> bool:
        return sid in self.streams

    def has_queue(self, sid: int) -> bool:
        st = self.streams.get(sid)
        return st is not None and bool(st.items or st.source)

    def push(self, sid: int, data: Data, fin: bool = False) -> None:
        """Queue bytes of a push stream (after everything queued for it)."""
        st = self.streams[sid]
        st.items.append(Piece(data, fin))
        n = len(data)
        flow = st.flow
        flow.queued += n
        if flow.queued > flow.peak_queued:
            flow.peak_queued = flow.queued
        self._rank_stream(st)

    def attach(self, sid: int, source: Iterator[Piece]) -> None:
        """Make ``sid`` a pull stream fed from ``source`` (its last piece has ``fin``)."""
        st = self.streams[sid]
        st.source, st.pull = source, True
        self._refill(st)
        self._rank_stream(st)

    def wake(self, sid: int) -> None:
        """A pull stream that waited (its source yielded :data:`PENDING`) may have more."""
        st = self.streams.get(sid)
        if st is None or not st.pull or st.items:
            return
        self._refill(st)
        self._rank_stream(st)

    def drop_stream(self, sid: int) -> None:
        """Forget ``sid`` and what it queued (reset, stopped, or finished)."""
        st = self.streams.pop(sid, None)
        if st is None:
            return
        flow = st.flow
        flow.streams.pop(sid, None)
        if st.waiting:
            st.waiting = False
            flow.pending -= 1
        if not st.pull:
            flow.queued -= sum(len(p.data) for p in st.items)
        st.items.clear()
        st.source = None
        flow.ready.discard(sid)
        self._rank_flow(flow)

    # -- taking bytes ------------------------------------------------------------------------
    def next(self, room: int) -> tuple[Flow, int, Data, bool] | None:
        """Take the next bytes to hand out, at most ``room`` of them (at least one piece
        boundary is never required: a piece is split); None when nothing waits."""
        flow = self.ready.peek()
        if flow is None:
            return None
        sid = flow.ready.peek()
        assert sid is not None
        st = flow.streams[sid]
        piece = st.items[0]
        data, fin = piece.data, piece.fin
        if len(data) > room > 0:
            view = data if isinstance(data, memoryview) else memoryview(data)
            st.items[0] = Piece(view[room:], fin)
            data, fin = view[:room], False
        else:
            st.items.popleft()
        if st.pull:
            self._refill(st)
        else:
            flow.queued -= len(data)
        flow.turn = next(self._turns)
        self._rank_stream(st)
        return flow, sid, data, fin

    # -- internals ---------------------------------------------------------------------------
    def _refill(self, st: _Stream) -> None:
        """A pull stream keeps exactly its next piece in hand (its key depends on it)."""
        if st.items or st.source is None:
            return
        piece = next(st.source, None)
        if piece is PENDING:  # nothing yet: not ready until woken
            if not st.waiting:
                st.waiting = True
                st.flow.pending += 1
            return
        if st.waiting:
            st.waiting = False
            st.flow.pending -= 1
        if piece is None:
            st.source = None
            return
        if piece.publisher_priority is not None:
            st.publisher_priority = piece.publisher_priority
        if piece.group_id is not None:
            st.group_id = piece.group_id
        st.items.append(piece)

    def _rank_stream(self, st: _Stream) -> None:
        flow = st.flow
        if flow.closed or st.sid not in self.streams:
            return
        if st.items:
            flow.ready.push(st.sid, st.key())
        else:
            flow.ready.discard(st.sid)
        self._rank_flow(flow)

    def _rank_flow(self, flow: Flow) -> None:
        best = flow.ready.peek_key()
        if best is None or flow.closed:
            self.ready.discard(flow)
        else:
            self.ready.push(flow, (flow.priority, best[0], flow.turn))
