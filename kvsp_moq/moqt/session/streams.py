"""Who numbers the session's streams: the transport (RFC 9000 §2.1).

The sans-IO session asks for the ID of each stream it opens, as aioquic's H3 layer asks its
``QuicConnection.get_next_available_stream_id()``: a synchronous call, no I/O. The I/O layer
passes an allocator over its transport connection (``kvsp_moq.pubsub.driver``), whose
backends (aioquic, qh3, picoquic) allocate the IDs themselves; sans-IO use and tests get
:class:`StreamCounter`, the RFC 9000 numbering.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["StreamCounter", "StreamIdAllocator", "stream_id"]


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
