"""The codecs of kvsp_moq.kvsp.codecs (docs/container.md "Codecs"): the documented vectors,
lossless bit-exactness, the lossy error bounds, hostile sections, containers in a codec and
their layer digests (§4.3), and the figures of ``kvsp bench codec`` on a tiny case.

Expected octets come from the vectors in docs/container.md, from torch's own float8/bf16
conversions and from hand-built Zstandard frames (RFC 8878), never from the code under test.
"""

from __future__ import annotations

import hashlib
import re
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.kvsp.codecs import (
    GROUP_TOKENS,
    LAYER_CODECS,
    SCALE_MIN,
    coded_section_bytes,
    decode_block,
    decode_layer,
    e4m3_codes,
    encode_block,
    encode_layer,
    layer_codec,
)
from kvsp_moq.kvsp.container import ContainerDecoder, decode_container, encode_container, extract_layers
from kvsp_moq.kvsp.errors import ContainerError
from kvsp_moq.kvsp.layout import Geometry, encode_raw_block
from kvsp_moq.kvsp.naming import track_name
from kvsp_moq.kvsp.registries import CODECS, CODECS_BY_NAME, PRIVATE_USE_CODECS

DOC = Path(__file__).resolve().parent.parent / "docs" / "container.md"
LOSSY = ("fp8-e4m3", "int8")
ALL = ("raw", "fp8-e4m3", "int8", "zstd-planes")


def error_field(fn: Callable[[], object]) -> str:
    with pytest.raises(ContainerError) as info:
        fn()
    return info.value.field


def geometry(dtype: str, heads: int = 2, dim: int = 8) -> Geometry:
    return Geometry.from_descriptor_fields(heads, dim, dtype)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bit patterns by torch's conversion (round to nearest even)."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16).float().numpy()


