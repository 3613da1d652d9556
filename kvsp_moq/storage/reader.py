"""Streaming a stored replica as a KVB1 container (kvsp-draft §4.3, §6.7).

A :class:`BlockReader` yields the container of a layer range as memoryview chunks: the header
(encoded by the container module), then each layer's K and V sections straight from the tier
that holds them (views of host buffers or of the mapped disk file; a staged copy of one layer
at a time for accelerator memory). The whole container is never assembled in memory. Its
size is known before the first chunk (``Content-Length``), and its SHA-256 (``Repr-Digest``,
§6.7) is either cached (the full container, once computed) or computed by one pass over the
same chunks, or incrementally by the consumer while it sends them.

The layers a reader covers are fixed when it is opened: a later eviction or move of the
replica does not change what it streams (the views keep the octets alive, and stored octets
are never rewritten in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from hashlib import sha256

from ..kvsp.container import ContainerHeader
from .keys import RecordKey
from .tiers import Location

__all__ = ["BlockReader"]

#: One layer's octets: a view taken at open, or a location staged when the layer is reached.
LayerPart = memoryview | Location


def _chunks(view: memoryview, chunk_size: int | None) -> Iterator[memoryview]:
    n = view.nbytes
    if not n:
        return
    if chunk_size is None or n <= chunk_size:
        yield view
        return
    for start in range(0, n, chunk_size):
        yield view[start : start + chunk_size]


class BlockReader:
    """The container of layers ``first_layer..last_layer`` of one replica, as a stream.

    Iterate it (more than once if needed) to get the chunks; ``size`` is the total octet count.
    """

    def __init__(
        self,
        key: RecordKey,
        replica_id: bytes,
        header: ContainerHeader,
        parts: Sequence[LayerPart],
        *,
        chunk_size: int | None = None,
        known_sha256: bytes | None = None,
        on_sha256: Callable[[bytes], None] | None = None,
    ) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.key = key
        self.replica_id = replica_id
        self.header = header
        self._parts = tuple(parts)
        self._chunk_size = chunk_size
        self._sha256 = known_sha256
        self._on_sha256 = on_sha256
        self._header_bytes = header.encode()

    @property
    def first_layer(self) -> int:
        return self.header.first_layer

    @property
    def last_layer(self) -> int:
        return self.header.last_layer

    @property
    def size(self) -> int:
        """Octets of the container (for ``Content-Length``)."""
        return self.header.total_size

    def __iter__(self) -> Iterator[memoryview]:
        """Header, then for each layer ascending its K and then its V section (§4.3)."""
        yield memoryview(self._header_bytes).toreadonly()
        for part, (k_len, v_len) in zip(self._parts, self.header.lengths, strict=True):
            payload = part if isinstance(part, memoryview) else part.payload()
            yield from _chunks(payload[:k_len], self._chunk_size)
            yield from _chunks(payload[k_len : k_len + v_len], self._chunk_size)

    def layer_payloads(self) -> Iterator[tuple[int, memoryview]]:
        """(layer, K || V) for each layer: the MOQT object payloads of binding v1."""
        for layer, part in zip(range(self.first_layer, self.last_layer + 1), self._parts):
            yield layer, part if isinstance(part, memoryview) else part.payload()

    @property
    def known_sha256(self) -> bytes | None:
        """The container's SHA-256 if already known (no pass over the data needed)."""
        return self._sha256

    def sha256(self) -> bytes:
        """The SHA-256 of the container (``Repr-Digest``, §6.7): cached, or one streaming pass
        (no copy) whose result the store caches for the full container."""
        if self._sha256 is None:
            h = sha256()
            for chunk in self:
                h.update(chunk)
            self._sha256 = h.digest()
            if self._on_sha256 is not None:
                self._on_sha256(self._sha256)
        return self._sha256

    def __repr__(self) -> str:
        return (
            f"BlockReader({self.key}, layers {self.first_layer}-{self.last_layer}, "
            f"{self.size} octets)"
        )
