"""A layer sink into preallocated numpy arrays (works without torch).

Memory: one C-contiguous array ``[layers, 2, tokens, kv_heads, head_dim]`` of the element
type's ``numpy_storage`` dtype (kvsp-draft §11.2.3: bf16 and fp8 as their raw unsigned bit
patterns), allocated once. Layer ``l``'s block ``[2, tokens, kv_heads, head_dim]`` is exactly
its binding-v1 payload K || V (kvsp-layout-1, §4.3), so the transport writes the payload
straight into it and K = block[0], V = block[1] are views: zero copies after receipt.

Byte order: the storage dtypes are explicitly little-endian (``<f4``, ``<u2``, ...), as
kvsp-layout-1 is, so the views are correct on any host without a byte swap.
"""

from __future__ import annotations

from hashlib import sha256

import numpy as np

from ..kvsp.layout import Geometry
from ._reception import HashFactory
from .base import DEFAULT_HASH_OFFLOAD_BYTES, Digests, LayerSink

__all__ = ["NumpySink"]


class NumpySink(LayerSink[tuple[np.ndarray, np.ndarray]]):
    """Layers as numpy arrays ``[tokens, kv_heads, head_dim]``; :meth:`layer` returns read-only
    K and V views of the verified block (the sink's memory: keep the sink alive with them)."""

    def __init__(
        self,
        geometry: Geometry,
        tokens: int,
        layers: tuple[int, int],
        digests: Digests,
        *,
        hash_factory: HashFactory = sha256,
        hash_offload_bytes: int | None = DEFAULT_HASH_OFFLOAD_BYTES,
    ) -> None:
        super().__init__(geometry, tokens, layers, digests, hash_factory=hash_factory,
                         hash_offload_bytes=hash_offload_bytes)
        shape = (self.layer_count, 2, *geometry.shape(tokens))
        # Uninitialised on purpose: a layer's octets become visible only once verified.
        self._blocks = np.empty(shape, dtype=geometry.numpy_dtype)
        self._octets = self._blocks.reshape(self.layer_count, -1).view(np.uint8)

    @property
    def nbytes(self) -> int:
        """Octets preallocated for payloads (all layers)."""
        return int(self._blocks.nbytes)

    def _acquire(self, position: int) -> memoryview:
        return memoryview(self._octets[position])  # the layer's K || V block itself

    def _publish(self, position: int) -> None:
        pass  # the payload already is the arrays' memory

    def _view(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        block = self._blocks[position].view()
        block.flags.writeable = False
        return block[0], block[1]