def elements(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as elements of ``dtype`` (its numpy storage)."""
    return {"fp32": lambda: values.astype("<f4"), "fp16": lambda: values.astype("<f2"),
            "bf16": lambda: bf16_bits(values)}[dtype]()


def as_float(elements_: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_values(elements_) if dtype == "bf16" else elements_.astype(np.float64)


def kv_values(rng: np.random.Generator, tokens: int, heads: int = 2, dim: int = 8) -> np.ndarray:
    """Values over many magnitudes: a Gaussian scaled per token, some exact zeros."""
    x = rng.standard_normal((tokens, heads, dim)) * np.exp(rng.uniform(-8, 8, size=(tokens, 1, 1)))
    x[rng.random(x.shape) < 0.05] = 0.0
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_values_are_private_use_and_named() -> None:
    assert {c.name: c.value for c in CODECS.values()} == {
        "raw": 0x0001, "fp8-e4m3": 0xFF01, "int8": 0xFF02, "zstd-planes": 0xFF03}
    assert all(v in PRIVATE_USE_CODECS for v in CODECS if v != 0x0001)
    assert set(LAYER_CODECS) == set(CODECS)
    for name, codec in CODECS_BY_NAME.items():
        assert track_name(name) == name.encode()  # binding v1: the track name
        assert layer_codec(name) is layer_codec(codec.value) is layer_codec(codec)
    for bad in (0x7FFF, 0, "zstd", True, None, 1.0):
        assert error_field(lambda: layer_codec(bad)) == "codec"  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The vectors of docs/container.md


def doc_vectors() -> list[dict[str, str]]:
    blocks = re.findall(r"```vector\n(.*?)```", DOC.read_text(), flags=re.S)
    vectors = [dict(line.split(": ", 1) for line in block.strip().splitlines()) for block in blocks]
    assert len(vectors) >= 4
    return vectors


@pytest.mark.parametrize("vector", doc_vectors(), ids=lambda v: f"{v['codec']}-{v['kv_dtype']}-{v['tokens']}")
def test_doc_vectors(vector: dict[str, str]) -> None:
    geo = geometry(vector["kv_dtype"], int(vector["kv_heads"]), int(vector["head_dim"]))
    tokens = int(vector["tokens"])
    codec = vector["codec"]
    k_in, v_in = (np.frombuffer(bytes.fromhex(vector[n]), geo.numpy_dtype).reshape(geo.shape(tokens)) for n in "kv")
    k_sec, v_sec = bytes.fromhex(vector["k_section"]), bytes.fromhex(vector["v_section"])
    k_out, v_out = bytes.fromhex(vector["k_decoded"]), bytes.fromhex(vector["v_decoded"])
    # Decoding the documented sections gives the documented elements, octet for octet.
    dk, dv = decode_layer(codec, k_sec, v_sec, geo, tokens)
    assert (dk.tobytes(), dv.tobytes()) == (k_out, v_out)
    assert dk.dtype == geo.numpy_dtype and dk.shape == geo.shape(tokens)
    coded = encode_layer(codec, k_in, v_in, geo, tokens)
    if codec in LOSSY:
        assert (bytes(coded[0]), bytes(coded[1])) == (k_sec, v_sec)
        assert coded_section_bytes(codec, geo, tokens) == len(k_sec) == len(v_sec)
    else:  # lossless: the input comes back; frames are the encoder's choice
        assert (k_out, v_out) == (k_in.tobytes(), v_in.tobytes())
        back = decode_layer(codec, coded[0], coded[1], geo, tokens)
        assert (back[0].tobytes(), back[1].tobytes()) == (k_out, v_out)
    # A section with one octet more, or one less, is rejected (run whole, never partly).
    for bad in (k_sec + b"\x00", k_sec[:-1]):
        assert error_field(lambda: decode_layer(codec, bad, v_sec, geo, tokens)) in ("lengths", "frame")
    # In a container (Codec field = the codec), fed byte by byte: the same sections, decoded
    # the same, the layer digest over the coded sections; a trailing octet is the container's.
    value = CODECS_BY_NAME[codec].value
    data = encode_container(value, 0, tokens, [(k_sec, v_sec)])
    if codec in LOSSY:
        assert encode_block(codec, [(k_in, v_in)], geo) == data
    decoder = ContainerDecoder(geometry=geo)
    layers = [layer for i in range(len(data)) for layer in decoder.feed(data[i:i + 1])]
    assert decoder.finish().codec == value
    assert [(bytes(l.k), bytes(l.v)) for l in layers] == [(k_sec, v_sec)]
    assert layers[0].digest == hashlib.sha256(k_sec + v_sec).digest()
    assert [(a.tobytes(), b.tobytes()) for a, b in decode_block(data, geo)] == [(k_out, v_out)]
    assert error_field(lambda: decode_block(data + b"\x00", geo)) == "trailing"


def test_doc_zstd_vector_is_a_hand_built_frame() -> None:
    """The zstd-planes vector's K section, rebuilt from RFC 8878: magic, a single-segment
    descriptor with a 1-octet content size, and two raw blocks, one per plane."""
    (vector,) = [v for v in doc_vectors() if v["codec"] == "zstd-planes"]
    raw = bytes.fromhex(vector["k"])
    plane0, plane1 = raw[0::2], raw[1::2]

    def block(last: int, data: bytes) -> bytes:
        return ((len(data) << 3) | last).to_bytes(3, "little") + data  # Block_Type 0: raw

    frame = b"\x28\xb5\x2f\xfd" + bytes([0x20, len(raw)]) + block(0, plane0) + block(1, plane1)
    assert frame.hex() == vector["k_section"]


# ---------------------------------------------------------------------------------------------
# Independent references: torch's float8_e4m3fn and bfloat16 conversions


def reference_fp8(x: np.ndarray) -> bytes:
    """fp8-e4m3 section of float32 ``x`` [T, H, D] built with torch's float8 conversion."""
    t, h, _ = x.shape
    groups = -(-t // GROUP_TOKENS)
    scales = np.empty((groups, h), dtype=np.float32)
    codes = np.empty(x.shape, dtype=np.uint8)
    for g in range(groups):
        part = x[g * GROUP_TOKENS:(g + 1) * GROUP_TOKENS]
        for head in range(h):
            amax = np.float32(np.abs(part[:, head]).max())
            scale = max(np.float32(amax / np.float32(448.0)), np.float32(2.0**-126))
            scales[g, head] = scale
            y = np.clip(part[:, head] / np.float32(scale), -448, 448).astype(np.float32)
            codes[g * GROUP_TOKENS:(g + 1) * GROUP_TOKENS, head] = (
                torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    return scales.astype("<f4").tobytes() + codes.tobytes()


def test_e4m3_rounding_matches_torch_everywhere() -> None:
    """Every code's value, the midpoints between neighbours (ties to even) and their float32
    neighbours, random values: e4m3_codes equals torch's float8_e4m3fn conversion."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(3)
    pos = np.concatenate([values, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(448)),
                          rng.uniform(0, 448, 20000).astype(np.float32),
                          rng.uniform(0, 2**-6, 20000).astype(np.float32), np.float32([448.0])])
    y = np.concatenate([pos, -pos]).astype(np.float32)
    expected = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_codes(y), expected)
    assert e4m3_codes(np.float32([-0.0]))[0] == 0x80


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 40])
def test_fp8_matches_a_torch_reference(tokens: int) -> None:
    x = kv_values(np.random.default_rng(tokens), tokens)
    geo = geometry("fp32")
    k_sec, v_sec = encode_layer("fp8-e4m3", x, -x, geo, tokens)
    assert bytes(k_sec) == reference_fp8(x) and bytes(v_sec) == reference_fp8(-x)
    # Decoding: torch's float8 values times the scale (float32), then torch's bf16 rounding.
    geo16 = geometry("bf16")
    xb = bf16_values(bf16_bits(x))
    k_sec = bytes(encode_layer("fp8-e4m3", bf16_bits(x), bf16_bits(x), geo16, tokens)[0])
    assert k_sec == reference_fp8(xb)
    groups = -(-tokens // GROUP_TOKENS)
    scales = np.frombuffer(k_sec, "<f4", count=groups * 2).reshape(groups, 2)
    codes = np.frombuffer(k_sec, np.uint8, offset=8 * groups).reshape(tokens, 2, 8)
    values = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    expected = bf16_bits(values * np.repeat(scales, GROUP_TOKENS, axis=0)[:tokens, :, None])
    dk, _ = decode_layer("fp8-e4m3", k_sec, k_sec, geo16, tokens)
    assert np.array_equal(dk, expected)


# ---------------------------------------------------------------------------------------------
# Lossless: every bit pattern back


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_zstd_planes_is_bit_exact_on_every_16_bit_pattern(dtype: str) -> None:
    """All 65536 patterns (NaNs with payloads, ±inf, subnormals, -0), shuffled."""
    patterns = np.random.default_rng(4).permutation(np.arange(65536, dtype=np.uint16))
    geo = geometry(dtype, heads=4, dim=16)
    k = patterns.reshape(-1, 4, 16)
    v = k[::-1].copy()
    tokens = k.shape[0]
    kv = k.view("<f2") if dtype == "fp16" else k  # any dtype of the itemsize carries the bits
    sections = encode_layer("zstd-planes", kv, v, geo, tokens)
    dk, dv = decode_layer("zstd-planes", *sections, geo, tokens)
    assert dk.view(np.uint16).tobytes() == k.tobytes() and dv.view(np.uint16).tobytes() == v.tobytes()


@pytest.mark.parametrize("dtype, bits", [("fp32", np.uint32), ("fp8-e4m3", np.uint8), ("int8", np.uint8),
                                         ("fp8-e5m2", np.uint8), ("bf16", np.uint16)])
@pytest.mark.parametrize("tokens", [0, 1, 16, 33])
def test_zstd_planes_round_trips_random_bits(dtype: str, bits: type[np.unsignedinteger], tokens: int) -> None:
    geo = geometry(dtype, heads=3, dim=5)
    rng = np.random.default_rng(tokens)
    k, v = (rng.integers(0, np.iinfo(bits).max, size=geo.shape(tokens), dtype=bits, endpoint=True) for _ in "kv")
    sections = encode_layer("zstd-planes", k, v, geo, tokens)
    if tokens == 0:
        assert sections == (b"", b"")
    dk, dv = decode_layer("zstd-planes", *sections, geo, tokens)
    assert dk.tobytes() == k.tobytes() and dv.tobytes() == v.tobytes()


def test_zstd_planes_compresses_kv_like_data() -> None:
    """Smooth bf16 values: the exponent plane compresses, so the section is smaller."""
    x = np.random.default_rng(5).standard_normal((64, 8, 128)).astype(np.float32)
    geo = geometry("bf16", heads=8, dim=128)
    k_sec, _ = encode_layer("zstd-planes", bf16_bits(x), bf16_bits(x), geo, 64)
    assert len(k_sec) < 0.8 * geo.section_bytes(64)


# ---------------------------------------------------------------------------------------------
# Lossy: the error bounds


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("tokens", [1, 16, 23, 64])
def test_lossy_error_bounds(codec: str, tokens: int) -> None:
    x = kv_values(np.random.default_rng(tokens + 100), tokens)
    geo = geometry("fp32")
    k_sec, v_sec = encode_layer(codec, x, x * 3, geo, tokens)
    dk, dv = decode_layer(codec, k_sec, v_sec, geo, tokens)
    groups = -(-tokens // GROUP_TOKENS)
    for original, decoded, section in ((x, dk, k_sec), (x * 3, dv, v_sec)):
        scales = np.frombuffer(bytes(section), "<f4", count=groups * 2).reshape(groups, 2).astype(np.float64)
        per_element = np.repeat(scales, GROUP_TOKENS, axis=0)[:tokens, :, None]
        err = np.abs(decoded.astype(np.float64) - original)
        slack = 1 + 2.0**-20
        if codec == "int8":
            bound = per_element / 2 * slack
        else:  # e4m3: 3 mantissa bits above 2**-6 (relative 2**-4), subnormal step 2**-9 below
            bound = np.maximum(np.abs(original) * 2.0**-4, per_element * 2.0**-10) * slack
        assert (err <= bound + 1e-45).all(), float((err - bound).max())
        assert (decoded[original == 0] == 0).all()  # zero is exact
        # Each scale is amax / QMAX of its group and head (or the floor 2**-126).
        amax = np.maximum.reduceat(np.abs(original).max(axis=2), np.arange(0, tokens, GROUP_TOKENS), axis=0)
        qmax = 127.0 if codec == "int8" else 448.0
        assert np.allclose(scales, np.maximum(amax / qmax, 2.0**-126), rtol=2.0**-23, atol=0)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_lossy_half_precision_round_trip(codec: str, dtype: str) -> None:
    x = kv_values(np.random.default_rng(7), 20) / 1e3
    geo = geometry(dtype)
    el = elements(x, dtype)
    dk, _ = decode_layer(codec, *encode_layer(codec, el, el, geo, 20), geo, 20)
    assert dk.dtype == geo.numpy_dtype
    original, decoded = as_float(el, dtype), as_float(dk, dtype)
    amax = np.abs(original).max()
    # Within the codec's step plus one rounding to the element type.
    assert np.abs(decoded - original).max() <= amax * (2.0**-4 if codec == "fp8-e4m3" else 1 / 127) * 1.01


@pytest.mark.parametrize("codec", LOSSY)
def test_zero_groups_and_tiny_values(codec: str) -> None:
    geo = geometry("fp32", heads=1, dim=2)
    x = np.zeros((17, 1, 2), dtype=np.float32)
    x[16] = [1e-40, -1e-45]  # subnormal float32 values alone in their group
    k_sec, _ = encode_layer(codec, x, x, geo, 17)
    scales = np.frombuffer(bytes(k_sec), "<f4", count=2)
    assert scales[0] == SCALE_MIN and scales[1] == SCALE_MIN  # the floor, never 0
    dk, _ = decode_layer(codec, k_sec, k_sec, geo, 17)
    assert np.abs(dk - x).max() <= 1e-40


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_lossy_rejects_non_finite_elements(codec: str, bad: float) -> None:
    x = np.ones((3, 2, 8), dtype=np.float32)
    x[2, 1, 5] = bad
    assert error_field(lambda: encode_layer(codec, x, np.ones_like(x), geometry("fp32"), 3)) == "data"
    h = x.astype("<f2")
    assert error_field(lambda: encode_layer(codec, h, h, geometry("fp16"), 3)) == "data"


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", ["int8", "fp8-e4m3", "fp8-e5m2"])
def test_lossy_codes_float_caches_only(codec: str, dtype: str) -> None:
    geo = geometry(dtype)
    a = np.zeros(geo.shape(2), dtype=np.uint8)
    assert error_field(lambda: encode_layer(codec, a, a, geo, 2)) == "codec"
    assert error_field(lambda: decode_layer(codec, b"", b"", geo, 0)) == "codec"


# ---------------------------------------------------------------------------------------------
# Hostile sections


def lossy_section(codec: str, tokens: int = 17) -> tuple[bytes, Geometry]:
    geo = geometry("fp32")
    x = kv_values(np.random.default_rng(9), tokens)
    return bytes(encode_layer(codec, x, x, geo, tokens)[0]), geo


@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_malformed_lengths(codec: str) -> None:
    section, geo = lossy_section(codec)
    for bad in (b"", section[:1], section[:-1], section + b"\x00", section[:4]):
        assert error_field(lambda: decode_layer(codec, bad, section, geo, 17)) == "lengths"
        assert error_field(lambda: decode_layer(codec, section, bad, geo, 17)) == "lengths"
    # Sizes that disagree with the geometry: other token counts, heads, dims.
    for tokens in (16, 18, 0):
        assert error_field(lambda: decode_layer(codec, section, section, geo, tokens)) == "lengths"
    for other in (geometry("fp32", 1, 8), geometry("fp32", 2, 4), geometry("fp32", 4, 4)):
        assert error_field(lambda: decode_layer(codec, section, section, other, 17)) == "lengths"
    for tokens in (-1, 1 << 32, True, 1.0):
        assert error_field(lambda: decode_layer(codec, section, section, geo, tokens)) == "token_count"  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, np.nan, np.inf, -np.inf, 1e-40, 2.0**-127, -(2.0**-126)])
@pytest.mark.parametrize("position", [0, 3])  # the first and the last scale (2 groups x 2 heads)
def test_lossy_bad_scales(codec: str, scale: float, position: int) -> None:
    section, geo = lossy_section(codec)
    bad = bytearray(section)
    struct.pack_into("<f", bad, 4 * position, scale)
    with pytest.raises(ContainerError) as info:
        decode_layer(codec, bytes(bad), section, geo, 17)
    assert info.value.field == "scales" and "K scale" in str(info.value)
    struct.pack_into("<f", bad, 4 * position, 2.0**-126)  # the smallest valid scale
    decode_layer(codec, bytes(bad), section, geo, 17)


@pytest.mark.parametrize("codec, code", [("fp8-e4m3", 0x7F), ("fp8-e4m3", 0xFF), ("int8", 0x80)])
def test_lossy_codes_no_encoder_writes(codec: str, code: int) -> None:
    section, geo = lossy_section(codec)
    for offset in (16, len(section) - 1):
        bad = bytearray(section)
        bad[offset] = code
        assert error_field(lambda: decode_layer(codec, section, bytes(bad), geo, 17)) == "codes"


def zstd_section(geo: Geometry, tokens: int = 5) -> tuple[bytes, np.ndarray]:
    k = np.random.default_rng(11).integers(0, 1 << 16, size=geo.shape(tokens), dtype=np.uint16)
    return bytes(encode_layer("zstd-planes", k, k, geo, tokens)[0]), k


def test_zstd_planes_malformed_frames() -> None:
    geo = geometry("bf16")
    section, k = zstd_section(geo)
    expected = geo.section_bytes(5)
    comp = zstandard.ZstdCompressor(level=1)
    planes = k.reshape(-1).view(np.uint8).reshape(-1, 2).T.tobytes()
    cases = {
        "empty": b"",
        "garbage": b"not a zstd frame at all",
        "magic only": section[:4],
        "truncated": section[:-1],
        "trailing octet": section + b"\x00",
        "two frames": section + section,
        "skippable frame after": section + b"\x50\x2a\x4d\x18\x00\x00\x00\x00",
        "skippable frame": b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd",
        "content size of other tokens": comp.compress(planes[: expected - 2]),
        "no content size": zstandard.ZstdCompressor(write_content_size=False).compress(planes),
    }
    # Hand-built frames (RFC 8878): magic, a single-segment descriptor with a 1-octet content
    # size (expected = 160 here), then raw blocks (header: size << 3 | type << 1 | last).
    assert expected == 160

    def frame(size: int, blocks: list[tuple[int, bytes]], descriptor: bytes = b"\x20") -> bytes:
        out = b"\x28\xb5\x2f\xfd" + descriptor + bytes([size])
        for index, (kind, data) in enumerate(blocks):
            last = int(index == len(blocks) - 1)
            out += ((len(data) << 3) | (kind << 1) | last).to_bytes(3, "little") + data
        return out

    cases["content size that lies (one less)"] = frame(expected - 1, [(0, planes)])
    cases["blocks hold less than declared"] = frame(expected, [(0, planes[:-1])])
    cases["blocks hold more than declared"] = frame(expected, [(0, planes[:80]), (0, planes[80:] + b"x")])
    cases["reserved block type"] = frame(expected, [(3, planes)])
    cases["dictionary id"] = frame(expected, [(0, planes)], descriptor=b"\x21\x07")
    cases["raw-content dictionary"] = zstandard.ZstdCompressor(
        dict_data=zstandard.ZstdCompressionDict(planes[:100], dict_type=zstandard.DICT_TYPE_RAWCONTENT)).compress(planes)
    for name, bad in cases.items():
        assert error_field(lambda: decode_layer("zstd-planes", bad, section, geo, 5)) == "frame", name
    # The honest frame built the same way decodes, and so does one with a content checksum.
    assert decode_layer("zstd-planes", frame(expected, [(0, planes[:80]), (0, planes[80:])]), section, geo, 5)[0].tobytes() == k.tobytes()
    checked = zstandard.ZstdCompressor(write_checksum=True).compress(planes)
    assert decode_layer("zstd-planes", checked, section, geo, 5)[0].tobytes() == k.tobytes()
    corrupt = checked[:-5] + bytes([checked[-5] ^ 1]) + checked[-4:]
    assert error_field(lambda: decode_layer("zstd-planes", corrupt, section, geo, 5)) == "frame"
    # Zero elements: the empty section, and nothing else.
    assert error_field(lambda: decode_layer("zstd-planes", b"\x00", b"", geo, 0)) == "lengths"


def test_zstd_planes_never_sizes_output_from_the_frame() -> None:
    """A frame declaring 2**40 octets is refused before anything is allocated for it."""
    geo = geometry("fp16")
    section, _ = zstd_section(geo)
    huge = b"\x28\xb5\x2f\xfd" + bytes([0xC0]) + (1 << 40).to_bytes(8, "little") + b"\x01\x00\x00"
    tracemalloc.start()
    try:
        assert error_field(lambda: decode_layer("zstd-planes", huge, section, geo, 5)) == "frame"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(ALL), data=st.binary(max_size=600), tokens=st.integers(0, 40),
       dtype=st.sampled_from(["fp32", "fp16", "bf16"]))
def test_fuzz_sections_give_elements_or_the_container_error(codec: str, data: bytes, tokens: int, dtype: str) -> None:
    geo = geometry(dtype, heads=2, dim=4)
    try:
        k, v = decode_layer(codec, data, data, geo, tokens)
    except ContainerError:
        return
    assert k.shape == v.shape == geo.shape(tokens) and k.dtype == geo.numpy_dtype


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from(LOSSY), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4))
def test_fuzz_mutated_lossy_sections(codec: str, flips: list[tuple[int, int]]) -> None:
    section, geo = lossy_section(codec)
    bad = bytearray(section)
    for offset, mask in flips:
        bad[offset % len(bad)] ^= mask
    try:
        k, _ = decode_layer(codec, bytes(bad), section, geo, 17)
    except ContainerError as exc:
        assert exc.field in ("scales", "codes")
        return
    # A scale larger than any encoder writes may overflow to ±inf, as raw sections may hold.
    assert k.shape == geo.shape(17) and not np.isnan(k).any()


# ---------------------------------------------------------------------------------------------
# Containers in a codec: the existing container functions, digests over the coded sections


@pytest.mark.parametrize("codec", ALL)
def test_container_in_a_codec(codec: str) -> None:
    geo = geometry("bf16", heads=2, dim=8)
    rng = np.random.default_rng(12)
    layers = [(bf16_bits(kv_values(rng, 32)), bf16_bits(kv_values(rng, 32))) for _ in range(3)]
    data = encode_block(codec, layers, geo, first_layer=5)
    container = decode_container(data, geometry=geo)
    header = container.header
    assert header.codec == CODECS_BY_NAME[codec].value
    assert (header.first_layer, header.layer_count, header.token_count) == (5, 3, 32)
    sections = [encode_layer(codec, k, v, geo, 32) for k, v in layers]
    # §4.3: the layer digest is SHA-256 over the coded K section followed by the coded V section.
    expected = [hashlib.sha256(bytes(k) + bytes(v)).digest() for k, v in sections]
    assert container.layer_digests() == expected
    assert container.replica_digest() == hashlib.sha256(b"".join(expected)).digest()
    decoder = ContainerDecoder(geometry=geo)
    for i in range(0, len(data), 7):
        decoder.feed(data[i:i + 7])
    assert decoder.layer_digests == expected
    decoded = decode_block(data, geo)
    assert len(decoded) == 3
    if codec in ("raw", "zstd-planes"):
        assert all(np.array_equal(dk, k) and np.array_equal(dv, v) for (dk, dv), (k, v) in zip(decoded, layers))
    # A layer range of a coded container is a coded container of those layers.
    part = extract_layers(data, 6, 7)
    assert decode_container(part).layer_digests() == expected[1:]
    assert [d[0].tobytes() for d in decode_block(part, geo)] == [d[0].tobytes() for d in decoded[1:]]


def test_raw_through_the_codecs_is_byte_identical() -> None:
    geo = geometry("fp16")
    rng = np.random.default_rng(13)
    layers = [(kv_values(rng, 9).astype("<f2"), kv_values(rng, 9).astype("<f2")) for _ in range(2)]
    assert encode_block("raw", layers, geo, first_layer=1) == encode_raw_block(layers, geo, first_layer=1)
    k_view, v_view = encode_layer(1, *layers[0], geo, 9)
    assert isinstance(k_view, memoryview) and np.shares_memory(np.frombuffer(k_view, np.uint8), layers[0][0])
    assert coded_section_bytes("raw", geo, 9) == geo.section_bytes(9)
    assert coded_section_bytes("zstd-planes", geo, 9) is None


def test_encode_block_argument_errors() -> None:
    geo = geometry("fp32")
    a = np.zeros((4, 2, 8), np.float32)
    assert error_field(lambda: encode_block("int8", [], geo)) == "layer_count"
    assert error_field(lambda: encode_block("int8", [(a, a), (a[:2], a[:2])], geo)) == "token_count"
    assert error_field(lambda: encode_layer("fp8-e4m3", a, a, geo, 3)) == "token_count"
    assert error_field(lambda: encode_layer("int8", a[:, :1], a[:, :1], geo, 4)) == "data"
    assert error_field(lambda: encode_layer("zstd-planes", a.astype(np.float64), a, geo, 4)) == "data"


# ---------------------------------------------------------------------------------------------
# kvsp bench codec: its figures on a tiny case


def test_bench_codec_figures_on_a_tiny_case() -> None:
    from kvsp_moq.bench.codec import accuracy_figures, speed_figures
    from kvsp_moq.bench.codec.accuracy import BF16_ROUNDING, evaluate, outlier_model, prompts, reference_model
    from kvsp_moq.model import ModelConfig

    torch.set_num_threads(1)
    config = ModelConfig(layers=2)
    model = reference_model(config)
    prompt_list = prompts(2, 2 * 16 + 1)
    results, context = evaluate(model, ("raw", "int8", "zstd-planes", BF16_ROUNDING), prompt_list,
                                block_tokens=16, steps=8, new_tokens=4)
    assert (results["raw"].logit_err, results["raw"].top1, results["raw"].greedy) == (0.0, 1.0, 1.0)
    assert (results["zstd-planes"].logit_err, results["zstd-planes"].kv_rel_err) == (0.0, 0.0)
    assert 0 < results["int8"].kv_rel_err < 0.05 and 0 < results["int8"].logit_err
    assert 0 <= results["int8"].top1 <= 1 and context["raw_logit_std"] > 0
    # The outlier model computes the same function (exactly: the scale is a power of two) but
    # its K cache has channels 16 x larger.
    outliers = outlier_model(config, scale=16.0)
    ids = prompt_list[0]
    plain, odd = model.prefill(ids), outliers.prefill(ids)
    assert torch.equal(plain.logits, odd.logits)
    k_plain, k_odd = plain.cache.layer(0)[0], odd.cache.layer(0)[0]
    assert torch.allclose(k_odd[:, :, [15, 31]], 16 * k_plain[:, :, [15, 31]])
    assert torch.equal(k_odd[:, :, :15], k_plain[:, :, :15])

    figures = accuracy_figures(("int8",), prompt_count=2, prompt_blocks=1, block_tokens=16, steps=4,
                               new_tokens=2, outlier_scale=16.0)
    names = [f.name for f in figures]
    assert names == ["codec_int8_logit_err", "codec_int8_top1", "codec_int8_greedy",
                     "codec_int8_logit_err_outliers", "codec_int8_top1_outliers", "codec_int8_greedy_outliers"]
    assert [f.baseline_name for f in figures] == [n.replace("int8", "raw") for n in names]
    assert figures[1].baseline_value == 1.0 and "bf16_top1" in figures[1].params

    speed = speed_figures(("zstd-planes",), blocks=1, block_tokens=16, repeat=1, link_mbit=1000.0)
    assert [f.name for f in speed] == ["codec_zstd-planes_ratio", "codec_zstd-planes_encode", "codec_zstd-planes_decode"]
    assert speed[0].baseline_value == 1.0 and speed[0].value > 1.0
    assert all(f.value > 0 and f.baseline_value > 0 for f in speed)


@pytest.mark.parametrize("codec", ALL)
def test_zero_tokens_is_the_empty_section(codec: str) -> None:
    geo = geometry("bf16")
    empty = np.zeros(geo.shape(0), dtype=np.uint16)
    k_sec, v_sec = encode_layer(codec, empty, empty, geo, 0)
    assert bytes(k_sec) == bytes(v_sec) == b""
    assert all(a.shape == geo.shape(0) for a in decode_layer(codec, b"", b"", geo, 0))


def test_kvsp_bench_codec_command() -> None:
    """The subcommand end to end on a tiny run: a JSON line per figure, each named
    codec_<codec>_<figure> beside codec_raw_<figure>, and the table on stderr."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvsp_moq", "bench", "codec", "--prompts", "2", "--prompt-blocks", "1",
         "--block-tokens", "16", "--steps", "4", "--new-tokens", "2", "--speed-blocks", "1", "--repeat", "1"],
        capture_output=True, text=True, timeout=300, check=True)
    figures = [json.loads(line) for line in proc.stdout.splitlines()]
    names = {f["name"] for f in figures}
    for codec in ("fp8-e4m3", "int8", "zstd-planes"):
        for figure in ("ratio", "encode", "decode", "logit_err", "top1", "greedy",
                       "logit_err_outliers", "top1_outliers", "greedy_outliers"):
            assert f"codec_{codec}_{figure}" in names
    for f in figures:
        assert f["baseline_name"] == re.sub(r"^codec_[^_]+_", "codec_raw_", f["name"])
        assert f["name"] in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "kvsp_moq", "bench", "codec", "--steps", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "positive" in bad.stderr
