"""Codec ``int8`` (0xFF02, private use): symmetric int8 codes under a float32 scale per
16-token group and KV head, K and V scaled apart (section layout: :mod:`.scaled`).

code = round-half-even(clamp(x / scale, -127, 127)), two's complement; -128 (0x80) is never
written and every decoder rejects it, so the code set is symmetric and 0 is exact. A decoded
element is within scale / 2 of the original (before the final rounding to the element type).
"""

from __future__ import annotations

import numpy as np

from ..registries import CODEC_INT8
from .scaled import Quantizer, ScaledCodec

__all__ = ["INT8", "INT8_MAX", "int8_codes", "int8_values"]

INT8_MAX = 127.0


def int8_codes(y: np.ndarray) -> np.ndarray:
    """int8 codes of float32 ``y`` (|y| <= 127): nearest integer, ties to even."""
    return np.rint(y).astype(np.int8)


def int8_values(codes: np.ndarray) -> np.ndarray:
    """Float32 values of int8 codes (a new array)."""
    return codes.astype(np.float32)


def _first_minus_128(codes: np.ndarray) -> int | None:
    bad = codes == np.int8(-128)
    return int(bad.argmax()) if bad.any() else None


INT8 = ScaledCodec(
    CODEC_INT8,
    Quantizer(INT8_MAX, np.dtype(np.int8), int8_codes, int8_values, _first_minus_128),
)
