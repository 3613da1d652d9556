"""Element values for the codecs: a layer's arrays in kvsp-layout-1 (kvsp-draft §4.3) to float32
and back, bit exact where the element type allows.

numpy has no bf16: bf16 elements travel as their ``uint16`` bit patterns (the registry's
``numpy_storage``, §11.2.3). Widening fp16 and bf16 to float32 is exact; narrowing float32 to
them rounds to nearest, ties to even, as IEEE 754 conversion does (overflow gives ±inf).
"""

from __future__ import annotations

import numpy as np

from ..errors import ContainerError
from ..layout import Geometry, encode_raw_layer

__all__ = [
    "FLOAT_TYPES",
    "check_float_geometry",
    "check_tokens",
    "from_float32",
    "layer_elements",
    "to_float32",
]

FLOAT_TYPES = frozenset({"fp32", "fp16", "bf16"})
"""Element types the quantizing codecs take in and give back (the values they scale)."""


def check_tokens(tokens: object) -> int:
    """A token count: an integer >= 0 (a uint32 in the container, §4.3)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens < 1 << 32:
        raise ContainerError("token_count", f"must be an integer in [0, 2**32), got {tokens!r}")
    return tokens


def check_float_geometry(codec_name: str, geometry: Geometry) -> None:
    """ContainerError("codec") unless ``geometry``'s element type is one a quantizer codes."""
    if geometry.dtype.name not in FLOAT_TYPES:
        raise ContainerError(
            "codec", f"{codec_name} codes {', '.join(sorted(FLOAT_TYPES))} caches, "
            f"not {geometry.dtype.name}"
        )


def layer_elements(
    k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """K and V as C-contiguous arrays of the registry's ``numpy_storage`` dtype, shaped
    [tokens, kv_heads, head_dim]: the raw sections' element bit patterns (no copy when the
    input is already in that form). Checks shapes and itemsize as :func:`encode_raw_layer`."""
    check_tokens(tokens)
    k_view, v_view = encode_raw_layer(k, v, geometry)
    if k.shape[0] != tokens:
        raise ContainerError("token_count", f"K and V hold {k.shape[0]} tokens, not {tokens}")
    shape = geometry.shape(tokens)
    dtype = geometry.numpy_dtype
    return (np.frombuffer(k_view, dtype=dtype).reshape(shape),
            np.frombuffer(v_view, dtype=dtype).reshape(shape))


def to_float32(elements: np.ndarray, type_name: str) -> np.ndarray:
    """Float32 values of fp32/fp16/bf16 elements (``numpy_storage`` dtype); exact."""
    if type_name == "fp32":
        return elements.astype(np.float32, copy=False)
    if type_name == "fp16":
        return elements.astype(np.float32)
    if type_name == "bf16":
        return (elements.astype(np.uint32) << 16).view(np.float32)
    raise ContainerError("codec", f"{type_name} elements have no float32 value here")


def from_float32(values: np.ndarray, type_name: str) -> np.ndarray:
    """fp32/fp16/bf16 elements (``numpy_storage`` dtype) nearest to float32 ``values``,
    ties to even."""
    if type_name == "fp32":
        return values.astype("<f4", copy=False)
    if type_name == "fp16":
        return values.astype("<f2")
    if type_name == "bf16":
        bits = values.astype(np.float32, copy=False).view(np.uint32)
        # Round to the upper 16 bits, ties to even. NaN is never given (the codecs reject it).
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        return (rounded >> np.uint32(16)).astype("<u2")
    raise ContainerError("codec", f"{type_name} elements have no float32 value here")
