"""The KV Block Container "KVB1" (kvsp-draft §4.3).

Wire layout (all integers big-endian, §4.3)::

    Magic "KVB1" (32) | Version (8) = 1 | Flags (8) = 0 | Codec (16)
    First Layer (32) | Layer Count (32) | Token Count (32)
    Layer Count x { K Length (64), V Length (64) }
    Data: for each layer in ascending order, K octets then V octets

The layer digest of layer ``l`` is SHA-256(K || V); the replica digest is the SHA-256 of the
concatenated layer digests in ascending layer order (§4.3).

What this module offers:

- :class:`ContainerHeader`, :func:`encode_header`, :func:`encode_container`,
  :func:`encode_container_into` and :func:`iter_container_chunks` (zero-copy streaming);
- :func:`decode_container`, a whole-buffer decoder returning a zero-copy :class:`Container`;
- :class:`ContainerDecoder`, an incremental decoder that accepts arbitrary chunking, hands out
  each layer as soon as its octets are complete and hashes while bytes arrive (§4.3: "a
  receiver [can] start using layer l as soon as it has been received");
- :func:`layer_digest`, :func:`replica_digest` and :func:`extract_layers` (layer-range
  retrieval, §6.7 ``layers=a-b``).

Every problem with a container raises :class:`~kvsp_moq.kvsp.errors.ContainerError` whose
``field`` names the culprit (see ``docs/container.md`` for the list). Nothing here allocates
memory in proportion to a length read from the wire: buffers only grow with octets actually
received (untrusted lengths are bounded by :class:`ContainerLimits` before anything else).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from hashlib import sha256
from itertools import accumulate
from typing import Protocol, TypeAlias

from .errors import ContainerError
from .registries import CODEC_RAW, CODECS

__all__ = [
    "BytesLike",
    "Container",
    "ContainerDecoder",
    "ContainerHeader",
    "ContainerLimits",
    "DEFAULT_LIMITS",
    "DIGEST_SIZE",
    "DecodedLayer",
    "FIXED_HEADER_SIZE",
    "LENGTH_ENTRY_SIZE",
    "LayerView",
    "MAGIC",
    "SectionGeometry",
    "VERSION",
    "decode_container",
    "encode_container",
    "encode_container_into",
    "encode_header",
    "extract_layers",
    "iter_container_chunks",
    "layer_digest",
    "replica_digest",
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


def _is_int(value: object) -> bool:
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
            if not _is_int(value) or value < 1:
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
        if not _is_int(layer) or not self.first_layer <= layer <= self.last_layer:
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


def encode_header(
    codec: int, first_layer: int, token_count: int, lengths: Sequence[tuple[int, int]]
) -> bytes:
    """Encode a KVB1 header (§4.3) for sections of the given (K length, V length) pairs."""
    return _make_header(codec, first_layer, token_count, lengths).encode()


def _make_header(
    codec: int, first_layer: int, token_count: int, lengths: Sequence[tuple[int, int]]
) -> ContainerHeader:
    pairs = tuple((k, v) for k, v in lengths)
    return ContainerHeader(VERSION, 0, codec, first_layer, len(pairs), token_count, pairs)


# ---------------------------------------------------------------------------------------------
# Digests (§4.3)


def layer_digest(k: BytesLike, v: BytesLike) -> bytes:
    """SHA-256(K || V) of one layer (§4.3), hashing both sections without concatenating."""
    h = sha256()
    h.update(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Iterable[bytes]) -> bytes:
    """SHA-256 of the layer digests concatenated in ascending layer order (§4.3).

    It equals the Replica Record's ``digest`` only when given the digests of all layers.
    """
    h = sha256()
    for index, digest in enumerate(layer_digests):
        if len(digest) != DIGEST_SIZE:
            raise ContainerError(
                "layer_digests", f"digest {index} has {len(digest)} octets, not {DIGEST_SIZE}"
            )
        h.update(digest)
    return h.digest()


# ---------------------------------------------------------------------------------------------
# Encoding


def _byte_view(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of ``data`` without copying."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ContainerError("data", "buffers must be C-contiguous")
    return view.cast("B")


def _section_views(
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> list[tuple[memoryview, memoryview]]:
    return [(_byte_view(k), _byte_view(v)) for k, v in layers]


def _header_for(
    codec: int, first_layer: int, token_count: int, views: Sequence[tuple[memoryview, memoryview]]
) -> ContainerHeader:
    return _make_header(codec, first_layer, token_count, [(k.nbytes, v.nbytes) for k, v in views])


def encode_container(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> bytes:
    """Encode a container holding ``layers`` = [(K, V), ...] from ``first_layer`` on (§4.3).

    One allocation of the final size: ``bytes.join`` sizes the result first and copies each
    section into it once (no zero fill, no intermediate buffers).
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    parts: list[BytesLike] = [header.encode()]
    for k, v in views:
        parts.append(k)
        parts.append(v)
    return b"".join(parts)


