"""Codec ``fp8-e4m3`` (0xFF01, private use): e4m3fn codes under a float32 scale per 16-token
group and KV head, K and V scaled apart (section layout: :mod:`.scaled`, docs/container.md).

e4m3fn (the OCP "FN" variant, registry element type ``fp8-e4m3``): sign, 4 exponent bits
(bias 7), 3 mantissa bits; no infinities; 0x7F and 0xFF are NaN, which no encoder writes and
every decoder rejects. Largest magnitude 448 (0x7E); subnormals m x 2**-9 for m = 1..7.

Rounding float32 ``y`` (|y| <= 448 after the clamp) to a code, to nearest, ties to even, the
sign bit kept (so -0.0 and values rounding to zero from below give 0x80):

- |y| >= 2**-6: keep the top 3 of float32's 23 mantissa bits, rounding the 20 others to
  nearest even (a carry may raise the exponent); code = ((E - 120) << 3) | M, where E is
  float32's biased exponent of the rounded value and M its top 3 mantissa bits;
- |y| < 2**-6: code = round-half-even(|y| x 512), 0..8 (8 is 0x08, the smallest normal 2**-6).
"""

from __future__ import annotations

import numpy as np

from ..registries import CODEC_FP8_E4M3
from .scaled import Quantizer, ScaledCodec

__all__ = ["E4M3_MAX", "FP8_E4M3", "e4m3_codes", "e4m3_values"]

E4M3_MAX = 448.0
_MIN_NORMAL = np.float32(2.0**-6)
_SUBNORMAL_STEPS = np.float32(512.0)  # 1 / 2**-9
_BIAS_SHIFT = np.uint32(120 << 3)  # (float32 bias 127 - e4m3 bias 7), in the code's exponent field


def _value_table() -> np.ndarray:
    """The float32 value of each of the 256 codes (NaN for 0x7F and 0xFF)."""
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * mantissa * 2.0**-9
        else:
            table[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    table.setflags(write=False)
    return table


_VALUES = _value_table()


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float32 ``y`` (|y| <= 448), to nearest, ties to even."""
    magnitude = np.abs(y)
    bits = magnitude.view(np.uint32)
    # Normal range: round the mantissa to 3 bits (ties to even), then rebias the exponent.
    # In place, modulo 2**32: the entries below 2**-6 get junk here and are replaced below.
    rounded = bits >> np.uint32(20)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFFF)
    rounded += bits
    rounded >>= np.uint32(20)
    rounded -= _BIAS_SHIFT
    codes = rounded.astype(np.uint8)
    small = magnitude < _MIN_NORMAL
    if small.any():  # rare: |x| below amax / 28672 of its group
        # Subnormal range: multiples of 2**-9 (the scaling by 512 is exact), 0..8.
        codes[small] = np.rint(magnitude[small] * _SUBNORMAL_STEPS).astype(np.uint8)
    codes |= np.signbit(y).view(np.uint8) << np.uint8(7)
    return codes


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """Float32 values of uint8 e4m3fn codes (a new array)."""
    return _VALUES[codes]


def _first_nan(codes: np.ndarray) -> int | None:
    nan = (codes & np.uint8(0x7F)) == np.uint8(0x7F)
    return int(nan.argmax()) if nan.any() else None


FP8_E4M3 = ScaledCodec(
    CODEC_FP8_E4M3,
    Quantizer(E4M3_MAX, np.dtype(np.uint8), e4m3_codes, e4m3_values, _first_nan),
)
