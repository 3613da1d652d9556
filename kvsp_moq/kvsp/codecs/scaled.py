"""The section encoding the quantizing codecs share (``fp8-e4m3``, ``int8``; docs/container.md
"Codecs"): a float32 scale per group of 16 tokens and per KV head, then one code per element.

A K or V section of T tokens, H KV heads and D dims, with N = ceil(T / 16) token groups::

    Scales: N x H float32, little-endian, group-major ([group][head])
    Codes:  T x H x D codes of one octet, in kvsp-layout-1 order ([token][head][dim])

K and V are two sections, so each has its own scales. Group g holds tokens [16 g, 16 g + 16)
of the section (the last group may be shorter). Encoding, all arithmetic in IEEE float32 with
rounding to nearest, ties to even, so that every encoder writes the same octets:

    amax  = max |x| over the group's tokens and the head's dims
    scale = max(amax / QMAX, 2**-126)          QMAX: 448 (e4m3fn) or 127 (int8)
    code  = Q(clamp(x / scale, -QMAX, QMAX))   Q: the codec's rounding to its code set

and decoding: x' = value(code) x scale in float32, then rounded to the element type. A scale
is valid when it is a positive normal finite float32 (2**-126 <= scale <= FLT_MAX): zero,
negative, subnormal, infinite and NaN scales are rejected. (A valid scale larger than any
encoder writes can make x' overflow to ±inf, as IEEE arithmetic does; raw sections can hold
±inf too.) Elements that are not finite cannot be coded (ContainerError "data").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..container.header import BytesLike, byte_view
from ..errors import ContainerError
from ..layout import Geometry
from ..registries import Codec
from .elements import check_float_geometry, check_tokens, from_float32, layer_elements, to_float32

__all__ = ["GROUP_TOKENS", "SCALE_MIN", "Quantizer", "ScaledCodec", "group_count"]

GROUP_TOKENS = 16
"""Tokens per scale group: a block of B tokens (B a multiple of 16) holds whole groups."""

SCALE_MIN = np.float32(2.0**-126)
"""The smallest scale: float32's smallest positive normal (an all-zero group gets it)."""
_SCALE_MAX = np.float32(np.finfo(np.float32).max)
_SCALE_DTYPE = np.dtype("<f4")
_SCALE_SIZE = 4