def encode_container_into(
    buffer: bytearray | memoryview,
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
    offset: int = 0,
) -> int:
    """Write the container straight into ``buffer`` at ``offset``; returns octets written.

    For destinations that already exist (a mapped file, a pinned staging buffer).
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    out = _byte_view(buffer)
    if out.readonly or offset < 0 or offset + header.total_size > out.nbytes:
        raise ContainerError(
            "data", f"buffer cannot take {header.total_size} octets at offset {offset}"
        )
    header.pack_into(out, offset)
    pos = offset + header.header_size
    for k, v in views:
        out[pos : pos + k.nbytes] = k
        pos += k.nbytes
        out[pos : pos + v.nbytes] = v
        pos += v.nbytes
    return pos - offset


def iter_container_chunks(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> Iterator[memoryview]:
    """Yield the container as the header, then each non-empty K and V section (§4.3 order).

    The sections are views of the caller's buffers (zero-copy): for streaming a response.
    The header is validated before the first chunk is yielded.
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    yield memoryview(header.encode())
    for k, v in views:
        if k.nbytes:
            yield k
        if v.nbytes:
            yield v


# ---------------------------------------------------------------------------------------------
# Header parsing (shared by both decoders)


@dataclass(frozen=True, slots=True)
class _Fixed:
    """The validated fixed part of a header, before its lengths table has arrived."""

    codec: int
    first_layer: int
    layer_count: int
    token_count: int

    @property
    def header_size(self) -> int:
        return FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * self.layer_count


def _check_prefix(buf: bytearray | memoryview) -> None:
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


def _parse_fixed(buf: bytearray | memoryview, limits: ContainerLimits) -> _Fixed:
    """Parse and validate the 20 fixed octets (§4.3) at the start of ``buf``."""
    _check_prefix(buf[:FIXED_HEADER_SIZE])
    _, _, _, codec, first_layer, layer_count, token_count = _FIXED.unpack_from(buf, 0)
    _check_counts(first_layer, layer_count, token_count, limits)
    return _Fixed(codec, first_layer, layer_count, token_count)


