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

Off the event loop (docs/perf/README.md): a reception given a ``worker`` (a one-thread
executor, :func:`hash_worker`) hands the hash updates to it in batches of at least ``batch``
octets instead of hashing on the caller's thread. ``hashlib`` releases the GIL while it hashes
a buffer larger than 2 KiB, so the digest of a large layer is computed on another core while
the event loop keeps receiving; one worker thread runs the updates of every reception in
submission order, so each hash sees its octets in order. :meth:`finish` waits for the last
update; :meth:`flush` returns it as a future for an ``await`` (``LayerSink.end_layer_async``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Protocol

from .errors import SinkError

__all__ = ["HASH_BATCH", "HashFactory", "Hasher", "Reception", "hash_worker"]

#: Octets handed to the hash worker at a time: large enough that the hand-off costs little
#: next to hashing them (~0.15 ms for 256 KiB at ~1.8 GB/s), small enough that the tail left
#: to hash when the object ends is short.
HASH_BATCH = 256 * 1024

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def hash_worker() -> Executor:
    """The process's hash worker: one thread, shared by every sink (FIFO: per-reception order)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-sink-hash")
        return _worker


class Hasher(Protocol):
    """The part of a ``hashlib`` object a reception uses."""

    def update(self, data: memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


HashFactory = Callable[[], Hasher]


class Reception:
    """Receive ``len(dest)`` octets into ``dest`` (a writable, flat ``uint8`` memoryview)."""

    __slots__ = ("_dest", "_hash", "_written", "_hashed", "_progress", "layer", "_worker",
                 "_batch", "_pending")

    def __init__(self, layer: int, dest: memoryview, hash_factory: HashFactory, *,
                 worker: Executor | None = None, batch: int = HASH_BATCH) -> None:
        self.layer = layer
        self._worker = worker
        self._batch = batch
        self._pending: Future[None] | None = None  # the last update handed to the worker
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
        self._hash_to(self.length, force=True)  # no progress: the transport wrote it all in place
        if self._pending is not None:
            self._pending.result()  # the worker's last update (FIFO: all earlier ones too)
        return self._hash.digest()

    def flush(self) -> Future[None] | None:
        """Hand what is left to hash to the worker; the future of the last update, or None
        when nothing is pending (no worker, or a truncated payload :meth:`finish` reports)."""
        if self._progress and self._written != self.length:
            return None
        self._hash_to(self.length, force=True)
        return self._pending

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

    def _hash_to(self, end: int, force: bool = False) -> None:
        if end <= self._hashed:
            return
        if self._worker is None:
            self._hash.update(self._dest[self._hashed : end])
        elif force or end - self._hashed >= self._batch:
            self._pending = self._worker.submit(self._hash.update, self._dest[self._hashed : end])
        else:
            return  # batched: hashed once a batch is complete, or at the end
        self._hashed = end
