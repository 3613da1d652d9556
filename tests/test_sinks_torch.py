"""TorchSink specifics: dtypes, the staged (CUDA) path's rules, byte order, and the real CUDA
path where a GPU is present.

The staged path is driven without a GPU by a CPU stand-in engine whose copies stay pending
until the test completes them (tests/test_sinks_support.py), which checks what the CUDA design
promises (docs/sinks.md): nothing unverified reaches the device, one copy and one event per
verified layer, consumers wait on the event, and a small ring of staging buffers is reused
only once its copy has completed. The ``cuda`` tests run only where
``torch.cuda.is_available()``.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.sinks import LayerFailed, LayerState, SinkError, TorchSink  # noqa: E402
from kvsp_moq.sinks._torch import HOST_IS_LITTLE_ENDIAN, byteswap_elements  # noqa: E402
from test_sinks_support import (  # noqa: E402
    DTYPES,
    FakeEngine,
    assert_identical,
    deliver,
    kv_octets,
    make_block,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
GUARD = 10.0


def staged(block, **kw):
    engine = FakeEngine()
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests,
                     copy_engine=engine, **kw)
    return sink, engine


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_dtypes_and_values(dtype: str) -> None:
    block = make_block(dtype, tokens=4, layers=1)
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests)
    assert deliver(sink, 0, block.payloads[0])
    k, v = sink.layer(0)
    expected = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2,
                "int8": torch.int8}[dtype]
    assert k.dtype == v.dtype == sink.dtype == expected and k.device.type == "cpu"
    # Element values, not only octets: a float32 view of each element agrees with numpy's
    # decoding of the same little-endian bit patterns.
    src_k, _ = block.arrays[0]
    if dtype in ("fp32", "fp16", "int8"):
        assert np.array_equal(k.numpy(), src_k, equal_nan=dtype != "int8")
    elif dtype == "bf16":
        as_f32 = (src_k.astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(k.float().numpy(), as_f32, equal_nan=True)


def test_cpu_sink_has_no_events_or_staging() -> None:
    block = make_block("bf16", layers=1)
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests)
    assert not sink.staged and sink.staging_slots == 0 and sink.device.type == "cpu"
    assert deliver(sink, 0, block.payloads[0])
    assert sink.layer_event(0) is None
    sink.wait_event_on(object(), 0)  # nothing to wait for on the CPU


# ---------------------------------------------------------------------------------------------
# The staged (CUDA) path, on a CPU stand-in


async def test_staged_copy_only_after_verification_with_one_event_per_layer() -> None:
    block = make_block("fp16", tokens=6, layers=3)
    sink, engine = staged(block)
    n = sink.payload_bytes
    waiter = asyncio.ensure_future(sink.wait_for_layer(0))
    dest = sink.begin_layer(0, n)
    dest[:] = block.payloads[0]
    # Received into staging, not into the device tensor.
    assert bytes(engine.device_buffer[:n].numpy()) == bytes([FakeEngine.SENTINEL]) * n
    assert sink.end_layer(0)
    # wait_for_layer returns once the copy is enqueued and its event recorded: it does not
    # wait for the copy itself (the event is still pending).
    await asyncio.wait_for(waiter, GUARD)
    event = sink.layer_event(0)
    assert event is not None and not event.query() and len(engine.pending) == 1
    # Consumers order their stream after the event (device side): layer() does it for the
    # current stream, wait_event_on() for a given one.
    engine.waits.clear()
    sink.layer(0)
    stream = object()
    sink.wait_event_on(stream, 0)
    assert engine.waits == [(event, None), (event, stream)]
    engine.complete()
    assert event.query() and kv_octets(sink, 0) == block.source_octets(0)
    # A corrupted layer never reaches the device: no copy, device octets untouched.
    assert not deliver(sink, 1, b"\x00" + block.payloads[1][1:])
    assert engine.pending == [] and engine.copies == 1
    assert bytes(engine.device_buffer[n : 2 * n].numpy()) == bytes([FakeEngine.SENTINEL]) * n
    with pytest.raises(LayerFailed):
        sink.layer_event(1)
    with pytest.raises(SinkError, match="not ready"):
        sink.layer_event(2)
    assert deliver(sink, 1, block.payloads[1]) and deliver(sink, 2, block.payloads[2])
    engine.complete()
    assert engine.copies == 3
    for layer in block.payloads:
        assert_identical(sink, block, layer)


def test_staging_ring_reuses_buffers_once_their_copy_completed() -> None:
    block = make_block("bf16", tokens=4, layers=8)
    sink, engine = staged(block, staging_slots=2, max_staging_slots=3)
    assert sink.staging_slots == 2 and engine.staging_allocations == 2
    # The GPU keeps up: every copy completes before the next layer arrives -> the first
    # buffer serves every layer (bounded host memory for any number of layers).
    addresses = set()
    for layer in range(4):
        dest = sink.begin_layer(layer, sink.payload_bytes)
        addresses.add(np.frombuffer(dest, np.uint8).ctypes.data)
        dest[:] = block.payloads[layer]
        assert sink.end_layer(layer)
        engine.complete()
    assert len(addresses) == 1 and engine.staging_allocations == 2
    # The GPU lags: a buffer whose copy is pending is not reused; the ring grows to its max.
    for layer in (4, 5, 6):
        assert deliver(sink, layer, block.payloads[layer])
    assert sink.staging_slots == 3 and engine.staging_allocations == 3
    assert len(engine.pending) == 3
    # All three copies pending and a fourth layer arrives: it waits for the oldest copy
    # (layer 4's) and reuses that buffer; the host never writes into a buffer being read.
    assert engine.copies == 4
    assert deliver(sink, 7, block.payloads[7])
    assert len(engine.synchronized) == 1 and engine.copies == 5  # layer 4's copy, only
    engine.complete()
    assert engine.staging_allocations == 3
    for layer in block.payloads:
        assert_identical(sink, block, layer)


def test_staging_ring_failed_delivery_frees_its_buffer() -> None:
    block = make_block("fp32", layers=3)
    sink, engine = staged(block, staging_slots=1, max_staging_slots=1)
    for _ in range(3):  # fail, abort, wrong length: the single buffer comes back each time
        assert not deliver(sink, 0, b"\xff" * sink.payload_bytes)
        sink.begin_layer(0, sink.payload_bytes)
        sink.abort(0, "reset")
    assert deliver(sink, 0, block.payloads[0])
    assert engine.staging_allocations == 1


def test_staging_ring_exhausted_by_layers_in_flight() -> None:
    block = make_block("fp32", layers=3)
    sink, engine = staged(block, staging_slots=1, max_staging_slots=2)
    sink.begin_layer(0, sink.payload_bytes)
    sink.begin_layer(1, sink.payload_bytes)
    with pytest.raises(SinkError, match="staging buffers are receiving"):
        sink.begin_layer(2, sink.payload_bytes)
    assert sink.state(2) is LayerState.EXPECTED
    sink.feed(0, block.payloads[0])
    assert sink.end_layer(0)
    assert deliver(sink, 2, block.payloads[2])  # waits for layer 0's copy, reuses its buffer
    sink.feed(1, block.payloads[1])
    assert sink.end_layer(1)
    engine.complete()
    for layer in block.payloads:
        assert_identical(sink, block, layer)


def test_staged_device_mismatch_and_bad_slot_counts() -> None:
    block = make_block("fp32", layers=1)
    args = (block.geometry, block.tokens, block.layers, block.digests)
    with pytest.raises(SinkError, match="differs from the copy engine"):
        TorchSink(*args, device="meta", copy_engine=FakeEngine())
    with pytest.raises(SinkError, match="staging slots"):
        TorchSink(*args, copy_engine=FakeEngine(), staging_slots=0)
    with pytest.raises(SinkError, match="staging slots"):
        TorchSink(*args, copy_engine=FakeEngine(), staging_slots=3, max_staging_slots=2)


@pytest.mark.skipif(CUDA, reason="checks the error without CUDA")
def test_cuda_requested_without_cuda() -> None:
    block = make_block("fp32", layers=1)
    with pytest.raises(SinkError, match="CUDA is not available"):
        TorchSink(block.geometry, block.tokens, block.layers, block.digests, device="cuda")


# ---------------------------------------------------------------------------------------------
# Byte order (kvsp-layout-1 is little-endian)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_byteswap_matches_numpy(dtype: str) -> None:
    block = make_block(dtype, tokens=3, layers=1)
    payload = block.payloads[0]
    itemsize = block.geometry.dtype.itemsize
    octets = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    byteswap_elements(octets, itemsize)
    as_uint = np.frombuffer(payload, dtype=f"<u{itemsize}")
    assert bytes(octets.numpy()) == as_uint.byteswap().tobytes()
    byteswap_elements(octets, itemsize)
    assert bytes(octets.numpy()) == payload


def test_host_byte_order_flag() -> None:
    assert HOST_IS_LITTLE_ENDIAN == (sys.byteorder == "little")


# ---------------------------------------------------------------------------------------------
# Real CUDA (skipped without a GPU)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
async def test_cuda_layers_bit_identical(dtype: str) -> None:
    block = make_block(dtype, tokens=64, kv_heads=4, head_dim=64, layers=6)
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests, device="cuda")
    assert sink.staged and sink.device.type == "cuda"
    consumer = asyncio.ensure_future(_consume(sink, block))
    for layer, payload in block.payloads.items():
        sink.begin_layer(layer, len(payload))[:] = payload  # pinned staging
        assert sink.end_layer(layer)
    await asyncio.wait_for(consumer, GUARD)
    assert sink.staging_slots <= 4


async def _consume(sink: TorchSink, block) -> None:
    compute = torch.cuda.Stream()
    async for layer, _ in sink.ascending():
        sink.wait_event_on(compute, layer)
        with torch.cuda.stream(compute):
            k, v = sink.layer(layer, stream=compute)
            checksum = k.view(torch.uint8).sum() + v.view(torch.uint8).sum()
        compute.synchronize()
        ref_k, ref_v = block.source_octets(layer)
        assert int(checksum) == sum(ref_k) + sum(ref_v)
        assert kv_octets(sink, layer) == (ref_k, ref_v)


@needs_cuda
def test_cuda_failed_layer_never_copied() -> None:
    block = make_block("bf16", tokens=16, layers=2)
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests, device="cuda")
    sink._storage.fill_(0x5A)
    torch.cuda.synchronize()
    assert not deliver(sink, 0, b"\x00" * sink.payload_bytes)
    torch.cuda.synchronize()
    assert bool((sink._storage[: sink.payload_bytes] == 0x5A).all())
    assert deliver(sink, 0, block.payloads[0])
    sink.layer_event(0).synchronize()
    assert kv_octets(sink, 0) == block.source_octets(0)
    assert sink._ring is not None and sink._ring._slots[0].tensor.is_pinned()


# -- shared memory and deliveries verified in another process (bridge/parallel.py) --------------

def test_shared_memory_storage_and_accept_verified() -> None:
    """A sink in shared memory; a second sink over a slice of its storage (what a worker
    process builds) receives and verifies layer 1; the first accepts it by digest."""
    block = make_block("bf16", tokens=4, layers=3)
    parent = TorchSink(block.geometry, block.tokens, block.layers, block.digests,
                       shared_memory=True)
    assert parent.is_shared and parent.storage.numel() == 3 * parent.payload_bytes
    n = parent.payload_bytes
    first = block.layers[0]
    child = TorchSink(block.geometry, block.tokens, (first + 1, first + 1), block.digests,
                      storage=parent.storage[n:2 * n])
    assert deliver(child, first + 1, block.payloads[1])
    assert parent.state(first + 1) is LayerState.EXPECTED  # nothing is exposed by octets alone
    parent.accept_verified(first + 1, block.digests[first + 1])
    assert parent.state(first + 1) is LayerState.READY
    assert b"".join(kv_octets(parent, first + 1)) == block.payloads[1]
    with pytest.raises(SinkError, match="ready"):
        parent.accept_verified(first + 1, block.digests[first + 1])
    # A reported digest other than the expected one fails the layer.
    with pytest.raises(SinkError, match="digest mismatch"):
        parent.accept_verified(first + 2, b"\x00" * 32)
    assert parent.state(first + 2) is LayerState.FAILED
    child.release_storage()
    assert child.state(first + 1) is LayerState.READY and child.aborted is not None


def test_share_memory_keeps_verified_layers_and_refuses_bad_storage() -> None:
    block = make_block("fp16", tokens=4, layers=2)
    sink = TorchSink(block.geometry, block.tokens, block.layers, block.digests)
    assert not sink.is_shared
    assert deliver(sink, block.layers[0], block.payloads[0])
    sink.share_memory()
    assert sink.is_shared and b"".join(kv_octets(sink, block.layers[0])) == block.payloads[0]
    assert deliver(sink, block.layers[0] + 1, block.payloads[1])  # lands in the new memory
    assert b"".join(kv_octets(sink, block.layers[0] + 1)) == block.payloads[1]
    with pytest.raises(SinkError, match="flat contiguous uint8"):
        TorchSink(block.geometry, block.tokens, block.layers, block.digests,
                  storage=torch.empty(7, dtype=torch.uint8))
    with pytest.raises(SinkError, match="CPU sinks only"):
        staged(block, shared_memory=True)