def _parse_lengths(
    fixed: _Fixed,
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


def _truncated_data(header: ContainerHeader, have: int) -> ContainerError:
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


# ---------------------------------------------------------------------------------------------
# Whole-buffer decoding


@dataclass(frozen=True, slots=True)
class LayerView:
    """One layer of a decoded :class:`Container`: read-only views into the container octets."""

    index: int  # absolute layer index
    k: memoryview
    v: memoryview

    def digest(self) -> bytes:
        """The layer digest SHA-256(K || V) (§4.3)."""
        return layer_digest(self.k, self.v)


class Container:
    """A validated KVB1 container over a read-only, zero-copy view of its octets.

    Obtain one with :func:`decode_container`. Layer accessors take absolute layer indices.
    """

    __slots__ = ("_header", "_view", "_digests")

    def __init__(self, header: ContainerHeader, view: memoryview) -> None:
        self._header = header
        self._view = view
        self._digests: tuple[bytes, ...] | None = None

    @property
    def header(self) -> ContainerHeader:
        return self._header

    @property
    def buffer(self) -> memoryview:
        """All octets of the container (read-only)."""
        return self._view

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def layer(self, index: int) -> LayerView:
        """Absolute layer ``index``; ContainerError(field="layers") if not held."""
        k_start, v_start, end = self._header.offsets(index)
        view = self._view
        return LayerView(index, view[k_start:v_start], view[v_start:end])

    def layer_payload(self, index: int) -> memoryview:
        """K followed by V of absolute layer ``index`` as one contiguous view.

        This is the MOQT object payload of binding v1; its SHA-256 is the layer digest.
        """
        k_start, _, end = self._header.offsets(index)
        return self._view[k_start:end]

    def layers(self) -> list[LayerView]:
        """All layers in ascending order."""
        h = self._header
        return [self.layer(i) for i in range(h.first_layer, h.last_layer + 1)]

    def layer_digests(self) -> list[bytes]:
        """The layer digests (§4.3) of the held layers, ascending; computed once."""
        if self._digests is None:
            view = self._view
            self._digests = tuple(
                sha256(view[start:end]).digest() for start, _, end in self._header.layer_offsets
            )
        return list(self._digests)

    def replica_digest(self) -> bytes:
        """SHA-256 over :meth:`layer_digests` (§4.3).

        This is the replica digest only when the container holds every layer of the block.
        """
        return replica_digest(self.layer_digests())

    def __repr__(self) -> str:
        h = self._header
        return (
            f"Container(codec=0x{h.codec:04x}, layers={h.first_layer}-{h.last_layer}, "
            f"tokens={h.token_count}, nbytes={self.nbytes})"
        )


def decode_container(
    data: BytesLike,
    *,
    geometry: SectionGeometry | None = None,
    limits: ContainerLimits = DEFAULT_LIMITS,
) -> Container:
    """Validate a whole container (§4.3) and return a zero-copy :class:`Container`.

    With ``geometry`` and codec raw, every K and V length must equal the geometry's section
    size for the Token Count (kvsp-layout-1). Raises :class:`ContainerError` on any problem.
    """
    view = _byte_view(data).toreadonly()
    n = view.nbytes
    _check_prefix(view[:FIXED_HEADER_SIZE])
    if n < FIXED_HEADER_SIZE:
        raise ContainerError("truncated", f"header needs {FIXED_HEADER_SIZE} octets, got {n}")
    fixed = _parse_fixed(view, limits)
    if n < fixed.header_size:
        raise ContainerError(
            "truncated",
            f"lengths table of {fixed.layer_count} layers needs {fixed.header_size} octets, "
            f"got {n}",
        )
    header = _parse_lengths(fixed, view, limits, geometry)
    total = header.total_size
    if n < total:
        raise _truncated_data(header, n)
    if n > total:
        raise ContainerError("trailing", f"{n - total} octets after the last layer")
    return Container(header, view)


def extract_layers(data_or_container: BytesLike | Container, first: int, last: int) -> bytes:
    """A new container holding the inclusive absolute layer range [first, last] (§4.3, §6.7).

    The sections are copied once, straight from the source into the result.
    ContainerError(field="layers") when the range is empty or not inside the container.
    """
    container = (
        data_or_container
        if isinstance(data_or_container, Container)
        else decode_container(data_or_container)
    )
    header = container.header
    if not (_is_int(first) and _is_int(last)) or first > last:
        raise ContainerError("layers", f"invalid layer range {first!r}-{last!r}")
    if first < header.first_layer or last > header.last_layer:
        raise ContainerError(
            "layers",
            f"layers {first}-{last} are not all in the container "
            f"({header.first_layer}-{header.last_layer})",
        )
    sections = [(lv.k, lv.v) for lv in (container.layer(i) for i in range(first, last + 1))]
    return encode_container(header.codec, first, header.token_count, sections)


# ---------------------------------------------------------------------------------------------
# Incremental decoding


@dataclass(frozen=True, slots=True)
class DecodedLayer:
    """A layer completed by :class:`ContainerDecoder`: read-only K and V views and its digest."""

    index: int  # absolute layer index
    k: memoryview
    v: memoryview
    digest: bytes  # SHA-256(K || V), computed while the octets arrived (§4.3)


class ContainerDecoder:
    """Incremental (sans-IO) KVB1 decoder: ``feed`` it octets in any chunking.

    ``feed`` returns the layers completed by that chunk, in ascending order, so layer ``l`` is
    usable as soon as its octets are in (§4.3). The header is validated as soon as it is
    complete (bad magic, version, flags and codec as soon as their octets arrive). After the
    last layer any octet is an error (``trailing``); :meth:`finish` reports truncation. Once an
    error was raised, every later call raises it again.

    Memory: header octets are buffered up to the size the (limit-checked) header declares;
    a layer's buffer grows only with octets received (``bytearray`` appends, amortised
    linear), so a forged length cannot trigger a large allocation. A layer lying entirely
    inside one ``bytes`` chunk is not copied at all: its views point into that chunk.
    """

    def __init__(
        self,
        *,
        geometry: SectionGeometry | None = None,
        limits: ContainerLimits = DEFAULT_LIMITS,
    ) -> None:
        self._geometry = geometry
        self._limits = limits
        self._head = bytearray()  # header octets received so far
        self._head_need = FIXED_HEADER_SIZE  # header octets needed for the next step
        self._fixed: _Fixed | None = None
        self._header: ContainerHeader | None = None
        self._position = 0  # 0-based position of the layer being received
        self._buf = bytearray()  # octets of the current layer (K then V)
        self._hash = sha256()  # digest of the current layer so far
        self._digests: list[bytes] = []
        self._received = 0
        self._error: ContainerError | None = None

    # -- state ------------------------------------------------------------------------------

    @property
    def header(self) -> ContainerHeader | None:
        """The validated header once complete, else None."""
        return self._header

    @property
    def done(self) -> bool:
        """True once the last layer is complete."""
        h = self._header
        return h is not None and self._position == h.layer_count

    @property
    def received(self) -> int:
        """Octets fed so far."""
        return self._received

    @property
    def layer_digests(self) -> list[bytes]:
        """Digests of the layers completed so far, ascending."""
        return list(self._digests)

    def replica_digest(self) -> bytes:
        """SHA-256 over the layer digests (§4.3); requires the container to be complete."""
        self.finish()
        return replica_digest(self._digests)

    # -- input ------------------------------------------------------------------------------

    def feed(self, chunk: BytesLike) -> list[DecodedLayer]:
        """Consume ``chunk``; return the layers it completed (possibly none)."""
        if self._error is not None:
            raise self._error
        try:
            view = _byte_view(chunk)
            self._received += view.nbytes
            return self._feed(view, zero_copy=type(chunk) is bytes)
        except ContainerError as exc:
            self._error = exc
            raise

    def finish(self) -> ContainerHeader:
        """Assert the container is complete; ContainerError("truncated") if it is not."""
        if self._error is not None:
            raise self._error
        header = self._header
        if header is None:
            what = "header" if self._fixed is None else "lengths table"
            self._error = ContainerError(
                "truncated", f"{what} incomplete: {len(self._head)} of {self._head_need} octets"
            )
            raise self._error
        if self._position < header.layer_count:
            self._error = _truncated_data(header, self._received)
            raise self._error
        return header

    # -- internals --------------------------------------------------------------------------

    def _feed(self, view: memoryview, *, zero_copy: bool) -> list[DecodedLayer]:
        pos = 0
        if self._header is None:
            pos = self._feed_header(view)
        if self._header is None:
            return []
        out: list[DecodedLayer] = []
        header = self._header
        n = view.nbytes
        while self._position < header.layer_count:
            k_len, v_len = header.lengths[self._position]
            want = k_len + v_len - len(self._buf)
            take = min(want, n - pos)
            piece = view[pos : pos + take]
            pos += take
            self._hash.update(piece)  # incremental digest (§4.3), per chunk
            if take < want:
                self._buf += piece  # grows only with octets received
                return out
            if zero_copy and not self._buf:
                payload = piece.toreadonly()  # whole layer inside an immutable chunk
            else:
                self._buf += piece
                payload = memoryview(self._buf).toreadonly()
                self._buf = bytearray()
            out.append(self._complete_layer(payload, k_len))
        if pos < n:
            raise ContainerError("trailing", f"{n - pos} octets after the last layer")
        return out

    def _feed_header(self, view: memoryview) -> int:
        """Take header octets from ``view``; return how many were consumed."""
        pos = 0
        n = view.nbytes
        while self._header is None:
            take = min(self._head_need - len(self._head), n - pos)
            self._head += view[pos : pos + take]
            pos += take
            if len(self._head) < self._head_need:
                if self._fixed is None:
                    _check_prefix(self._head)  # fail fast on garbage
                return pos
            if self._fixed is None:
                # Fixed fields complete: validated (and limits applied) before the
                # lengths table, whose size they bound, is buffered.
                self._fixed = _parse_fixed(self._head, self._limits)
                self._head_need = self._fixed.header_size
            else:
                self._header = _parse_lengths(self._fixed, self._head, self._limits, self._geometry)
                self._head = bytearray()
        return pos

    def _complete_layer(self, payload: memoryview, k_len: int) -> DecodedLayer:
        assert self._header is not None
        digest = self._hash.digest()
        layer = DecodedLayer(
            self._header.first_layer + self._position, payload[:k_len], payload[k_len:], digest
        )
        self._digests.append(digest)
        self._hash = sha256()
        self._position += 1
        return layer