def group_count(tokens: int) -> int:
    """N = ceil(tokens / 16): scale groups in a section of ``tokens`` tokens."""
    return -(-tokens // GROUP_TOKENS)


@dataclass(frozen=True)
class Quantizer:
    """What differs between the quantizing codecs: the code set and its rounding."""

    qmax: float  # the largest code magnitude: |x / scale| is clamped to it
    code_dtype: np.dtype  # one octet: uint8 (e4m3fn bit patterns) or int8
    quantize: Callable[[np.ndarray], np.ndarray]  # float32 in [-qmax, qmax] -> codes
    dequantize: Callable[[np.ndarray], np.ndarray]  # codes -> their float32 values
    invalid_code: Callable[[np.ndarray], int | None]  # the first code no encoder writes


class ScaledCodec:
    """A quantizing codec: scales per token group and KV head, one octet per element."""

    def __init__(self, codec: Codec, quantizer: Quantizer) -> None:
        self.codec = codec
        self._q = quantizer
        self._qmax = np.float32(quantizer.qmax)

    def section_bytes(self, geometry: Geometry, tokens: int) -> int:
        """Octets of one K or V section: 4 N H + T H D."""
        check_tokens(tokens)
        h, d = geometry.kv_heads, geometry.head_dim
        return _SCALE_SIZE * group_count(tokens) * h + tokens * h * d

    # -- encoding ---------------------------------------------------------------------------

    def encode_layer(
        self, k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
    ) -> tuple[bytes, bytes]:
        """The K and V sections of one layer; ``k``/``v`` as for ``encode_raw_layer``."""
        check_float_geometry(self.codec.name, geometry)
        k_el, v_el = layer_elements(k, v, geometry, tokens)
        name = geometry.dtype.name
        return (self._encode_section("K", to_float32(k_el, name)),
                self._encode_section("V", to_float32(v_el, name)))

    def _encode_section(self, which: str, x: np.ndarray) -> bytes:
        tokens = x.shape[0]
        if tokens == 0:
            return b""
        token_amax = np.abs(x).max(axis=2)  # [T, H]
        amax = np.maximum.reduceat(token_amax, np.arange(0, tokens, GROUP_TOKENS), axis=0)
        if not np.isfinite(amax).all():
            group, head = np.argwhere(~np.isfinite(amax))[0]
            raise ContainerError(
                "data", f"{self.codec.name} cannot code the non-finite elements of {which} "
                f"(token group {group}, head {head})"
            )
        scales = np.maximum(amax / self._qmax, SCALE_MIN).astype(_SCALE_DTYPE)
        y = x / _per_token(scales, tokens)
        np.clip(y, -self._qmax, self._qmax, out=y)
        codes = self._q.quantize(y)
        return scales.tobytes() + codes.tobytes()

    # -- decoding ---------------------------------------------------------------------------

    def decode_layer(
        self, k_section: BytesLike, v_section: BytesLike, geometry: Geometry, tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V [tokens, kv_heads, head_dim] in the geometry's ``numpy_storage`` dtype.

        ContainerError naming the field: ``lengths`` (a section that is not 4 N H + T H D
        octets), ``scales`` (a scale that is not a positive normal finite float32), ``codes``
        (a code no encoder writes), ``codec`` (an element type the codec does not code)."""
        check_float_geometry(self.codec.name, geometry)
        check_tokens(tokens)
        name = geometry.dtype.name
        # Scales no encoder writes (valid, but huge) may overflow to ±inf: quietly, as IEEE does.
        with np.errstate(over="ignore"):
            return (from_float32(self._decode_section("K", k_section, geometry, tokens), name),
                    from_float32(self._decode_section("V", v_section, geometry, tokens), name))

    def _decode_section(
        self, which: str, section: BytesLike, geometry: Geometry, tokens: int
    ) -> np.ndarray:
        view = byte_view(section)
        expected = self.section_bytes(geometry, tokens)
        if view.nbytes != expected:
            raise ContainerError(
                "lengths", f"{self.codec.name} {which} section has {view.nbytes} octets, "
                f"{tokens} tokens need {expected}"
            )
        h, d = geometry.kv_heads, geometry.head_dim
        groups = group_count(tokens)
        scales = np.frombuffer(view, dtype=_SCALE_DTYPE, count=groups * h).reshape(groups, h)
        valid = (scales >= SCALE_MIN) & (scales <= _SCALE_MAX)  # False for NaN
        if not valid.all():
            group, head = np.argwhere(~valid)[0]
            raise ContainerError(
                "scales", f"{self.codec.name} {which} scale {float(scales[group, head])!r} "
                f"(token group {group}, head {head}) is not a positive normal finite float32"
            )
        codes = np.frombuffer(view, dtype=self._q.code_dtype, offset=_SCALE_SIZE * groups * h)
        codes = codes.reshape(tokens, h, d)
        bad = self._q.invalid_code(codes)
        if bad is not None:
            token, head, dim = np.unravel_index(bad, codes.shape)
            raise ContainerError(
                "codes", f"{self.codec.name} {which} code 0x{int(codes.reshape(-1)[bad]) & 0xFF:02x} "
                f"(token {token}, head {head}, dim {dim}) is not one an encoder writes"
            )
        values = self._q.dequantize(codes)
        values *= _per_token(scales, tokens)
        return values


def _per_token(scales: np.ndarray, tokens: int) -> np.ndarray:
    """[N, H] group scales as [T, H, 1], each token's group's scale."""
    return np.repeat(scales, GROUP_TOKENS, axis=0)[:tokens, :, None]
