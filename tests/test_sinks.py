"""Layer sinks (kvsp_moq.sinks, docs/sinks.md): the contract, for every sink and element type.

Each block is made with ``layout.encode_raw_block`` from random arrays and its binding-v1
payloads (K || V per layer, kvsp-draft §4.3) are delivered whole, in random chunks
(hypothesis), byte by byte, through ``feed`` (the sink copies) and through the destination
view plus ``chunk_written`` (the transport writes in place). The sinks:

- ``numpy``: NumpySink;
- ``torch-cpu``: TorchSink on the CPU (payload straight into the tensors' storage);
- ``torch-staged``: TorchSink's CUDA path (pinned staging ring, copy after verification, one
  event per layer) driven by a CPU stand-in engine (tests/test_sinks_support.py).

No test sleeps: ordering is proven with futures that would deadlock (and hit the safety-net
timeout) if a layer were held back until the next one completed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.sinks._reception import HASH_BATCH
from kvsp_moq.sinks import (
    LayerFailed,
    LayerSink,
    LayerState,
    NumpySink,
    SinkError,
    make_sink,
)
from test_sinks_support import (
    DTYPES,
    Block,
    FakeEngine,
    assert_identical,
    deliver,
    kv_octets,
    make_block,
)

GUARD = 10.0
BACKENDS = ["numpy", "torch-cpu", "torch-staged"]


def new_sink(backend: str, block: Block, **kw: Any) -> tuple[LayerSink[Any], Callable[[], None]]:
    """A sink for ``block`` and a ``settle()`` that lets pending device copies finish."""
    args = (block.geometry, block.tokens, block.layers, block.digests)
    if backend == "numpy":
        return NumpySink(*args, **kw), lambda: None
    pytest.importorskip("torch")
    from kvsp_moq.sinks import TorchSink

    if backend == "torch-cpu":
        return TorchSink(*args, **kw), lambda: None
    engine = FakeEngine()
    return TorchSink(*args, copy_engine=engine, **kw), engine.complete


# ---------------------------------------------------------------------------------------------
# Bit-exact delivery


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["feed", "in-place"])
def test_whole_payloads_bit_identical(backend: str, dtype: str, in_place: bool) -> None:
    block = make_block(dtype, tokens=5, kv_heads=2, head_dim=8, layers=4, first_layer=2)
    sink, settle = new_sink(backend, block)
    for layer, payload in block.payloads.items():
        assert deliver(sink, layer, payload, in_place=in_place)
    settle()
    assert sink.ready_layers == (2, 3, 4, 5) and sink.complete and sink.missing_layers() == ()
    for layer in block.payloads:
        assert_identical(sink, block, layer)
        k, v = sink.layer(layer)
        assert tuple(k.shape) == tuple(v.shape) == (5, 2, 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_transport_progress_whole_region_hashed_at_end(backend: str, dtype: str) -> None:
    # The kvsp_moq.pubsub path: on_object_begin's view is filled, no per-chunk report.
    block = make_block(dtype)
    sink, settle = new_sink(backend, block)
    for layer, payload in block.payloads.items():
        sink.begin_layer(layer, len(payload))[:] = payload
        assert sink.end_layer(layer)
    settle()
    for layer in block.payloads:
        assert_identical(sink, block, layer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_chunking_bit_identical(backend: str, dtype: str, data: st.DataObject) -> None:
    block = make_block(dtype, tokens=data.draw(st.integers(1, 6)), kv_heads=2, head_dim=4,
                       layers=3, seed=data.draw(st.integers(0, 2**32 - 1)))
    sink, settle = new_sink(backend, block)
    size = block.geometry.section_bytes(block.tokens) * 2
    order = data.draw(st.permutations(sorted(block.payloads)))  # any arrival order
    for layer in order:
        cuts = data.draw(st.lists(st.integers(1, size - 1), max_size=12))
        assert deliver(sink, layer, block.payloads[layer], cuts, in_place=data.draw(st.booleans()))
    settle()
    for layer in block.payloads:
        assert_identical(sink, block, layer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["feed", "in-place"])
def test_byte_by_byte(backend: str, dtype: str, in_place: bool) -> None:
    block = make_block(dtype, tokens=2, kv_heads=1, head_dim=2, layers=2)
    sink, settle = new_sink(backend, block)
    for layer, payload in block.payloads.items():
        assert deliver(sink, layer, payload, list(range(1, len(payload))), in_place=in_place)
    settle()
    for layer in block.payloads:
        assert_identical(sink, block, layer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_feed_takes_any_contiguous_buffer(backend: str) -> None:
    block = make_block("int8", layers=1)
    sink, settle = new_sink(backend, block)
    sink.begin_layer(0, len(block.payloads[0]))
    k, v = block.arrays[0]
    sink.feed(0, k)  # an int8 [tokens, heads, dim] array: taken as its octets
    sink.feed(0, bytearray(v.tobytes()))
    assert sink.end_layer(0)
    settle()
    assert_identical(sink, block, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend: str) -> None:
    block = make_block("bf16", tokens=0)
    sink, settle = new_sink(backend, block)
    for layer, payload in block.payloads.items():
        assert payload == b"" and deliver(sink, layer, payload)
    settle()
    assert sink.complete and tuple(sink.layer(0)[0].shape) == (0, 2, 4)


# ---------------------------------------------------------------------------------------------
# Zero copy


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_payload_lands_in_the_arrays(dtype: str) -> None:
    block = make_block(dtype, layers=2)
    sink, _ = new_sink("numpy", block)
    dest = sink.begin_layer(1, len(block.payloads[1]))
    dest[:] = block.payloads[1]
    sink.end_layer(1)
    k, v = sink.layer(1)
    assert k.ctypes.data == _address(dest)
    assert v.ctypes.data == _address(dest) + sink.section_bytes
    assert k.dtype == block.geometry.numpy_dtype and not k.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cpu_payload_lands_in_the_tensors(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    block = make_block(dtype, layers=2)
    sink, _ = new_sink("torch-cpu", block)
    dest = sink.begin_layer(0, len(block.payloads[0]))
    dest[:] = block.payloads[0]
    sink.end_layer(0)
    k, v = sink.layer(0)
    assert k.data_ptr() == _address(dest)
    assert v.data_ptr() == _address(dest) + sink.section_bytes
    assert k.dtype == getattr(torch, block.geometry.dtype.torch_name)
    assert k.is_contiguous() and v.is_contiguous()


def test_receiving_allocates_nothing_proportional_to_the_payload() -> None:
    block = make_block("bf16", tokens=256, kv_heads=4, head_dim=64, layers=8)
    payload_total = sum(len(p) for p in block.payloads.values())  # 2 MiB
    sink = NumpySink(block.geometry, block.tokens, block.layers, block.digests)
    assert sink.nbytes == payload_total
    chunk = 4096
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for layer, payload in block.payloads.items():
            src = memoryview(payload)
            dest = sink.begin_layer(layer, len(payload))
            half = len(payload) // 2
            for pos in range(0, half, chunk):  # first half: the sink copies
                sink.feed(layer, src[pos : min(pos + chunk, half)])
            for pos in range(half, len(payload), chunk):  # second half: written in place
                end = min(pos + chunk, len(payload))
                dest[pos:end] = src[pos:end]
                sink.chunk_written(layer, end - pos)
            assert sink.end_layer(layer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 64 * 1024, f"{peak - before} octets allocated while receiving"
    assert peak - before < payload_total // 32
    for layer in block.payloads:
        assert_identical(sink, block, layer)


# ---------------------------------------------------------------------------------------------
# Incremental hashing


class CountingHash:
    """hashlib.sha256 that records the size of every update."""

    instances: list[CountingHash] = []

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.updates: list[int] = []
        CountingHash.instances.append(self)

    def update(self, data: memoryview) -> None:
        self.updates.append(memoryview(data).nbytes)
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_place", [False, True], ids=["feed", "in-place"])
def test_hash_is_updated_per_chunk_while_octets_arrive(backend: str, in_place: bool) -> None:
    CountingHash.instances = []
    block = make_block("fp16", tokens=16, kv_heads=2, head_dim=16, layers=1)
    sink, _ = new_sink(backend, block, hash_factory=CountingHash)
    payload = block.payloads[0]
    chunk = 100
    dest = sink.begin_layer(0, len(payload))
    (hasher,) = CountingHash.instances
    for pos in range(0, len(payload), chunk):
        piece = payload[pos : pos + chunk]
        if in_place:
            dest[pos : pos + len(piece)] = piece
            sink.chunk_written(0, len(piece))
        else:
            sink.feed(0, piece)
        # Hashed as it arrived: everything received so far is already in the digest state.
        assert sum(hasher.updates) == pos + len(piece)
    assert sink.end_layer(0)
    assert max(hasher.updates) <= chunk and sum(hasher.updates) == len(payload)
    assert len(hasher.updates) == -(-len(payload) // chunk)


class ThreadRecordingHash(CountingHash):
    """CountingHash that also records the thread of every update."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def update(self, data: memoryview) -> None:
        self.threads.add(threading.get_ident())
        super().update(data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "flipped"])
