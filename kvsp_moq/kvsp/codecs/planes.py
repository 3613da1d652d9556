"""Codec ``zstd-planes`` (0xFF03, private use): lossless. The section's elements split into
byte planes, the planes compressed as one Zstandard frame (RFC 8878).

A K or V section of P = T x H x D elements of s octets each (any element type): the content
is plane 0, plane 1, ..., plane s-1, where plane j holds octet j (little-endian: j = 0 is the
least significant) of every element in kvsp-layout-1 order. The section is:

- empty, when P = 0;
- otherwise exactly one Zstandard frame whose Frame_Content_Size is present and equals s x P,
  without a dictionary (Dictionary_ID absent or 0), and nothing after it (no second frame, no
  skippable frame). A content checksum is allowed, and verified when present.

How the frame is compressed is the encoder's choice and not part of the encoding: this one
uses level 1 and ends a block after each plane, so that each plane gets its own entropy
tables (the exponent plane of bf16 compresses to about a third, the mantissa plane hardly at
all; docs/container.md has the measurements that chose this). Decoding is exact whatever the
encoder did, so test vectors pin decoded octets; the compressed octets of another zstd
version or level may differ (and with them the layer digests of a replica coded elsewhere).

A decoder never trusts the frame for the size of its output: the size comes from the
geometry and the container's Token Count, and a frame declaring another size is rejected
before anything is decompressed.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ..container.header import BytesLike, byte_view
from ..errors import ContainerError
from ..layout import Geometry
from ..registries import CODEC_ZSTD_PLANES
from .elements import check_tokens, layer_elements

if TYPE_CHECKING:
    import zstandard

__all__ = ["LEVEL", "ZSTD_PLANES", "PlanesCodec", "join_planes", "split_planes", "zstandard_module"]

LEVEL = 1  # measured best for bf16 planes (ratio and speed), docs/container.md
_local = threading.local()  # one compressor and decompressor per thread (not thread-safe)


def zstandard_module() -> ModuleType:
    """The ``zstandard`` package (a dependency of kvsp-moq); ContainerError("codec") naming
    the package when it is not installed."""
    try:
        import zstandard
    except ImportError:
        raise ContainerError(
            "codec", "codec zstd-planes needs the Python package zstandard (pip install zstandard)"
        ) from None
    return zstandard


def split_planes(elements: np.ndarray) -> np.ndarray:
    """[s, P] uint8: plane j is octet j (j = 0 least significant) of every element, in C
    order. Shifts of the elements' unsigned integer view, not a strided byte transpose
    (several times faster)."""
    size = elements.dtype.itemsize
    words = elements.reshape(-1).view(np.dtype(f"<u{size}"))
    planes = np.empty((size, words.size), dtype=np.uint8)
    np.copyto(planes[0], words, casting="unsafe")  # the low octet (modulo 256)
    for j in range(1, size):
        np.right_shift(words, 8 * j, out=planes[j], casting="unsafe")
    return planes


def join_planes(content: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`split_planes`: elements of ``dtype`` (little-endian) shaped ``shape``."""
    size = dtype.itemsize
    planes = content.reshape(size, -1)
    words = planes[size - 1].astype(np.dtype(f"<u{size}"))
    for j in range(size - 2, -1, -1):
        words <<= 8
        words |= planes[j]
    return words.view(dtype).reshape(shape)


class PlanesCodec:
    """The ``zstd-planes`` codec (lossless, every element type)."""

    codec = CODEC_ZSTD_PLANES

    def section_bytes(self, geometry: Geometry, tokens: int) -> int | None:
        """None: the length of a compressed section depends on its content."""
        check_tokens(tokens)
        return None

    def encode_layer(
        self, k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
    ) -> tuple[bytes, bytes]:
        """The K and V sections of one layer; ``k``/``v`` as for ``encode_raw_layer``."""
        k_el, v_el = layer_elements(k, v, geometry, tokens)
        return _encode_section(k_el), _encode_section(v_el)

    def decode_layer(
        self, k_section: BytesLike, v_section: BytesLike, geometry: Geometry, tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V [tokens, kv_heads, head_dim] in the geometry's ``numpy_storage`` dtype,
        bit for bit what was encoded. ContainerError ``frame`` for a section that is not one
        frame of the expected content size (or fails to decompress)."""
        check_tokens(tokens)
        return (_decode_section("K", k_section, geometry, tokens),
                _decode_section("V", v_section, geometry, tokens))


def _compressor() -> zstandard.ZstdCompressor:
    comp: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if comp is None:
        comp = _local.compressor = zstandard_module().ZstdCompressor(level=LEVEL)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard_module().ZstdDecompressor()
    return dec


def _encode_section(elements: np.ndarray) -> bytes:
    if elements.size == 0:
        return b""
    zstd = zstandard_module()
    planes = split_planes(elements)
    stream = _compressor().compressobj(size=planes.nbytes)
    parts = []
    for index, plane in enumerate(planes):
        parts.append(stream.compress(plane))
        if index + 1 < len(planes):
            parts.append(stream.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(stream.flush())
    return b"".join(parts)


def _decode_section(which: str, section: BytesLike, geometry: Geometry, tokens: int) -> np.ndarray:
    view = byte_view(section)
    expected = geometry.section_bytes(tokens)
    shape = geometry.shape(tokens)
    dtype = geometry.numpy_dtype
    if expected == 0:
        if view.nbytes:
            raise ContainerError(
                "lengths", f"zstd-planes {which} section of 0 elements has {view.nbytes} octets, not 0"
            )
        return np.empty(shape, dtype=dtype)
    zstd = zstandard_module()
    try:
        declared = zstd.frame_content_size(view)
        params = zstd.get_frame_parameters(view)
    except zstd.ZstdError as exc:
        raise ContainerError("frame", f"zstd-planes {which} section is not a Zstandard frame: {exc}") from None
    if declared != expected:
        what = "no content size" if declared < 0 else f"content size {declared}"
        raise ContainerError(
            "frame", f"zstd-planes {which} frame declares {what}; {tokens} tokens need {expected}"
        )
    if params.dict_id:
        raise ContainerError("frame", f"zstd-planes {which} frame needs dictionary {params.dict_id}")
    try:
        content = _decompressor().decompress(view, max_output_size=expected, allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise ContainerError("frame", f"zstd-planes {which} frame: {exc}") from None
    if len(content) != expected:  # libzstd checks the declared size; kept as a guard
        raise ContainerError("frame", f"zstd-planes {which} frame gave {len(content)} octets, not {expected}")
    return join_planes(np.frombuffer(content, dtype=np.uint8), dtype, shape)


ZSTD_PLANES = PlanesCodec()
