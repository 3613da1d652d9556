"""The KVSP registries (kvsp-draft §11.2) as this implementation knows them.

The draft creates three registries but does not list their initial contents in the text we
have; the values here are ours and recorded in ``docs/decisions/0001-registries.md``.

- "KVSP Codecs" (§11.2.2): ``raw`` = 0x0001 (kvsp-layout-1, §4.3); in the private-use range
  0xFF00-0xFFFF until assigned, ``fp8-e4m3`` = 0xFF01, ``int8`` = 0xFF02 and ``zstd-planes``
  = 0xFF03 (their section encodings: :mod:`kvsp_moq.kvsp.codecs`, docs/container.md "Codecs").
- "KVSP Element Types" (§11.2.3): ``fp32``, ``fp16``, ``bf16``, ``fp8-e4m3``, ``fp8-e5m2``, ``int8``.
- "KVSP Positional Encodings": ``rope``, ``alibi``, ``none`` with the parameter syntax
  ``name[;key=value]...`` (see :func:`parse_positional`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping


# ---------------------------------------------------------------------------------------------
# Codecs (§11.2.2)


@dataclass(frozen=True)
class Codec:
    value: int
    name: str
    description: str


CODEC_RAW = Codec(0x0001, "raw", "uncompressed K and V sections in layout kvsp-layout-1 (§4.3)")

PRIVATE_USE_CODECS = range(0xFF00, 0x10000)
"""Codec values for private use (RFC 8126 §4.1): ours until the registry assigns values."""

CODEC_FP8_E4M3 = Codec(
    0xFF01, "fp8-e4m3",
    "fp8 e4m3fn codes with a float32 scale per 16-token group and KV head, K and V apart",
)
CODEC_INT8 = Codec(
    0xFF02, "int8", "symmetric int8 codes with a float32 scale per 16-token group and KV head"
)
CODEC_ZSTD_PLANES = Codec(
    0xFF03, "zstd-planes", "lossless: the elements' byte planes in one Zstandard frame"
)

CODECS: Mapping[int, Codec] = MappingProxyType(
    {c.value: c for c in (CODEC_RAW, CODEC_FP8_E4M3, CODEC_INT8, CODEC_ZSTD_PLANES)}
)
CODECS_BY_NAME: Mapping[str, Codec] = MappingProxyType({c.name: c for c in CODECS.values()})


def codec_by_value(value: int) -> Codec:
    """The registered codec with this 16-bit value; ``KeyError`` if unregistered."""
    return CODECS[value]


def codec_by_name(name: str) -> Codec:
    """The registered codec with this name (the MOQT track name of binding v1)."""
    return CODECS_BY_NAME[name]


# ---------------------------------------------------------------------------------------------
# Element types (§11.2.3)


@dataclass(frozen=True)
class ElementType:
    """An element type of the stored cache.

    ``numpy_storage`` is the little-endian numpy dtype that holds one element bit for bit:
    numpy has no bf16/fp8 dtypes, so those are carried as their raw unsigned bit patterns.
    ``torch_name`` is the ``torch.dtype`` attribute name used by the torch sinks.
    """

    name: str
    itemsize: int
    numpy_storage: str
    torch_name: str


ELEMENT_TYPES: Mapping[str, ElementType] = MappingProxyType(
    {
        e.name: e
        for e in (
            ElementType("fp32", 4, "<f4", "float32"),
            ElementType("fp16", 2, "<f2", "float16"),
            ElementType("bf16", 2, "<u2", "bfloat16"),
            ElementType("fp8-e4m3", 1, "u1", "float8_e4m3fn"),
            ElementType("fp8-e5m2", 1, "u1", "float8_e5m2"),
            ElementType("int8", 1, "i1", "int8"),
        )
    }
)


def element_type(name: str) -> ElementType:
    """The registered element type; ``KeyError`` if unregistered."""
    return ELEMENT_TYPES[name]


# ---------------------------------------------------------------------------------------------
# Positional encodings


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a finite number > 0")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit():
        raise ValueError("must be a decimal integer > 0")
    value = int(text)
    if value <= 0:
        raise ValueError("must be a decimal integer > 0")
    return value


def _rope_scaling(text: str) -> str:
    if text not in ("linear", "ntk", "yarn", "llama3"):
        raise ValueError("must be one of linear, ntk, yarn, llama3")
    return text


@dataclass(frozen=True)
class PositionalEncoding:
    """A registered positional encoding and the parameters its syntax admits."""

    name: str
    parameters: Mapping[str, Callable[[str], object]]


POSITIONAL_ENCODINGS: Mapping[str, PositionalEncoding] = MappingProxyType(
    {
        p.name: p
        for p in (
            PositionalEncoding(
                "rope",
                MappingProxyType(
                    {
                        "theta": _positive_float,  # base frequency, model default e.g. 10000
                        "dim": _positive_int,  # rotary dimensions when partial rotary
                        "scaling": _rope_scaling,
                        "factor": _positive_float,
                        "original_max_position": _positive_int,
                    }
                ),
            ),
            PositionalEncoding("alibi", MappingProxyType({"max_bias": _positive_float})),
            PositionalEncoding("none", MappingProxyType({})),
        )
    }
)


@dataclass(frozen=True)
class Positional:
    """A parsed ``positional`` member: the encoding and its explicit parameters."""

    name: str
    params: Mapping[str, object]


def parse_positional(text: str) -> Positional:
    """Parse ``name[;key=value]...`` against the registry.

    Raises ``ValueError`` naming the problem: unregistered name, unknown or repeated
    parameter, a parameter without ``=``, or a value its syntax rejects.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("must be a non-empty string")
    name, *pairs = text.split(";")
    encoding = POSITIONAL_ENCODINGS.get(name)
    if encoding is None:
        raise ValueError(f"{name!r} is not a registered positional encoding "
                         f"({', '.join(sorted(POSITIONAL_ENCODINGS))})")
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"parameter {pair!r} is not key=value")
        parse = encoding.parameters.get(key)
        if parse is None:
            raise ValueError(f"{name} has no parameter {key!r}")
        if key in params:
            raise ValueError(f"parameter {key!r} given twice")
        try:
            params[key] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"parameter {key}={raw!r}: {exc}") from None
    return Positional(name, MappingProxyType(params))


