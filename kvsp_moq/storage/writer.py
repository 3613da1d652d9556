"""Writing a block while it is being computed (prefill streaming to decode).

:meth:`BlockStore.begin <kvsp_moq.storage.store.BlockStore.begin>` reserves room for every
layer up front (placement and eviction happen then, so a write never fails for lack of
space) and returns a :class:`BlockWriter`. Each :meth:`~BlockWriter.write_layer` copies one
layer once into its tier, computes its layer digest (§4.3) and emits a :class:`LayerWritten`
to the listeners at once, so a publisher can send layer ``l`` (binding v1: object ``l``)
while layer ``l + 1`` is still being computed. Written layers can already be read.
A receiver (a prefetch over MOQT) can instead land a layer in place: it receives the payload
into :meth:`~BlockWriter.landing_view` (the tier's own memory), hashing as the octets arrive,
and :meth:`~BlockWriter.commit_layer` records the digest it verified (one copy, one hash per
octet; a tier without a writable view takes a staged buffer, copied once).
:meth:`~BlockWriter.finish` seals the replica (disk files are fsynced and renamed into place);
:meth:`~BlockWriter.abort` drops it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..kvsp.layout import Geometry, encode_raw_layer
from .keys import RecordKey
from .replica import ReplicaInfo, StoredReplica

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["BlockWriter", "LayerListener", "LayerWritten", "ReplicaWrites"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerWritten:
    """Layer ``layer`` of replica ``replica_id`` is stored and readable."""

    key: RecordKey
    replica_id: bytes
    layer: int
    digest: bytes  # SHA-256(K || V) (§4.3)
    k_len: int
    v_len: int
    remaining: int  # layers still to be written


LayerListener = Callable[[LayerWritten], None]


class ReplicaWrites(Protocol):
    """What a :class:`BlockWriter` needs from the store that owns its replica.

    The store passes it in (:meth:`BlockStore.begin
    <kvsp_moq.storage.store.BlockStore.begin>`), so this module does not import the store.
    """

    def write_layer(self, replica: StoredReplica, layer: int, k: object, v: object) -> bytes:
        """Store one layer of ``replica`` and return its layer digest (§4.3)."""
        ...

    def landing_view(self, replica: StoredReplica, layer: int) -> memoryview | None:
        """A writable view of the location reserved for an unwritten layer, or None when its
        tier cannot give one (disk, accelerator memory)."""
        ...

    def commit_layer(self, replica: StoredReplica, layer: int, digest: bytes,
                     staged: memoryview | None) -> bytes:
        """Mark a layer written with the digest the caller computed over its octets (in the
        landing view, or in ``staged``, which is copied in once); not hashed again."""
        ...

    def finish(self, replica: StoredReplica) -> ReplicaInfo:
        """Seal ``replica``: IncompleteReplica if a layer is missing."""
        ...

    def abort(self, replica: StoredReplica) -> None:
        """Drop ``replica`` (its evict listeners are called)."""
        ...


class BlockWriter:
    """Fills one replica layer by layer (any order, each layer once)."""

    def __init__(
        self, store: ReplicaWrites, replica: StoredReplica, geometry: Geometry | None
    ) -> None:
        self._store = store
        self._replica = replica
        self._geometry = geometry
        self._listeners: list[LayerListener] = []
        self._remaining = len(replica.lengths)

    @property
    def key(self) -> RecordKey:
        return self._replica.key

    @property
    def replica_id(self) -> bytes:
        return self._replica.replica_id

    @property
    def layers(self) -> range:
        return self._replica.layers

    @property
    def token_count(self) -> int:
        return self._replica.token_count

    @property
    def missing_layers(self) -> list[int]:
        r = self._replica
        return [layer for layer, d in zip(r.layers, r.digests) if d is None]

    @property
    def open(self) -> bool:
        """Still accepting layers (neither finished nor aborted nor evicted)."""
        return self._replica.writing and not self._replica.dead

    def add_listener(self, listener: LayerListener) -> None:
        """Call ``listener`` after each layer is stored. Exceptions it raises are logged."""
        self._listeners.append(listener)

    def write_layer(self, layer: int, k: object, v: object) -> bytes:
        """Store layer ``layer`` (absolute index) and return its digest.

        ``k`` and ``v`` are the K and V sections: buffers (bytes, memoryview, numpy arrays)
        or torch tensors. numpy arrays shaped ``[tokens, kv_heads, head_dim]`` are laid out
        per kvsp-layout-1 first (§4.3). ContainerError on a wrong layer or section size.
        """
        if isinstance(k, np.ndarray) and isinstance(v, np.ndarray) and self._geometry is not None:
            k, v = encode_raw_layer(k, v, self._geometry)
        digest = self._store.write_layer(self._replica, layer, k, v)
        self._written(layer, digest)
        return digest

    # -- landing: a receiver writes a layer into place itself (one copy, one hash) ------------

    def landing_view(self, layer: int) -> memoryview | None:
        """Where layer ``layer``'s K || V can be received in place: a writable view of the
        memory reserved for it (a host tier), or None (disk, accelerator memory: receive into
        a buffer of your own and pass it to :meth:`commit_layer` as ``staged``). The layer is
        not readable until :meth:`commit_layer`; a failed delivery may simply be received
        into the view again."""
        return self._store.landing_view(self._replica, layer)

    def commit_layer(self, layer: int, digest: bytes, staged: memoryview | None = None) -> None:
        """Layer ``layer`` has landed (in :meth:`landing_view`, or in ``staged``: K || V, copied
        once into place now) and ``digest`` is the SHA-256 the receiver computed over exactly
        those octets as they arrived and verified against the Replica Record (§4.3): it is
        recorded, not computed again. Listeners get the :class:`LayerWritten` as after
        :meth:`write_layer`."""
        self._written(layer, self._store.commit_layer(self._replica, layer, digest, staged))

    def _written(self, layer: int, digest: bytes) -> None:
        self._remaining -= 1
        k_len, v_len = self._replica.lengths[layer - self._replica.first_layer]
        event = LayerWritten(self.key, self.replica_id, layer, digest, k_len, v_len, self._remaining)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a listener must not break storage
                log.exception("layer listener %r failed", listener)

    def finish(self) -> ReplicaInfo:
        """Seal the replica: IncompleteReplica if a layer is missing (the writer stays open)."""
        return self._store.finish(self._replica)

    def abort(self) -> None:
        """Drop the replica (evict listeners are called: it may have been announced)."""
        self._store.abort(self._replica)

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.open:
            if exc_type is None:
                self.finish()
            else:
                self.abort()

    def __repr__(self) -> str:
        return f"BlockWriter({self.key}, {self._remaining} layers to write)"
