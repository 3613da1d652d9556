"""One delivery of one layer's payload into its destination, hashed while it arrives.

DESIGN.md §6: "object payloads are written once, straight into the destination buffer; digests
are computed incrementally while bytes arrive". A :class:`Reception` owns no payload memory:
``dest`` is the sink's preallocated region (numpy block, tensor storage or pinned staging slot).

Octets arrive in order (one MOQT object is one byte stream, binding v1). Either the sink copies
them in (:meth:`feed`), or the transport writes them itself and reports how many
(:meth:`advance`); in both cases the hash is updated with the newly written region of ``dest``,
chunk by chunk. A transport that reports no progress at all (the ``on_object_begin`` path of
``kvsp_moq.pubsub``, which has no per-chunk hook) gets the whole region hashed by
:meth:`finish`. The hash always covers the destination's own octets, so what is verified is
exactly what a consumer will see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .errors import SinkError

__all__ = ["HashFactory", "Hasher", "Reception"]


class Hasher(Protocol):
    """The part of a ``hashlib`` object a reception uses."""

    def update(self, data: memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


HashFactory = Callable[[], Hasher]


class Reception:
    """Receive ``len(dest)`` octets into ``dest`` (a writable, flat ``uint8`` memoryview)."""

    __slots__ = ("_dest", "_hash", "_written", "_hashed", "_progress", "layer")

    def __init__(self, layer: int, dest: memoryview, hash_factory: HashFactory) -> None:
        self.layer = layer
        self._dest = dest
        self._hash = hash_factory()
        self._written = 0  # octets reported written, from the start of dest
        self._hashed = 0  # octets of dest already hashed (== _written while progress is reported)
        self._progress = False  # whether feed/advance was ever used for this delivery

    @property
    def length(self) -> int:
        return self._dest.nbytes

    @property
    def written(self) -> int:
        return self._written

    def feed(self, chunk: memoryview) -> None:
        """Copy ``chunk`` (a flat byte view) to the write position and hash it."""
        n = chunk.nbytes
        start = self._reserve(n)
        region = self._dest[start : start + n]
        region[:] = chunk  # the one copy, when the transport cannot write in place
        self._hash_to(start + n)

    def advance(self, n: int) -> None:
        """The transport wrote the next ``n`` octets of ``dest`` itself: hash them now."""
        start = self._reserve(n)
        self._hash_to(start + n)

    def finish(self) -> bytes:
        """The payload is complete: return SHA-256 of ``dest``.

        SinkError when progress was reported but fewer octets than the length arrived.
        """
        if self._progress and self._written != self.length:
            raise SinkError(
                f"layer {self.layer}: truncated, {self._written} of {self.length} octets arrived"
            )
        self._hash_to(self.length)  # no progress reported: the transport wrote it all in place
        return self._hash.digest()

    def _reserve(self, n: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise SinkError(f"layer {self.layer}: octet count must be an integer >= 0, got {n!r}")
        start = self._written
        if n > self.length - start:
            raise SinkError(
                f"layer {self.layer}: {start + n} octets exceed the payload length {self.length}"
            )
        self._progress = True
        self._written = start + n
        return start

    def _hash_to(self, end: int) -> None:
        if end > self._hashed:
            self._hash.update(self._dest[self._hashed : end])
            self._hashed = end
