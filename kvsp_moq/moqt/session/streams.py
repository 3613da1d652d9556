"""Who numbers the session's streams: the transport (RFC 9000 §2.1).

The sans-IO session asks for the ID of each stream it opens, as aioquic's H3 layer asks its
``QuicConnection.get_next_available_stream_id()``: a synchronous call, no I/O. The I/O layer
passes an allocator over its transport connection (``kvsp_moq.pubsub.driver``), whose
backends (aioquic, qh3, picoquic) allocate the IDs themselves; sans-IO use and tests get
:class:`StreamCounter`, the RFC 9000 numbering.
"""

from __future__ import annotations

from typing import Protocol

from ..rangeset import RangeSet

__all__ = ["ClosedStreams", "StreamCounter", "StreamIdAllocator", "stream_id"]


class StreamIdAllocator(Protocol):
    """Opens locally initiated streams and returns their QUIC stream IDs."""

    def open_uni(self) -> int: ...

    def open_bidi(self) -> int: ...


def stream_id(index: int, is_client: bool, uni: bool) -> int:
    """The ID of the ``index``-th locally initiated stream of its type (RFC 9000 §2.1)."""
    return (index << 2) | (0 if is_client else 1) | (2 if uni else 0)


class StreamCounter:
    """:class:`StreamIdAllocator` numbering streams in RFC 9000 order (no transport)."""

    def __init__(self, is_client: bool) -> None:
        self.is_client = is_client
        self._next = {True: 0, False: 0}

    def _open(self, uni: bool) -> int:
        sid = stream_id(self._next[uni], self.is_client, uni)
        self._next[uni] += 1
        return sid

    def open_uni(self) -> int:
        return self._open(True)

    def open_bidi(self) -> int:
        return self._open(False)


class ClosedStreams:
    """The peer's streams that are over (finished, reset, stopped or discarded), so that late
    bytes on one are ignored rather than taken for a new stream.

    One :class:`~kvsp_moq.moqt.rangeset.RangeSet` per stream type (the two low bits of the
    ID: initiator and direction) over ``stream_id >> 2`` (RFC 9000 §2.1: each type's streams
    are opened in order): a watermark plus a range per run above a stream still open.
    ``max_gaps`` bounds each: beyond that many gaps the lowest are taken as closed (a stream
    the peer opens there later is ignored). Callers look up their open streams first."""

    __slots__ = ("_types", "_max_gaps")

    def __init__(self, max_gaps: int = 4096) -> None:
        self._types = (RangeSet(), RangeSet(), RangeSet(), RangeSet())
        self._max_gaps = max_gaps

    def add(self, stream_id: int) -> None:
        ranges = self._types[stream_id & 3]
        ranges.add(stream_id >> 2)
        ranges.fill_gaps(self._max_gaps + 1)

    def __contains__(self, stream_id: int) -> bool:
        return (stream_id >> 2) in self._types[stream_id & 3]

    def sizes(self) -> dict[str, int]:
        """Ranges held, bidirectional and unidirectional streams (of the peer)."""
        return {"closed_bidi_ranges": len(self._types[0]) + len(self._types[1]),
                "closed_uni_ranges": len(self._types[2]) + len(self._types[3])}
