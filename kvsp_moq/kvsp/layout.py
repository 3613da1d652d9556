"""Codec "raw" (0x0001) and its section layout "kvsp-layout-1" (kvsp-draft §4.3).

§4.3: "For codec 0x0001 ("raw"), the K and V sections of a layer each hold Token Count x
kv_heads x head_dim elements of kv_dtype, in row-major order with the token index varying
slowest and the dimension index fastest, each element in little-endian octet order."

So a section is exactly a C-contiguous little-endian array shaped ``[tokens, kv_heads,
head_dim]``. Encoding hands out views of the caller's arrays whenever they already have that
form; decoding returns ``np.frombuffer`` views of the container octets (zero-copy) with the
registry's ``numpy_storage`` dtype (bf16/fp8 as raw unsigned bit patterns, §11.2.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .container import BytesLike, encode_container
from .errors import ContainerError
from .registries import CODEC_RAW, ELEMENT_TYPES, ElementType

__all__ = [
    "LAYOUT",
    "Geometry",
    "decode_raw_layer",
    "encode_raw_block",
    "encode_raw_layer",
    "from_descriptor_fields",
]

LAYOUT = "kvsp-layout-1"  # §4.1 "layout", §4.3

# numpy kinds that can carry element bit patterns: signed, unsigned, float.
_NUMERIC_KINDS = frozenset("iuf")


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ContainerError("geometry", f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Geometry:
    """The per-layer cache geometry of a Compatibility Descriptor (§4.1) that fixes the size
    and shape of raw sections (§4.3)."""

    kv_heads: int
    head_dim: int
    dtype: ElementType

    def __post_init__(self) -> None:
        _positive("kv_heads", self.kv_heads)
        _positive("head_dim", self.head_dim)
        if not isinstance(self.dtype, ElementType):
            raise ContainerError("geometry", f"dtype must be an ElementType, got {self.dtype!r}")

    @classmethod
    def from_descriptor_fields(cls, kv_heads: int, head_dim: int, kv_dtype_name: str) -> Geometry:
        """From the descriptor members ``kv_heads``, ``head_dim``, ``kv_dtype`` (§4.1)."""
        dtype = ELEMENT_TYPES.get(kv_dtype_name) if isinstance(kv_dtype_name, str) else None
        if dtype is None:
            raise ContainerError(
                "kv_dtype", f"{kv_dtype_name!r} is not a registered element type "
                f"({', '.join(sorted(ELEMENT_TYPES))})"
            )
        return cls(kv_heads, head_dim, dtype)

    @property
    def numpy_dtype(self) -> np.dtype[np.generic]:
        """The little-endian numpy dtype holding one element bit for bit."""
        return np.dtype(self.dtype.numpy_storage)

    def shape(self, tokens: int) -> tuple[int, int, int]:
        """Shape of one section: [tokens, kv_heads, head_dim] (token index slowest)."""
        return (tokens, self.kv_heads, self.head_dim)

    def section_bytes(self, tokens: int) -> int:
        """Octets of one K or V section: tokens x kv_heads x head_dim x itemsize (§4.3)."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ContainerError("token_count", f"must be an integer >= 0, got {tokens!r}")
        return tokens * self.kv_heads * self.head_dim * self.dtype.itemsize


from_descriptor_fields = Geometry.from_descriptor_fields


def _section_view(name: str, array: np.ndarray, geometry: Geometry) -> memoryview:
    """Octets of one section in kvsp-layout-1: C order, little-endian; copies only if needed."""
    if not isinstance(array, np.ndarray):
        raise ContainerError("data", f"{name} must be a numpy array, got {type(array).__name__}")
    dtype = array.dtype
    if dtype.kind not in _NUMERIC_KINDS or dtype.itemsize != geometry.dtype.itemsize:
        raise ContainerError(
            "data",
            f"{name} dtype {dtype} does not carry {geometry.dtype.name} "
            f"({geometry.dtype.itemsize}-octet elements)",
        )
    if array.ndim != 3 or array.shape[1:] != (geometry.kv_heads, geometry.head_dim):
        raise ContainerError(
            "data",
            f"{name} shape {array.shape} is not [tokens, {geometry.kv_heads}, {geometry.head_dim}]",
        )
    little = dtype.newbyteorder("<")
    if dtype != little or not array.flags.c_contiguous:
        array = array.astype(little, order="C")  # the only copy: byte swap or re-layout
    return array.reshape(-1).view(np.uint8).data.toreadonly()


def encode_raw_layer(
    k: np.ndarray, v: np.ndarray, geometry: Geometry
) -> tuple[memoryview, memoryview]:
    """The K and V sections of one layer (§4.3, kvsp-layout-1) as read-only byte views.

    ``k`` and ``v`` are shaped [tokens, kv_heads, head_dim] with the element type's itemsize
    (any signed, unsigned or float dtype of that size carries the bit patterns). The views
    share memory with the arrays when these are already C-contiguous and little-endian.
    """
    k_view = _section_view("K", k, geometry)
    v_view = _section_view("V", v, geometry)
    if k.shape[0] != v.shape[0]:
        raise ContainerError("data", f"K holds {k.shape[0]} tokens but V {v.shape[0]}")
    return k_view, v_view


def decode_raw_layer(
    k_bytes: BytesLike, v_bytes: BytesLike, geometry: Geometry, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy arrays [tokens, kv_heads, head_dim] of ``numpy_storage`` dtype over K and V.

    The arrays are views of the given buffers (read-only when those are). ContainerError
    (field "lengths") when a section does not hold exactly ``tokens`` tokens.
    """
    expected = geometry.section_bytes(tokens)
    shape = geometry.shape(tokens)
    dtype = geometry.numpy_dtype
    arrays = []
    for name, section in (("K", k_bytes), ("V", v_bytes)):
        view = memoryview(section)
        if view.nbytes != expected:
            raise ContainerError(
                "lengths",
                f"{name} section has {view.nbytes} octets, {tokens} tokens need {expected}",
            )
        arrays.append(np.frombuffer(view, dtype=dtype).reshape(shape))
    return arrays[0], arrays[1]


def encode_raw_block(
    layers_kv: Sequence[tuple[np.ndarray, np.ndarray]],
    geometry: Geometry,
    first_layer: int = 0,
) -> bytes:
    """A complete codec-raw container (§4.3) of ``layers_kv`` = [(K, V), ...] from
    ``first_layer`` on; every layer must hold the same number of tokens."""
    if len(layers_kv) == 0:
        raise ContainerError("layer_count", "a container holds at least one layer")
    sections = [encode_raw_layer(k, v, geometry) for k, v in layers_kv]
    tokens = {k.shape[0] for k, _ in layers_kv}
    if len(tokens) != 1:
        raise ContainerError("token_count", f"layers hold different token counts {sorted(tokens)}")
    return encode_container(CODEC_RAW.value, first_layer, tokens.pop(), sections)