async def test_large_layers_are_hashed_off_the_event_loop(backend: str, tamper: bool) -> None:
    """A layer at least ``hash_offload_bytes`` long is hashed on the hash worker thread, in
    batches of at least HASH_BATCH octets (docs/perf/README.md), and verified as before."""
    CountingHash.instances = []
    block = make_block("fp16", tokens=512, kv_heads=4, head_dim=64, layers=2)  # 512 KiB layers
    sink, settle = new_sink(backend, block, hash_factory=ThreadRecordingHash,
                            hash_offload_bytes=1 << 16)
    for layer, payload in block.payloads.items():
        data = _flip(payload, len(payload) - 1) if tamper and layer == 1 else payload
        dest = sink.begin_layer(layer, len(data))
        for pos in range(0, len(data), 16384):  # in place, one QUIC packet at a time
            piece = data[pos : pos + 16384]
            dest[pos : pos + len(piece)] = piece
            sink.chunk_written(layer, len(piece))
        assert await sink.end_layer_async(layer) is not (tamper and layer == 1)
    settle()
    for hasher in CountingHash.instances:
        assert isinstance(hasher, ThreadRecordingHash)
        assert hasher.threads and threading.get_ident() not in hasher.threads
        assert sum(hasher.updates) == len(block.payloads[0])
        assert min(hasher.updates) >= HASH_BATCH or len(hasher.updates) == 1
    assert sink.state(0) is LayerState.READY
    assert sink.state(1) is (LayerState.FAILED if tamper else LayerState.READY)
    assert_identical(sink, block, 0)


