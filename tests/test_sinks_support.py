"""Shared helpers of the layer-sink tests (tests/test_sinks*.py); holds no tests itself.

- :func:`make_block`: a codec-raw block built with ``layout.encode_raw_block`` from random
  arrays (random bit patterns, so every dtype's NaNs/infs/denormals are covered), with each
  layer's binding-v1 payload (K || V) and layer digest;
- :class:`FakeEngine`: a CPU stand-in for the CUDA copy engine whose copies stay pending until
  the test completes them, so the staged (pinned staging, side stream, events) path of
  ``TorchSink`` runs without a GPU;
- :func:`kv_octets`, :func:`assert_identical`: the raw octets of a sink's K and V for a layer
  (bit-exact comparison); :func:`deliver`: one delivery, whole or cut into chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.kvsp.layout import Geometry, encode_raw_block
from kvsp_moq.kvsp.registries import ELEMENT_TYPES

DTYPES = sorted(ELEMENT_TYPES)


@dataclass
class Block:
    geometry: Geometry
    tokens: int
    first_layer: int
    arrays: list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V), numpy storage dtype
    payloads: dict[int, bytes]  # absolute layer -> K || V
    digests: list[bytes]  # Replica Record form: layer l at index l (zeros below first_layer)

    @property
    def layers(self) -> tuple[int, int]:
        return (self.first_layer, self.first_layer + len(self.arrays) - 1)

    def source_octets(self, layer: int) -> tuple[bytes, bytes]:
        k, v = self.arrays[layer - self.first_layer]
        return k.tobytes(), v.tobytes()


def make_block(dtype: str, *, tokens: int = 3, kv_heads: int = 2, head_dim: int = 4,
               layers: int = 3, first_layer: int = 0, seed: int = 0) -> Block:
    geometry = Geometry.from_descriptor_fields(kv_heads, head_dim, dtype)
    rng = np.random.default_rng(seed)
    storage = geometry.numpy_dtype
    shape = geometry.shape(tokens)
    nbytes = tokens * kv_heads * head_dim * storage.itemsize

    def random_section() -> np.ndarray:
        return rng.integers(0, 256, nbytes, dtype=np.uint8).view(storage).reshape(shape)

    arrays = [(random_section(), random_section()) for _ in range(layers)]
    container = decode_container(encode_raw_block(arrays, geometry, first_layer),
                                 geometry=geometry)
    payloads = {first_layer + i: bytes(container.layer_payload(first_layer + i))
                for i in range(layers)}
    digests = [bytes(32)] * first_layer + container.layer_digests()
    for layer, payload in payloads.items():  # binding v1: SHA-256(payload) is the layer digest
        assert hashlib.sha256(payload).digest() == digests[layer]
    return Block(geometry, tokens, first_layer, arrays, payloads, digests)


def kv_octets(sink: Any, layer: int) -> tuple[bytes, bytes]:
    """Raw octets of the (K, V) a sink exposes for ``layer`` (numpy arrays or tensors)."""
    k, v = sink.layer(layer)
    if isinstance(k, np.ndarray):
        return k.tobytes(), v.tobytes()
    import torch

    def octets(t: Any) -> bytes:
        return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    return octets(k), octets(v)


def deliver(sink: Any, layer: int, payload: bytes, cuts: list[int] | None = None,
            *, in_place: bool = False) -> bool:
    """Deliver ``payload`` as ``layer`` in pieces split at ``cuts``, through ``feed`` or written
    in place and reported with ``chunk_written``; end it; return the verdict."""
    dest = sink.begin_layer(layer, len(payload))
    assert len(dest) == len(payload) and not dest.readonly
    src = memoryview(payload)
    bounds = [0, *sorted(set(c for c in (cuts or []) if 0 < c < len(payload))), len(payload)]
    for start, end in zip(bounds, bounds[1:]):
        if in_place:
            dest[start:end] = src[start:end]  # the transport writes, then reports progress
            sink.chunk_written(layer, end - start)
        else:
            sink.feed(layer, src[start:end])
    return bool(sink.end_layer(layer))


def assert_identical(sink: Any, block: Block, layer: int) -> None:
    assert kv_octets(sink, layer) == block.source_octets(layer)


class FakeEvent:
    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self._engine.synchronized.append(self)
        self._engine.complete(until=self)


class FakeEngine:
    """CopyEngine on the CPU: ``copy_async`` queues the copy (like a DMA on a side stream);
    :meth:`complete` performs queued copies in order and marks their events done."""

    SENTINEL = 0xA5

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self.device = torch.device("cpu")
        self.pending: list[tuple[Any, Any, int, FakeEvent]] = []
        self.copies = 0
        self.staging_allocations = 0
        self.waits: list[tuple[FakeEvent, Any]] = []
        self.synchronized: list[FakeEvent] = []
        self.device_buffer: Any = None

    def alloc_device(self, nbytes: int) -> Any:
        self.device_buffer = self._torch.full((nbytes,), self.SENTINEL, dtype=self._torch.uint8)
        return self.device_buffer

    def alloc_staging(self, nbytes: int) -> Any:
        self.staging_allocations += 1
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def copy_async(self, dst: Any, src: Any, swap_itemsize: int) -> FakeEvent:
        event = FakeEvent(self)
        self.pending.append((dst, src, swap_itemsize, event))
        return event

    def stream_wait(self, event: FakeEvent, stream: Any | None) -> None:
        self.waits.append((event, stream))

    def complete(self, until: FakeEvent | None = None) -> None:
        from kvsp_moq.sinks._torch import byteswap_elements

        while self.pending:
            dst, src, swap, event = self.pending.pop(0)
            dst.copy_(src)
            byteswap_elements(dst, swap)
            event.done = True
            self.copies += 1
            if event is until:
                return