def format_number(value: float | int) -> str:
    """The one text of a positional parameter's number: an integer value as a decimal integer
    (``1000000``, never ``1e+06`` or ``1000000.0``), any other value as Python's shortest
    round-trip ``repr`` (``0.5``). Every producer of a descriptor uses it, so one model gets one
    ``positional`` string and one Compatibility ID whichever code path describes it."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return str(int(number)) if number.is_integer() else repr(number)


def format_positional(name: str, params: Mapping[str, object] | None = None) -> str:
    """The canonical ``positional`` member (§4.1) for encoding ``name`` with ``params``: the
    parameters in the registry's order (not the caller's), numbers by :func:`format_number`.
    ``ValueError`` for an unregistered name or parameter, or a value its syntax rejects (the
    result is parsed back with :func:`parse_positional`)."""
    encoding = POSITIONAL_ENCODINGS.get(name)
    if encoding is None:
        raise ValueError(f"{name!r} is not a registered positional encoding "
                         f"({', '.join(sorted(POSITIONAL_ENCODINGS))})")
    given = {k: v for k, v in (params or {}).items() if v is not None}
    unknown = sorted(set(given) - set(encoding.parameters))
    if unknown:
        raise ValueError(f"{name} has no parameter {unknown[0]!r}")
    parts = [name]
    for key in encoding.parameters:  # the registry's order
        if key in given:
            value = given[key]
            text = value if isinstance(value, str) else format_number(value)  # type: ignore[arg-type]
            parts.append(f"{key}={text}")
    text = ";".join(parts)
    parse_positional(text)
    return text


# ---------------------------------------------------------------------------------------------
# Layouts (§4.1 "layout", §4.3)

LAYOUTS = frozenset({"kvsp-layout-1"})