class GatedHash:
    """sha256 whose updates wait (on the worker thread) until ``gate`` opens; ``entered``
    resolves on the loop when the first update began."""

    gate = threading.Event()
    entered: asyncio.Future[None] | None = None

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._loop = asyncio.get_running_loop()

    def update(self, data: memoryview) -> None:
        entered = GatedHash.entered
        if entered is not None:
            self._loop.call_soon_threadsafe(lambda: entered.done() or entered.set_result(None))
        GatedHash.gate.wait()
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_off_loop_hash_sync_end_and_abort_while_hashing(backend: str) -> None:
    """The synchronous end_layer waits for the worker; a layer aborted while its digest is
    being awaited fails and is not exposed."""
    block = make_block("fp16", tokens=512, kv_heads=4, head_dim=64, layers=2)
    GatedHash.gate.set()
    GatedHash.entered = None
    sink, settle = new_sink(backend, block, hash_factory=GatedHash, hash_offload_bytes=1)
    assert deliver(sink, 0, block.payloads[0], in_place=True)  # end_layer (sync) waits
    GatedHash.gate.clear()
    GatedHash.entered = asyncio.get_running_loop().create_future()
    try:
        dest = sink.begin_layer(1, len(block.payloads[1]))
        dest[:] = block.payloads[1]
        sink.chunk_written(1, len(block.payloads[1]))  # handed to the worker, which waits
        ending = asyncio.ensure_future(sink.end_layer_async(1))
        await GatedHash.entered  # the task ran first (FIFO), it awaits the worker now
        sink.abort(1, "stream reset")
    finally:
        GatedHash.gate.set()
    assert await ending is False
    settle()
    assert sink.state(1) is LayerState.FAILED and sink.state(0) is LayerState.READY
    with pytest.raises(LayerFailed):
        sink.layer(1)
    assert_identical(sink, block, 0)


# ---------------------------------------------------------------------------------------------
# Verification failures and re-delivery


