"""The KVB1 header (kvsp-draft §4.3): its fixed fields and lengths table, their limits and
checks, and the parsing both decoders share (:mod:`.decode`).

Every problem raises :class:`~kvsp_moq.kvsp.errors.ContainerError` whose ``field`` names the
culprit (``docs/container.md``). Untrusted lengths are bounded by :class:`ContainerLimits`
before anything is allocated for them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Protocol, TypeAlias

from ..errors import ContainerError
from ..registries import CODEC_RAW, CODECS

__all__ = [
    "BytesLike",
    "ContainerHeader",
    "ContainerLimits",
    "DEFAULT_LIMITS",
    "DIGEST_SIZE",
    "FIXED_HEADER_SIZE",
    "HeaderFixed",
    "LENGTH_ENTRY_SIZE",
    "MAGIC",
    "SectionGeometry",
    "VERSION",
    "byte_view",
    "check_prefix",
    "is_int",
    "parse_fixed",
    "parse_lengths",
    "truncated_data",
]

BytesLike: TypeAlias = "bytes | bytearray | memoryview"
"""Anything exposing a C-contiguous buffer (numpy arrays work at run time too)."""

MAGIC = b"KVB1"  # 0x4B564231 (§4.3)
VERSION = 1  # §4.3 "Version is 1"
DIGEST_SIZE = 32  # SHA-256

# Magic, Version, Flags, Codec, First Layer, Layer Count, Token Count (§4.3).
_FIXED = struct.Struct(">4sBBHIII")
FIXED_HEADER_SIZE = _FIXED.size  # 20 octets
# One entry of the lengths table: K Length (64), V Length (64) (§4.3).
LENGTH_ENTRY_SIZE = 16

_UINT32_LIMIT = 1 << 32
_UINT64_LIMIT = 1 << 64


# ---------------------------------------------------------------------------------------------
# Limits and geometry


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ContainerLimits:
    """Bounds a decoder applies to untrusted header fields before acting on them.

    The wire format allows 2**32 layers and 2**64-octet sections; a receiver must not trust
    either. Exceeding a limit raises :class:`ContainerError` naming the header field.
    """

    max_layer_count: int = 4096
    max_section_bytes: int = 1 << 34  # per K or V section
    max_token_count: int = 1 << 24

    def __post_init__(self) -> None:
        for name in ("max_layer_count", "max_section_bytes", "max_token_count"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ContainerError("limits", f"{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = ContainerLimits()


class SectionGeometry(Protocol):
    """What the decoders need of a geometry: the octet size of one K or V section.

    :class:`kvsp_moq.kvsp.layout.Geometry` implements it for codec raw (kvsp-layout-1).
    """

    def section_bytes(self, tokens: int) -> int:
        """Octets of one K (or V) section holding ``tokens`` tokens."""
        ...


# ---------------------------------------------------------------------------------------------
# Field checks (shared by the header dataclass, the encoders and both decoders)


def _check_uint(field: str, value: object, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise ContainerError(field, f"must be an integer in [0, {limit}), got {value!r}")
    return value


def _check_magic(magic: bytes) -> None:
    # §4.3: Magic "KVB1". A prefix is checked too, so garbage fails after its first octets.
    if not MAGIC.startswith(magic):
        raise ContainerError("magic", f"expected {MAGIC!r}, got {magic!r}")


def _check_version(version: int) -> None:
    # §4.3: "Version is 1."
    if version != VERSION:
        raise ContainerError("version", f"unsupported version {version} (only {VERSION})")


def _check_flags(flags: int) -> None:
    # §4.3: "Flags are reserved and set to zero."
    if flags != 0:
        raise ContainerError("flags", f"reserved flags must be zero, got 0x{flags:02x}")


def _check_codec(codec: int) -> None:
    # §4.3 / §11.2.2: Codec is a value from the "KVSP Codecs" registry.
    if codec not in CODECS:
        raise ContainerError("codec", f"unregistered codec 0x{codec:04x}")


def _check_counts(
    first_layer: int, layer_count: int, token_count: int, limits: ContainerLimits | None
) -> None:
    """Layer range and token count (§4.3); ``limits`` None checks only what the format allows."""
    if layer_count == 0:
        raise ContainerError("layer_count", "a container holds at least one layer")
    if first_layer + layer_count > _UINT32_LIMIT:
        raise ContainerError(
            "first_layer",
            f"first_layer {first_layer} + layer_count {layer_count} overflows uint32",
        )
    if limits is None:
        return
    if layer_count > limits.max_layer_count:
        raise ContainerError(
            "layer_count", f"{layer_count} layers exceed the limit of {limits.max_layer_count}"
        )
    if token_count > limits.max_token_count:
        raise ContainerError(
            "token_count", f"{token_count} tokens exceed the limit of {limits.max_token_count}"
        )


def _check_lengths(
    codec: int,
    first_layer: int,
    token_count: int,
    lengths: Sequence[tuple[int, int]],
    limits: ContainerLimits,
    geometry: SectionGeometry | None,
) -> None:
    """The lengths table against the limits and, for codec raw, the geometry (§4.3)."""
    expected = None
    if geometry is not None and codec == CODEC_RAW.value:
        # kvsp-layout-1: each section holds Token Count x kv_heads x head_dim elements.
        expected = geometry.section_bytes(token_count)
    cap = limits.max_section_bytes
    for position, (k_len, v_len) in enumerate(lengths):
        layer = first_layer + position
        if k_len > cap or v_len > cap:
            raise ContainerError(
                "lengths",
                f"layer {layer}: section of {max(k_len, v_len)} octets exceeds the limit of {cap}",
            )
        if expected is None:
            continue
        if k_len != v_len:
            raise ContainerError(
                "lengths", f"layer {layer}: K length {k_len} != V length {v_len} (codec raw)"
            )
        if k_len != expected:
            raise ContainerError(
                "lengths",
                f"layer {layer}: section length {k_len} != {expected} "
                f"({token_count} tokens of the geometry)",
            )


# ---------------------------------------------------------------------------------------------
# Header


@dataclass(frozen=True)
class ContainerHeader:
    """The header of a KVB1 container (§4.3): fixed fields plus the lengths table.

    Construction validates what the format itself requires (version 1, zero flags, a
    registered codec, at least one layer, a layer range inside uint32, uint64 lengths, one
    length entry per layer). Decoder limits and geometry are checked by the decoders.
    """

    version: int
    flags: int
    codec: int
    first_layer: int
    layer_count: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        _check_version(_check_uint("version", self.version, 1 << 8))
        _check_flags(_check_uint("flags", self.flags, 1 << 8))
        _check_codec(_check_uint("codec", self.codec, 1 << 16))
        first = _check_uint("first_layer", self.first_layer, _UINT32_LIMIT)
        count = _check_uint("layer_count", self.layer_count, _UINT32_LIMIT)
        tokens = _check_uint("token_count", self.token_count, _UINT32_LIMIT)
        _check_counts(first, count, tokens, None)
        if not isinstance(self.lengths, tuple) or len(self.lengths) != count:
            raise ContainerError("lengths", f"need a tuple of {count} (K, V) length pairs")
        for entry in self.lengths:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ContainerError("lengths", f"entry {entry!r} is not a (K, V) length pair")
            _check_uint("lengths", entry[0], _UINT64_LIMIT)
            _check_uint("lengths", entry[1], _UINT64_LIMIT)

    @property
    def header_size(self) -> int:
        """Octets before the data: 20 fixed + 16 per layer (§4.3)."""
        return FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * self.layer_count

    @cached_property
    def data_size(self) -> int:
        """Octets of all K and V sections together."""
        return sum(k + v for k, v in self.lengths)

    @property
    def total_size(self) -> int:
        """Octets of the whole container."""
        return self.header_size + self.data_size

    @property
    def last_layer(self) -> int:
        """The absolute index of the last layer held (inclusive)."""
        return self.first_layer + self.layer_count - 1

    @cached_property
    def layer_offsets(self) -> tuple[tuple[int, int, int], ...]:
        """Per layer, in ascending order: (K start, V start, V end) from the container start."""
        starts = accumulate((k + v for k, v in self.lengths), initial=self.header_size)
        return tuple(
            (start, start + k_len, start + k_len + v_len)
            for start, (k_len, v_len) in zip(starts, self.lengths, strict=False)
        )

    def position(self, layer: int) -> int:
        """0-based position of absolute ``layer``; ContainerError(field="layers") if absent."""
        if not is_int(layer) or not self.first_layer <= layer <= self.last_layer:
            raise ContainerError(
                "layers",
                f"layer {layer!r} is not in the container ({self.first_layer}-{self.last_layer})",
            )
        return layer - self.first_layer

    def offsets(self, layer: int) -> tuple[int, int, int]:
        """(K start, V start, V end) of absolute ``layer`` from the container start."""
        return self.layer_offsets[self.position(layer)]

    def encode(self) -> bytes:
        """The header octets (§4.3)."""
        out = bytearray(self.header_size)
        self.pack_into(out, 0)
        return bytes(out)

    def pack_into(self, buffer: bytearray | memoryview, offset: int = 0) -> None:
        """Write the header octets into ``buffer`` at ``offset``."""
        _FIXED.pack_into(
            buffer, offset, MAGIC, self.version, self.flags, self.codec,
            self.first_layer, self.layer_count, self.token_count,
        )
        flat = [n for pair in self.lengths for n in pair]
        struct.pack_into(f">{len(flat)}Q", buffer, offset + FIXED_HEADER_SIZE, *flat)


def byte_view(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of ``data`` without copying."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ContainerError("data", "buffers must be C-contiguous")
    return view.cast("B")


# ---------------------------------------------------------------------------------------------
# Header parsing (shared by both decoders)


@dataclass(frozen=True, slots=True)
class HeaderFixed:
    """The validated fixed part of a header, before its lengths table has arrived."""

    codec: int
    first_layer: int
    layer_count: int
    token_count: int

    @property
    def header_size(self) -> int:
        return FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * self.layer_count


def check_prefix(buf: bytearray | memoryview) -> None:
    """Validate whatever fixed fields ``buf`` (a header prefix) already holds, so that a bad
    magic, version, flags or codec is reported as such even when the input is short."""
    n = len(buf)
    _check_magic(bytes(buf[: min(n, 4)]))
    if n > 4:
        _check_version(buf[4])
    if n > 5:
        _check_flags(buf[5])
    if n >= 8:
        _check_codec(int.from_bytes(buf[6:8], "big"))


def parse_fixed(buf: bytearray | memoryview, limits: ContainerLimits) -> HeaderFixed:
    """Parse and validate the 20 fixed octets (§4.3) at the start of ``buf``."""
    check_prefix(buf[:FIXED_HEADER_SIZE])
    _, _, _, codec, first_layer, layer_count, token_count = _FIXED.unpack_from(buf, 0)
    _check_counts(first_layer, layer_count, token_count, limits)
    return HeaderFixed(codec, first_layer, layer_count, token_count)


def parse_lengths(
    fixed: HeaderFixed,
    buf: bytearray | memoryview,
    limits: ContainerLimits,
    geometry: SectionGeometry | None,
) -> ContainerHeader:
    """Parse the lengths table (it follows the fixed octets in ``buf``) into the header."""
    flat = struct.unpack_from(f">{2 * fixed.layer_count}Q", buf, FIXED_HEADER_SIZE)
    lengths = tuple(zip(flat[0::2], flat[1::2], strict=True))
    _check_lengths(fixed.codec, fixed.first_layer, fixed.token_count, lengths, limits, geometry)
    return ContainerHeader(
        VERSION, 0, fixed.codec, fixed.first_layer, fixed.layer_count, fixed.token_count, lengths
    )


def truncated_data(header: ContainerHeader, have: int) -> ContainerError:
    """The error for a container whose data stops at ``have`` octets (from its start)."""
    for position, (_, _, end) in enumerate(header.layer_offsets):
        if end > have:
            layer = header.first_layer + position
            return ContainerError(
                "truncated",
                f"data ends in layer {layer}: container needs {header.total_size} octets, "
                f"got {have}",
            )
    raise AssertionError("not truncated")  # pragma: no cover
