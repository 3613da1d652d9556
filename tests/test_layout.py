"""Codec raw / layout kvsp-layout-1 (kvsp-draft §4.3): geometry, section encoding, zero-copy
decoding, and round trips through the KVB1 container."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.kvsp.errors import ContainerError
from kvsp_moq.kvsp.layout import (
    LAYOUT,
    Geometry,
    decode_raw_layer,
    encode_raw_block,
    encode_raw_layer,
    from_descriptor_fields,
)
from kvsp_moq.kvsp.registries import ELEMENT_TYPES, LAYOUTS, element_type

VECTORS = Path(__file__).parent / "vectors" / "container"
SPEC = json.loads((VECTORS / "container.json").read_text())


def error_field(fn: Any) -> str:
    with pytest.raises(ContainerError) as info:
        fn()
    return info.value.field


# ---------------------------------------------------------------------------------------------
# Geometry


def test_layout_name_is_registered() -> None:
    assert LAYOUT == "kvsp-layout-1" and LAYOUT in LAYOUTS


@pytest.mark.parametrize("name", sorted(ELEMENT_TYPES))
def test_geometry_from_descriptor_fields(name: str) -> None:
    g = from_descriptor_fields(8, 128, name)
    assert g == Geometry.from_descriptor_fields(8, 128, name)
    assert g.dtype is element_type(name)
    assert g.section_bytes(0) == 0
    assert g.section_bytes(16) == 16 * 8 * 128 * element_type(name).itemsize
    assert g.shape(16) == (16, 8, 128)
    assert g.numpy_dtype == np.dtype(element_type(name).numpy_storage)
    assert g.numpy_dtype.itemsize == element_type(name).itemsize


@pytest.mark.parametrize(
    "kv_heads, head_dim", [(0, 1), (1, 0), (-1, 4), (True, 4), (2, 1.5), ("2", 4)]
)
def test_geometry_rejects_non_positive(kv_heads: Any, head_dim: Any) -> None:
    assert error_field(lambda: Geometry(kv_heads, head_dim, element_type("fp16"))) == "geometry"


def test_geometry_rejects_bad_dtype() -> None:
    assert error_field(lambda: Geometry(1, 1, "fp16")) == "geometry"  # type: ignore[arg-type]
    assert error_field(lambda: from_descriptor_fields(1, 1, "fp64")) == "kv_dtype"
    assert error_field(lambda: from_descriptor_fields(1, 1, None)) == "kv_dtype"  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [-1, True, 1.0])
def test_section_bytes_rejects_bad_tokens(tokens: Any) -> None:
    g = from_descriptor_fields(1, 1, "fp16")
    assert error_field(lambda: g.section_bytes(tokens)) == "token_count"


# ---------------------------------------------------------------------------------------------
# Section encoding (§4.3: row-major, token slowest, dim fastest, little-endian elements)


def test_encode_raw_layer_octets_follow_layout() -> None:
    g = from_descriptor_fields(2, 3, "fp16")
    values = [[[t * 100 + h * 10 + d for d in range(3)] for h in range(2)] for t in range(4)]
    k = np.array(values, dtype=np.float16)
    v = -k
    order = [(t, h, d) for t in range(4) for h in range(2) for d in range(3)]  # dim fastest
    expected_k = b"".join(struct.pack("<e", values[t][h][d]) for t, h, d in order)
    expected_v = b"".join(struct.pack("<e", -float(values[t][h][d])) for t, h, d in order)
    for kk, vv in ((k, v), (k.astype(">f2"), v.astype(">f2")), (np.asfortranarray(k), v[::1])):
        k_view, v_view = encode_raw_layer(kk, vv, g)
        assert isinstance(k_view, memoryview) and k_view.readonly and k_view.format == "B"
        assert bytes(k_view) == expected_k and bytes(v_view) == expected_v


def test_encode_raw_layer_copies_only_when_needed() -> None:
    g = from_descriptor_fields(2, 4, "fp32")
    k = np.arange(3 * 2 * 4, dtype="<f4").reshape(3, 2, 4)
    k_view, v_view = encode_raw_layer(k, k, g)
    assert np.shares_memory(np.frombuffer(k_view, np.uint8), k)  # already in layout: no copy
    swapped = k.astype(">f4")
    k_view, _ = encode_raw_layer(swapped, swapped, g)
    assert not np.shares_memory(np.frombuffer(k_view, np.uint8), swapped)
    assert bytes(k_view) == k.tobytes()
    strided = np.ascontiguousarray(np.arange(3 * 2 * 8, dtype="<f4").reshape(3, 2, 8))[:, :, ::2]
    k_view, _ = encode_raw_layer(strided, strided, g)
    assert bytes(k_view) == np.ascontiguousarray(strided).tobytes()


def test_encode_raw_layer_accepts_bit_pattern_dtypes() -> None:
    # bf16 / fp8 have no numpy dtype: any same-size integer or float array carries the bits.
    bf16 = from_descriptor_fields(1, 2, "bf16")
    bits = np.array([[[0x3F80, 0xC000]]], dtype=np.uint16)  # 1.0, -2.0 in bf16
    k_view, _ = encode_raw_layer(bits, bits, bf16)
    assert bytes(k_view) == b"\x80\x3f\x00\xc0"
    fp8 = from_descriptor_fields(1, 3, "fp8-e5m2")
    for dtype in (np.uint8, np.int8):
        arr = np.array([[[1, 2, 3]]], dtype=dtype)
        assert bytes(encode_raw_layer(arr, arr, fp8)[0]) == b"\x01\x02\x03"


@pytest.mark.parametrize(
    "k, v",
    [
        (np.zeros((2, 2, 4), np.float32), np.zeros((2, 2, 4), np.float16)),  # itemsize
        (np.zeros((2, 2, 4), np.float16), np.zeros((2, 2, 4), np.float32)),
        (np.zeros((2, 2, 4), np.bool_), np.zeros((2, 2, 4), np.float16)),
        (np.zeros((2, 2, 4), np.complex64), np.zeros((2, 2, 4), np.float16)),
        (np.zeros((2, 3, 4), np.float16), np.zeros((2, 3, 4), np.float16)),  # kv_heads
        (np.zeros((2, 2, 5), np.float16), np.zeros((2, 2, 5), np.float16)),  # head_dim
        (np.zeros((2, 8), np.float16), np.zeros((2, 8), np.float16)),  # ndim
        (np.zeros((2, 2, 4), np.float16), np.zeros((3, 2, 4), np.float16)),  # tokens differ
        (b"\x00" * 32, np.zeros((2, 2, 4), np.float16)),  # not an array
    ],
)
def test_encode_raw_layer_rejects(k: Any, v: Any) -> None:
    g = from_descriptor_fields(2, 4, "fp16")
    assert error_field(lambda: encode_raw_layer(k, v, g)) == "data"


# ---------------------------------------------------------------------------------------------
# Decoding


def test_decode_raw_layer_is_zero_copy() -> None:
    g = from_descriptor_fields(2, 4, "bf16")
    k = np.arange(3 * 2 * 4, dtype=np.uint16).reshape(3, 2, 4)
    blob = encode_raw_block([(k, k + 1)], g, first_layer=4)
    c = decode_container(blob, geometry=g)
    lv = c.layer(4)
    a, b = decode_raw_layer(lv.k, lv.v, g, c.header.token_count)
    assert a.dtype == np.dtype("<u2") and a.shape == (3, 2, 4)
    assert np.array_equal(a, k) and np.array_equal(b, k + 1)
    raw = np.frombuffer(blob, dtype=np.uint8)
    assert np.shares_memory(a, raw) and np.shares_memory(b, raw)
    assert not a.flags.writeable  # views of an immutable container
    writable = bytearray(b"\x00\x3c" * 8)  # fp16 1.0
    x, _ = decode_raw_layer(writable, writable, from_descriptor_fields(2, 4, "fp16"), 1)
    assert x.flags.writeable and np.all(x == 1.0)


@pytest.mark.parametrize("k_len, v_len", [(15, 16), (16, 17), (0, 16)])
def test_decode_raw_layer_rejects_wrong_lengths(k_len: int, v_len: int) -> None:
    g = from_descriptor_fields(2, 4, "fp16")  # 16 octets per token
    assert error_field(lambda: decode_raw_layer(bytes(k_len), bytes(v_len), g, 1)) == "lengths"


def test_encode_raw_block_rejects_bad_input() -> None:
    g = from_descriptor_fields(1, 1, "int8")
    one, two = np.zeros((1, 1, 1), np.int8), np.zeros((2, 1, 1), np.int8)
    assert error_field(lambda: encode_raw_block([], g)) == "layer_count"
    assert error_field(lambda: encode_raw_block([(one, one), (two, two)], g)) == "token_count"
    assert error_field(lambda: encode_raw_block([(one, one)], g, first_layer=-1)) == "first_layer"


# ---------------------------------------------------------------------------------------------
# Pinned vectors: element values from the generator's formula, computed here with numpy


def expected_section(geometry: dict[str, Any], layer: int, section: int, tokens: int) -> np.ndarray:
    kv_heads, head_dim, dtype = geometry["kv_heads"], geometry["head_dim"], geometry["kv_dtype"]
    t, h, d = np.meshgrid(
        np.arange(tokens), np.arange(kv_heads), np.arange(head_dim), indexing="ij"
    )
    if element_type(dtype).itemsize == 1:
        return ((layer * 37 + section * 101 + t * 13 + h * 7 + d) % 256).astype(np.uint8)
    value = layer + section / 2 + t / 4 + h / 8 + d / 16
    if dtype == "bf16":
        return (value.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return value.astype({"fp16": np.float16, "fp32": np.float32}[dtype])


@pytest.mark.parametrize("vector", SPEC["valid"], ids=lambda v: v["name"])
def test_vector_values(vector: dict[str, Any]) -> None:
    geo = vector["geometry"]
    g = from_descriptor_fields(geo["kv_heads"], geo["head_dim"], geo["kv_dtype"])
    blob = (VECTORS / vector["file"]).read_bytes()
    c = decode_container(blob, geometry=g)
    tokens = c.header.token_count
    layers = []
    for lv in c.layers():
        k, v = decode_raw_layer(lv.k, lv.v, g, tokens)
        want_k = expected_section(geo, lv.index, 0, tokens)
        want_v = expected_section(geo, lv.index, 1, tokens)
        assert k.shape == want_k.shape == (tokens, geo["kv_heads"], geo["head_dim"])
        # compare bit patterns (int8 decodes as signed, fp8 as unsigned octets)
        assert k.tobytes() == want_k.tobytes() and v.tobytes() == want_v.tobytes()
        layers.append((want_k, want_v))
    # and encoding the expected arrays reproduces the pinned file
    assert encode_raw_block(layers, g, first_layer=c.header.first_layer) == blob


# ---------------------------------------------------------------------------------------------
# Round trips


RawCase = tuple[Geometry, int, int, list[tuple[bytes, bytes]], str]


@st.composite
def raw_blocks(draw: st.DrawFn) -> RawCase:
    dtype = draw(st.sampled_from(sorted(ELEMENT_TYPES)))
    g = from_descriptor_fields(draw(st.integers(1, 3)), draw(st.integers(1, 8)), dtype)
    tokens = draw(st.integers(0, 5))
    size = g.section_bytes(tokens)
    section = st.binary(min_size=size, max_size=size)
    layers = draw(st.lists(st.tuples(section, section), min_size=1, max_size=4))
    first = draw(st.integers(0, 1000))
    form = draw(st.sampled_from(["native", "big-endian", "fortran"]))
    return g, first, tokens, layers, form


def as_array(raw: bytes, g: Geometry, tokens: int, form: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype=g.numpy_dtype).reshape(g.shape(tokens))
    if form == "big-endian":
        return arr.astype(arr.dtype.newbyteorder(">"))
    if form == "fortran":
        return np.asfortranarray(arr)
    return arr


@settings(max_examples=300, deadline=None)
@given(raw_blocks())
def test_raw_block_round_trip(case: RawCase) -> None:
    g, first, tokens, layers, form = case
    arrays = [(as_array(k, g, tokens, form), as_array(v, g, tokens, form)) for k, v in layers]
    blob = encode_raw_block(arrays, g, first_layer=first)
    c = decode_container(blob, geometry=g)
    h = c.header
    assert (h.first_layer, h.layer_count, h.token_count) == (first, len(layers), tokens)
    assert c.header.codec == 1
    assert c.header.lengths == ((g.section_bytes(tokens),) * 2,) * len(layers)
    for lv, (k, v) in zip(c.layers(), layers, strict=True):
        ka, va = decode_raw_layer(lv.k, lv.v, g, tokens)
        assert ka.dtype == g.numpy_dtype and ka.shape == g.shape(tokens)
        assert ka.tobytes() == k and va.tobytes() == v
    assert c.layer_digests() == [hashlib.sha256(k + v).digest() for k, v in layers]