def _flip(payload: bytes, at: int) -> bytes:
    bad = bytearray(payload)
    bad[at] ^= 0x01
    return bytes(bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
async def test_digest_mismatch_fails_the_layer_then_redelivery_succeeds(
    backend: str, dtype: str
) -> None:
    block = make_block(dtype, layers=3)
    sink, settle = new_sink(backend, block)
    waiter = asyncio.ensure_future(sink.wait_for_layer(1))
    assert deliver(sink, 0, block.payloads[0])
    assert not deliver(sink, 1, _flip(block.payloads[1], len(block.payloads[1]) // 2))
    with pytest.raises(LayerFailed) as info:
        await asyncio.wait_for(waiter, GUARD)
    assert info.value.layer == 1 and "digest mismatch" in info.value.reason
    # Never exposed: not through layer(), wait_for_layer() or the ready list.
    assert sink.state(1) is LayerState.FAILED and 1 not in sink.ready_layers
    assert sink.failed_layers == (1,) and "digest mismatch" in (sink.failure_reason(1) or "")
    with pytest.raises(LayerFailed):
        sink.layer(1)
    with pytest.raises(LayerFailed):
        await sink.wait_for_layer(1)
    assert sink.missing_layers() == (1, 2)
    # Re-delivery (another source) of the correct octets succeeds.
    waiter = asyncio.ensure_future(sink.wait_for_layer(1))
    assert deliver(sink, 1, block.payloads[1], [3])
    await asyncio.wait_for(waiter, GUARD)
    assert deliver(sink, 2, block.payloads[2])
    settle()
    assert sink.complete and sink.failed_layers == () and sink.failure_reason(1) is None
    for layer in block.payloads:
        assert_identical(sink, block, layer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipping_any_byte_fails(backend: str) -> None:
    block = make_block("int8", tokens=1, kv_heads=1, head_dim=4, layers=1)
    payload = block.payloads[0]
    sink, _ = new_sink(backend, block)
    for at in range(len(payload)):
        assert not deliver(sink, 0, _flip(payload, at))
    assert deliver(sink, 0, payload)


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_delivery_fails(backend: str) -> None:
    block = make_block("fp32", layers=1)
    sink, _ = new_sink(backend, block)
    payload = block.payloads[0]
    sink.begin_layer(0, len(payload))
    sink.feed(0, payload[:-1])
    assert not sink.end_layer(0)
    assert "truncated" in (sink.failure_reason(0) or "")
    assert deliver(sink, 0, payload)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_place", [False, True], ids=["feed", "in-place"])
def test_too_many_octets_fail_the_layer(backend: str, in_place: bool) -> None:
    block = make_block("fp32", layers=1)
    sink, _ = new_sink(backend, block)
    payload = block.payloads[0]
    sink.begin_layer(0, len(payload))
    with pytest.raises(SinkError, match="exceed the payload length"):
        if in_place:
            sink.chunk_written(0, len(payload) + 1)
        else:
            sink.feed(0, payload + b"x")
    assert sink.state(0) is LayerState.FAILED
    assert deliver(sink, 0, payload)


# ---------------------------------------------------------------------------------------------
# Misuse: SinkError


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_length_is_rejected_and_fails_the_layer(backend: str) -> None:
    block = make_block("bf16", layers=2)
    sink, _ = new_sink(backend, block)
    size = len(block.payloads[0])
    for bad in (size - 1, size + 1, 0, size // 2):
        with pytest.raises(SinkError, match="payload length"):
            sink.begin_layer(0, bad)
        assert sink.state(0) is LayerState.FAILED
    assert deliver(sink, 0, block.payloads[0])
    with pytest.raises(SinkError, match="already received"):
        sink.begin_layer(0, size + 1)  # a verified layer stays verified
    assert sink.state(0) is LayerState.READY


@pytest.mark.parametrize("backend", BACKENDS)
async def test_layers_outside_the_range_are_rejected(backend: str) -> None:
    block = make_block("fp16", layers=2, first_layer=4)
    sink, _ = new_sink(backend, block)
    size = len(block.payloads[4])
    for layer in (3, 6, -1, 2**32, True, "4"):
        with pytest.raises(SinkError, match="outside this sink's range 4-5"):
            sink.begin_layer(layer, size)  # type: ignore[arg-type]
        for call in (lambda: sink.feed(layer, b"x"), lambda: sink.chunk_written(layer, 1),
                     lambda: sink.end_layer(layer), lambda: sink.abort(layer, "x"),
                     lambda: sink.layer(layer), lambda: sink.state(layer)):
            with pytest.raises(SinkError, match="outside"):
                call()
        with pytest.raises(SinkError, match="outside"):
            await sink.wait_for_layer(layer)
    assert sink.missing_layers() == (4, 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_deliveries_are_rejected(backend: str) -> None:
    block = make_block("fp8-e4m3", layers=2)
    sink, settle = new_sink(backend, block)
    size = len(block.payloads[0])
    sink.begin_layer(0, size)
    with pytest.raises(SinkError, match="already being received"):
        sink.begin_layer(0, size)
    assert sink.state(0) is LayerState.RECEIVING  # the first delivery goes on
    sink.feed(0, block.payloads[0])
    assert sink.end_layer(0)
    with pytest.raises(SinkError, match="already received and verified"):
        sink.begin_layer(0, size)
    with pytest.raises(SinkError, match="not being received"):
        sink.end_layer(0)
    with pytest.raises(SinkError, match="not being received"):
        sink.feed(0, b"x")
    with pytest.raises(SinkError, match="not being received"):
        sink.end_layer(1)
    settle()
    assert_identical(sink, block, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_before_ready_is_not_exposed(backend: str) -> None:
    block = make_block("fp16", layers=1)
    sink, _ = new_sink(backend, block)
    with pytest.raises(SinkError, match="not ready \\(expected\\)") as info:
        sink.layer(0)
    assert not isinstance(info.value, LayerFailed)
    sink.begin_layer(0, len(block.payloads[0]))
    with pytest.raises(SinkError, match="not ready \\(receiving\\)"):
        sink.layer(0)


@pytest.mark.parametrize(
    "layers, digests, message",
    [
        ((1, 0), [bytes(32)] * 2, "inclusive range"),
        ((0,), [bytes(32)], "inclusive range"),
        ([0, 1], [bytes(32)] * 2, "inclusive range"),
        ((-1, 0), [bytes(32)], "inclusive range"),
        ((0, 2), [bytes(32)] * 2, "no expected digest for layer 2"),
        ((0, 1), {0: bytes(32)}, "no expected digest for layer 1"),
        ((0, 0), [bytes(31)], "not 32 octets"),
        ((0, 0), ["00" * 32], "not 32 octets"),
    ],
)
def test_constructor_validation(layers: Any, digests: Any, message: str) -> None:
    block = make_block("fp32")
    with pytest.raises(SinkError, match=message):
        NumpySink(block.geometry, 3, layers, digests)


def test_constructor_rejects_bad_tokens_and_geometry() -> None:
    block = make_block("fp32")
    for tokens in (-1, 1.5, True, None):
        with pytest.raises(SinkError, match="tokens"):
            NumpySink(block.geometry, tokens, (0, 0), [bytes(32)])  # type: ignore[arg-type]
    with pytest.raises(SinkError, match="geometry"):
        NumpySink("fp32", 3, (0, 0), [bytes(32)])  # type: ignore[arg-type]


def test_digests_as_mapping_or_record_sequence() -> None:
    block = make_block("bf16", layers=3, first_layer=5)
    by_layer = {layer: block.digests[layer] for layer in range(5, 8)}
    for digests in (block.digests, by_layer):  # Replica Record form or {layer: digest}
        sink = NumpySink(block.geometry, block.tokens, (6, 7), digests)
        assert sink.expected_digest(6) == block.digests[6]
        assert deliver(sink, 7, block.payloads[7]) and deliver(sink, 6, block.payloads[6])
        assert_identical(sink, block, 7)


# ---------------------------------------------------------------------------------------------
# Waiting: layer l is usable while l + 1 is in flight


@pytest.mark.parametrize("backend", BACKENDS)
async def test_layer_ready_while_next_layer_in_flight(backend: str) -> None:
    block = make_block("bf16", tokens=8, layers=3)
    sink, settle = new_sink(backend, block)
    w0 = asyncio.ensure_future(sink.wait_for_layer(0))
    w1 = asyncio.ensure_future(sink.wait_for_layer(1))
    p0, p1 = block.payloads[0], block.payloads[1]
    sink.begin_layer(0, len(p0))
    sink.begin_layer(1, len(p1))  # two layers in flight at once
    sink.feed(0, p0)
    sink.feed(1, p1[: len(p1) // 2])
    sink.end_layer(0)
    k0, v0 = await asyncio.wait_for(w0, GUARD)
    assert not w1.done() and sink.state(1) is LayerState.RECEIVING
    assert sink.ready_layers == (0,) and sink.missing_layers() == (1, 2)
    settle()
    assert kv_octets(sink, 0) == block.source_octets(0)
    sink.feed(1, p1[len(p1) // 2 :])
    sink.end_layer(1)
    await asyncio.wait_for(w1, GUARD)
    assert sink.ready_layers == (0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_consumer_overlaps_transfer_in_ascending_order(backend: str) -> None:
    """A producer that, after ending layer l and sending half of l + 1, waits until the
    consumer has layer l: it deadlocks (GUARD) unless layer l is released on its own."""
    block = make_block("fp16", tokens=4, layers=5)
    sink, settle = new_sink(backend, block)
    loop = asyncio.get_running_loop()
    consumed = {layer: loop.create_future() for layer in block.payloads}
    seen: list[int] = []

    async def consumer() -> None:
        async for layer, (k, v) in sink.ascending():
            assert sink.state(layer) is LayerState.READY
            seen.append(layer)
            consumed[layer].set_result(None)

    async def producer() -> None:
        layers = sorted(block.payloads)
        for layer in layers:
            payload = block.payloads[layer]
            if layer == layers[0]:
                sink.begin_layer(layer, len(payload))
                sink.feed(layer, payload[: len(payload) // 2])
            sink.feed(layer, payload[len(payload) // 2 :])
            sink.end_layer(layer)
            if layer != layers[-1]:
                following = block.payloads[layer + 1]
                sink.begin_layer(layer + 1, len(following))
                sink.feed(layer + 1, following[: len(following) // 2])
                assert sink.state(layer + 1) is LayerState.RECEIVING
            await consumed[layer]  # needs layer usable while layer + 1 is incomplete

    await asyncio.wait_for(asyncio.gather(consumer(), producer()), GUARD)
    assert seen == sorted(block.payloads)
    settle()
    for layer in block.payloads:
        assert_identical(sink, block, layer)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_abort_layer_wakes_waiters_and_allows_redelivery(backend: str) -> None:
    block = make_block("fp32", layers=2)
    sink, settle = new_sink(backend, block)
    payload = block.payloads[0]
    waiter = asyncio.ensure_future(sink.wait_for_layer(0))
    sink.begin_layer(0, len(payload))
    sink.feed(0, payload[:5])
    sink.abort(0, "stream reset by the peer")
    with pytest.raises(LayerFailed, match="stream reset"):
        await asyncio.wait_for(waiter, GUARD)
    sink.abort(0, "later reason")  # a failed layer keeps its first reason
    assert sink.failure_reason(0) == "stream reset by the peer"
    with pytest.raises(SinkError, match="not being received"):
        sink.feed(0, payload[5:])  # the aborted delivery is over
    assert deliver(sink, 0, payload)
    sink.abort(0, "too late")  # no-op on a verified layer
    settle()
    assert sink.state(0) is LayerState.READY
    assert_identical(sink, block, 0)
    sink.abort(1, "no source has it")  # never begun: failed, so it is recomputed
    assert sink.failed_layers == (1,) and sink.missing_layers() == (1,)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_abort_all(backend: str) -> None:
    block = make_block("bf16", layers=4)
    sink, settle = new_sink(backend, block)
    assert deliver(sink, 0, block.payloads[0])
    sink.begin_layer(1, len(block.payloads[1]))
    waiters = [asyncio.ensure_future(sink.wait_for_layer(layer)) for layer in (0, 1, 2)]
    sink.abort_all("fetch failed")
    assert sink.aborted == "fetch failed"
    settle()
    k0, _ = await asyncio.wait_for(waiters[0], GUARD)  # verified layers stay usable
    for waiter in waiters[1:]:
        with pytest.raises(LayerFailed, match="sink aborted: fetch failed"):
            await asyncio.wait_for(waiter, GUARD)
    with pytest.raises(LayerFailed, match="aborted"):
        await sink.wait_for_layer(3)
    with pytest.raises(SinkError, match="aborted"):
        sink.begin_layer(3, len(block.payloads[3]))
    assert sink.ready_layers == (0,) and sink.missing_layers() == (1, 2, 3)
    assert_identical(sink, block, 0)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancelled_waiter_is_forgotten(backend: str) -> None:
    block = make_block("fp16", layers=1)
    sink, _ = new_sink(backend, block)
    # Drive the coroutine by hand: to its await on the layer's future, then cancel it there.
    waiting = sink.wait_for_layer(0)
    future = waiting.send(None)
    assert sink._layers[0].waiters == [future]
    with pytest.raises(asyncio.CancelledError):
        waiting.throw(asyncio.CancelledError())
    assert sink._layers[0].waiters == []
    assert deliver(sink, 0, block.payloads[0])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_ascending_stops_at_the_first_failed_layer(backend: str) -> None:
    block = make_block("int8", layers=3)
    sink, _ = new_sink(backend, block)
    assert deliver(sink, 0, block.payloads[0])
    assert not deliver(sink, 1, _flip(block.payloads[1], 0))
    got = []
    with pytest.raises(LayerFailed) as info:
        async for layer, _ in sink.ascending():
            got.append(layer)
    assert got == [0] and info.value.layer == 1


# ---------------------------------------------------------------------------------------------
# make_sink and the install without torch


def test_make_sink_backends() -> None:
    block = make_block("fp16", layers=2)
    args = (block.geometry, block.tokens, block.layers, block.digests)
    assert isinstance(make_sink(*args, backend="numpy"), NumpySink)
    with pytest.raises(SinkError, match="host memory"):
        make_sink(*args, backend="numpy", device="cuda")
    with pytest.raises(SinkError, match="unknown sink backend"):
        make_sink(*args, backend="jax")  # type: ignore[arg-type]
    pytest.importorskip("torch")
    from kvsp_moq.sinks import TorchSink

    assert isinstance(make_sink(*args), TorchSink)  # auto: torch when installed
    sink = make_sink(*args, backend="torch", device="cpu", staging_slots=1)
    assert isinstance(sink, TorchSink) and not sink.staged
    with pytest.raises(SinkError, match="not supported"):
        make_sink(*args, backend="torch", device="meta")


def test_sinks_work_without_torch() -> None:
    code = """
import sys
sys.modules["torch"] = None  # any `import torch` fails
import kvsp_moq.sinks as sinks
from kvsp_moq.sinks import NumpySink, SinkError, TorchSink, make_sink
from test_sinks_support import make_block
block = make_block("bf16", layers=2)
args = (block.geometry, block.tokens, block.layers, block.digests)
sink = make_sink(*args)
assert type(sink) is NumpySink, type(sink)
for layer, payload in block.payloads.items():
    sink.begin_layer(layer, len(payload))[:] = payload
    assert sink.end_layer(layer)
k, v = sink.layer(1)
assert (k.tobytes(), v.tobytes()) == block.source_octets(1)
try:
    TorchSink(*args)
except SinkError as exc:
    print("no torch:", exc)
"""
    tests_dir = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests_dir), str(tests_dir.parent)])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tests_dir, env={**os.environ, "PYTHONPATH": path}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "no torch: the torch sink needs torch" in out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
async def test_retry_lets_waiters_wait_for_the_next_delivery(backend: str) -> None:
    block = make_block("bf16", layers=2)
    sink, settle = new_sink(backend, block)
    assert not deliver(sink, 1, _flip(block.payloads[1], 2))
    with pytest.raises(LayerFailed):
        await sink.wait_for_layer(1)  # failed now: the waiter is told at once
    sink.retry(1)
    assert sink.state(1) is LayerState.EXPECTED and sink.failure_reason(1) is None
    assert sink.missing_layers() == (0, 1)
    waiter = asyncio.ensure_future(sink.wait_for_layer(1))
    assert deliver(sink, 1, block.payloads[1])
    await asyncio.wait_for(waiter, GUARD)
    sink.retry(0)  # expected: no-op
    with pytest.raises(SinkError, match="nothing to retry"):
        sink.retry(1)
    sink.begin_layer(0, len(block.payloads[0]))
    with pytest.raises(SinkError, match="nothing to retry"):
        sink.retry(0)
    sink.abort_all("shutdown")
    with pytest.raises(SinkError, match="aborted"):
        sink.retry(0)
    settle()
    assert_identical(sink, block, 1)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_waiter_sees_the_failure_even_if_redelivery_begins_at_once(backend: str) -> None:
    block = make_block("fp16", layers=1)
    sink, settle = new_sink(backend, block)
    # Drive the waiter by hand to its await, so it is registered before the failure.
    waiting = sink.wait_for_layer(0)
    future = waiting.send(None)
    assert not deliver(sink, 0, _flip(block.payloads[0], 1))
    sink.begin_layer(0, sink.payload_bytes)  # a new delivery starts before the waiter resumes
    assert future.done()
    with pytest.raises(LayerFailed, match="digest mismatch"):
        waiting.send(None)
    sink.feed(0, block.payloads[0])
    assert sink.end_layer(0)
    settle()
    assert_identical(sink, block, 0)
