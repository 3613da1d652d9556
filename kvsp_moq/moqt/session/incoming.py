"""Routing of the peer's unidirectional streams and datagrams (sans-IO; part of
:class:`~.machine.SessionMachine`).

Each peer-opened unidirectional stream is typed by its first vi64 (§"Unidirectional Stream
Types"): the control stream goes back to the session; a data stream is parsed and routed to
the request it belongs to — SUBGROUP_HEADER by Track Alias (held, up to
``max_pending_stream_bytes``, while SUBSCRIBE_OK / PUBLISH may still be on its way: "MAY
buffer"), FETCH_HEADER by Request ID; padding streams are discarded (§"Padding Streams").
Datagrams are routed by Track Alias. Data for ended subscriptions and fetches is stopped
with CANCELLED. Streams held for unknown aliases are bounded three ways (beyond each:
STOP_SENDING EXCESSIVE_LOAD): ``max_pending_stream_bytes`` each, ``max_pending_streams`` at
once, ``max_pending_total_bytes`` together.

State is bounded by what is open, not by the session's history: finished streams are a
:class:`~.streams.ClosedStreams` range set; a fetch stream naming a Request ID that was used
and is no longer routed is late (CANCELLED), which needs no per-request history; retired
Track Aliases are remembered, oldest first, up to ``max_id_gaps``; an alias's track is
forgotten with its last subscription.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ...wire.buffer import Buffer
from ...wire.errors import SessionErrorCode, StreamResetCode, WireError
from ..data import DataStreamParser, peek_stream_type
from ..messages import ControlStreamReader, violation
from ..objects import (
    FetchHeader,
    GroupOrder,
    ObjectDatagram,
    PaddingStreamHeader,
    StreamKind,
    SubgroupHeader,
)
from ..version import Version
from .config import SessionConfig
from .streams import ClosedStreams
from .events import (
    Action,
    DataEvent,
    DatagramReceived,
    DataStreamClosed,
    Event,
    StopSending,
)

__all__ = ["IncomingStreams"]


@dataclass(eq=False)
class _UniIn:
    """A peer-opened unidirectional stream."""

    head: bytearray = field(default_factory=bytearray)
    kind: StreamKind | None = None
    control: ControlStreamReader | None = None
    parser: DataStreamParser | None = None
    request_id: int | None = None
    #: Track Alias waiting for SUBSCRIBE_OK / PUBLISH; events held meanwhile.
    pending_alias: int | None = None
    pending: list[object] = field(default_factory=list)
    pending_bytes: int = 0
    pending_end: bool = False


class IncomingStreams:
    """The peer's unidirectional streams and datagrams, routed to requests.

    The session passes its event and action queues and three callables: ``established()``
    (the peer's SETUP arrived), ``hold(stream_id, data, end)`` (keep input until it does),
    and ``control(stream_id) -> ControlStreamReader`` (the peer's control stream opened;
    raises on a second) with ``control_data(reader, data, end)`` for its bytes;
    ``request_id_used(rid)``: the Request ID was used in this session (by either side)."""

    def __init__(self, version: Version, config: SessionConfig, events: deque[Event],
                 actions: deque[Action], *, established: Callable[[], bool],
                 hold: Callable[[int, Buffer, bool], None],
                 control: Callable[[int], ControlStreamReader],
                 control_data: Callable[[ControlStreamReader, Buffer, bool], None],
                 request_id_used: Callable[[int], bool]) -> None:
        self.version = version
        self.config = config
        self._events = events
        self._actions = actions
        self._established = established
        self._hold = hold
        self._control = control
        self._control_data = control_data
        self._request_id_used = request_id_used
        self._streams: dict[int, _UniIn] = {}
        #: Streams held for an unknown alias, and their bytes.
        self._pending_count = 0
        self._pending_total = 0
        #: Track Alias → request ID of the subscription receiving it.
        self._alias_in: dict[int, int] = {}
        #: Track Alias → its track, and the live requests using it (forgotten with the last).
        self._alias_track: dict[int, tuple[tuple[bytes, ...], bytes]] = {}
        self._alias_users: dict[int, set[int]] = {}
        #: Aliases of ended subscriptions, oldest first (at most ``max_id_gaps``): late data is
        #: stopped; an alias retired longer ago is unknown again (held, then EXCESSIVE_LOAD).
        self._retired_aliases: dict[int, None] = {}
        #: Our FETCH / SUBSCRIBE request IDs that fetch streams may name (kept after the
        #: request stream ends, until the session retires them).
        self._fetch_routes: set[int] = set()
        #: Group order of each local FETCH, kept while its fetch stream may still arrive
        #: (the request itself can be over by then: FETCH_OK and FIN come first).
        self._fetch_orders: dict[int, GroupOrder] = {}
        #: The peer's streams that are over (request streams too): later bytes are ignored.
        self.dead_streams = ClosedStreams(config.max_id_gaps)

    # -- routes --------------------------------------------------------------------------
    def add_fetch_route(self, request_id: int, order: GroupOrder | None = None) -> None:
        """Fetch streams may name our request ``request_id`` (a FETCH, or a SUBSCRIBE's fill
        fetch streams); ``order``: the FETCH's Group Order."""
        self._fetch_routes.add(request_id)
        if order is not None:
            self._fetch_orders[request_id] = order

    def register_alias(self, request_id: int, alias: int, ns: tuple[bytes, ...],
                       name: bytes) -> None:
        """Route Track Alias ``alias`` (of track ``ns``/``name``) to ``request_id``."""
        # §"Track Alias": one alias for two different tracks → DUPLICATE_TRACK_ALIAS.
        track = self._alias_track.get(alias)
        if track is not None and track != (tuple(ns), bytes(name)):
            raise WireError(SessionErrorCode.DUPLICATE_TRACK_ALIAS,
                            f"Track Alias {alias} already names another track")
        self._alias_track[alias] = (tuple(ns), bytes(name))
        self._alias_users.setdefault(alias, set()).add(request_id)
        self._alias_in[alias] = request_id
        self._retired_aliases.pop(alias, None)
        self._release_pending(alias, request_id)

    def retire(self, request_id: int, alias: int | None) -> None:
        """The request is over: its late data streams and datagrams are stopped/dropped."""
        self._fetch_routes.discard(request_id)
        self._fetch_orders.pop(request_id, None)
        if alias is None:
            return
        users = self._alias_users.get(alias)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self._alias_users[alias]
                self._alias_track.pop(alias, None)
        if self._alias_in.get(alias) == request_id:
            del self._alias_in[alias]
            self._retired_aliases.pop(alias, None)
            self._retired_aliases[alias] = None
            while len(self._retired_aliases) > self.config.max_id_gaps:
                del self._retired_aliases[next(iter(self._retired_aliases))]

    def state_sizes(self) -> dict[str, int]:
        """Entries in each per-stream / per-request structure (all bounded by what is open)."""
        return {"uni_streams": len(self._streams), "aliases_in": len(self._alias_in),
                "alias_tracks": len(self._alias_track), "alias_users": len(self._alias_users),
                "retired_aliases": len(self._retired_aliases),
                "pending_streams": self._pending_count,
                "fetch_routes": len(self._fetch_routes), "fetch_orders": len(self._fetch_orders),
                **self.dead_streams.sizes()}

    # -- input ---------------------------------------------------------------------------
    def stream_data(self, stream_id: int, data: Buffer, end_stream: bool) -> None:
        st = self._streams.get(stream_id)
        if st is None:
            if stream_id in self.dead_streams:
                return
            st = self._streams[stream_id] = _UniIn()
        elif st.pending_end:
            raise violation("data after the end of a stream")
        if st.kind is None:
            st.head += data
            peeked = peek_stream_type(st.head, self.version)
            if peeked is None:
                if end_stream:
                    raise violation("stream ended inside its type")
                return
            st.kind = peeked[0]
            data, st.head = bytes(st.head), bytearray()
            if st.kind is StreamKind.CONTROL:
                st.control = self._control(stream_id)
            else:
                if not self._established():
                    # Data before SETUP: hold the bytes (re-fed after SETUP).
                    self._drop(stream_id)
                    self._hold(stream_id, data, end_stream)
                    return
                st.parser = DataStreamParser(self.version, group_order=self._fetch_order)
        if st.control is not None:
            self._control_data(st.control, data, end_stream)
            return
        assert st.parser is not None
        events = st.parser.feed(data, end_stream)
        self._route_data(stream_id, st, events, len(data), end_stream)

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        """The peer reset one of its unidirectional streams."""
        st = self._drop(stream_id)
        self.dead_streams.add(stream_id)
        if st is not None and st.request_id is not None:
            self._events.append(DataStreamClosed(st.request_id, stream_id, error_code))

    def limit_exceeded(self, stream_id: int, code: int) -> None:
        """A local resource limit on one data stream: cancel just that stream
        (draft-20 §"Resource Exhaustion")."""
        st = self._drop(stream_id)
        self.dead_streams.add(stream_id)
        self._actions.append(StopSending(stream_id, code))
        if st is not None and st.request_id is not None:
            self._events.append(DataStreamClosed(st.request_id, stream_id, code))

    def datagram(self, dg: ObjectDatagram) -> None:
        rid = self._alias_in.get(dg.track_alias)
        if rid is not None:
            self._events.append(DatagramReceived(rid, dg))
        # Unknown alias: the draft allows dropping (MAY buffer briefly); we drop.

    def stop(self, stream_id: int, code: int) -> None:
        """STOP_SENDING one data stream of the peer; later bytes are ignored."""
        self._drop(stream_id)
        self.dead_streams.add(stream_id)
        self._actions.append(StopSending(stream_id, code))

    def stop_request(self, request_id: int, code: int) -> None:
        """STOP_SENDING every data stream of the peer routed to ``request_id``."""
        for sid, st in list(self._streams.items()):
            if st.request_id == request_id:
                self.stop(sid, code)

    # -- routing -------------------------------------------------------------------------
    def _fetch_order(self, request_id: int) -> GroupOrder:
        return self._fetch_orders.get(request_id, GroupOrder.ASCENDING)

    def _route_data(self, stream_id: int, st: _UniIn, events: list[object], nbytes: int,
                    end_stream: bool) -> None:
        for ev in events:
            if st.request_id is None and st.pending_alias is None:
                self._bind_data_stream(stream_id, st, ev)
                if stream_id not in self._streams:
                    return  # stopped
            if st.request_id is None:
                st.pending.append(ev)
                continue
            if not isinstance(ev, PaddingStreamHeader):
                self._events.append(DataEvent(st.request_id, stream_id, ev))
        if st.request_id is None and st.pending_alias is not None:
            st.pending_bytes += nbytes
            self._pending_total += nbytes
            st.pending_end = st.pending_end or end_stream
            if (st.pending_bytes > self.config.max_pending_stream_bytes
                    or self._pending_total > self.config.max_pending_total_bytes):
                self.stop(stream_id, StreamResetCode.EXCESSIVE_LOAD)
            return
        if end_stream:
            self._drop(stream_id)
            self.dead_streams.add(stream_id)
            if st.request_id is not None:
                self._events.append(DataStreamClosed(st.request_id, stream_id, None))

    def _bind_data_stream(self, stream_id: int, st: _UniIn, header: object) -> None:
        if isinstance(header, SubgroupHeader):
            rid = self._alias_in.get(header.track_alias)
            if rid is not None:
                st.request_id = rid
            elif header.track_alias in self._retired_aliases:
                self.stop(stream_id, StreamResetCode.CANCELLED)
            elif self._pending_count >= self.config.max_pending_streams:
                self.stop(stream_id, StreamResetCode.EXCESSIVE_LOAD)
            else:
                # Unknown alias: SUBSCRIBE_OK / PUBLISH may still be on its way (MAY buffer).
                st.pending_alias = header.track_alias
                self._pending_count += 1
        elif isinstance(header, FetchHeader):
            if header.request_id in self._fetch_routes:
                st.request_id = header.request_id
            elif self._request_id_used(header.request_id):
                # A used Request ID no longer routed: the fetch (or subscription) is over.
                self.stop(stream_id, StreamResetCode.CANCELLED)
            else:
                raise violation(f"fetch stream for unknown Request ID {header.request_id}")
        elif isinstance(header, PaddingStreamHeader):
            self._drop(stream_id)
            self.dead_streams.add(stream_id)  # discard the rest (§"Padding Streams")

    def _drop(self, stream_id: int) -> _UniIn | None:
        """Forget a stream (its held bytes leave the pending budget)."""
        st = self._streams.pop(stream_id, None)
        if st is not None and st.pending_alias is not None:
            self._unhold(st)
        return st

    def _unhold(self, st: _UniIn) -> None:
        self._pending_count -= 1
        self._pending_total -= st.pending_bytes
        st.pending_bytes = 0

    def _release_pending(self, alias: int, request_id: int) -> None:
        for stream_id, st in list(self._streams.items()):
            if st.pending_alias == alias and st.request_id is None:
                self._unhold(st)
                st.request_id, st.pending_alias = request_id, None
                pending, st.pending = st.pending, []
                for ev in pending:
                    self._events.append(DataEvent(request_id, stream_id, ev))
                if st.pending_end:
                    self._drop(stream_id)
                    self.dead_streams.add(stream_id)
                    self._events.append(DataStreamClosed(request_id, stream_id, None))
